// ValidateKV of the kvt.v1.KvTranslator service: source cache, the target's true cache and
// optionally the target's queries in; the translation is computed by the backend exactly as
// TranslateKV would return it, then compared with the truth per SPEC 5 (quality/kv_quality.h).
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "quality/kv_quality.h"
#include "server/measure_translation.h"
#include "server/request_checks.h"
#include "server/translate/request_plan.h"
#include "server/translator_service.h"
#include "transport/kv_chunks.h"

namespace kvt {
namespace {

// One whole-layer buffer per (layer, K|V) of a cache, uninitialised.
struct CacheBuffers {
  std::vector<std::unique_ptr<char[]>> k, v;
  CacheBuffers(int layers, int64_t layer_bytes, bool with_v) {
    for (int l = 0; l < layers; ++l) {
      k.emplace_back(new char[static_cast<size_t>(layer_bytes)]);
      if (with_v) v.emplace_back(new char[static_cast<size_t>(layer_bytes)]);
    }
  }
};

void FillLayerQuality(uint32_t layer, const LayerQuality& quality, v1::LayerQuality* out) {
  out->set_layer(layer);
  out->set_r2_k(quality.r2_k);
  out->set_r2_v(quality.r2_v);
  out->set_cosine_k(quality.cosine_k);
  out->set_cosine_v(quality.cosine_v);
  if (quality.attention_cosine) out->set_attention_cosine(*quality.attention_cosine);
  if (quality.c_k) out->set_c_k(*quality.c_k);
  if (quality.c_v) out->set_c_v(*quality.c_v);
}

const char* RoleName(v1::ValidateRole role) {
  switch (role) {
    case v1::VALIDATE_ROLE_SOURCE:
      return "SOURCE";
    case v1::VALIDATE_ROLE_TARGET_TRUE:
      return "TARGET_TRUE";
    case v1::VALIDATE_ROLE_TARGET_QUERY:
      return "TARGET_QUERY";
    default:
      return "UNSPECIFIED";
  }
}


// The shapes of one ValidateKV: three caches in the request's dtype and layout.
struct ValidateShapes {
  int num_query_heads = 0;
  int64_t tokens = 0;
  int64_t element = 0;
  LayerGeometry source, target, query;
  int64_t target_layer_floats = 0;  // one target layer as floats
};

// The three caches as they arrive, each chunk checked as TranslateKV checks its chunks.
class ValidateIntake {
 public:
  ValidateIntake(const ModelSpec& src, const ModelSpec& tgt, const ValidateShapes& shapes,
                 DType dtype)
      : shapes_(shapes),
        source(src.num_layers, shapes.source.layer_bytes(), true),
        truth(tgt.num_layers, shapes.target.layer_bytes(), true),
        queries(shapes.num_query_heads > 0 ? tgt.num_layers : 0, shapes.query.layer_bytes(),
                false),
        source_coverage_(src.num_layers, shapes.tokens),
        truth_coverage_(tgt.num_layers, shapes.tokens),
        query_coverage_(tgt.num_layers, shapes.tokens),
        source_chunks_{"chunk.chunk", absl::StrCat("source model ", src.name), src.num_layers,
                       shapes.source, dtype, false},
        truth_chunks_{"chunk.chunk", absl::StrCat("target model ", tgt.name), tgt.num_layers,
                      shapes.target, dtype, false},
        query_chunks_{"chunk.chunk", absl::StrCat("target model ", tgt.name, " (queries)"),
                      tgt.num_layers, shapes.query, dtype, true} {
    // Queries have no V half: count it as received, so completeness means every query token.
    for (int l = 0; l < tgt.num_layers; ++l) {
      query_coverage_.Add(l, 1, 0, shapes.tokens).IgnoreError();
    }
  }

  // Reads every chunk message until the stream ends; the first bad one is the error.
  absl::Status ReadAll(grpc::ServerReader<v1::ValidateKVRequest>* reader) {
    v1::ValidateKVRequest request;
    while (reader->Read(&request)) {
      if (absl::Status taken = Take(request); !taken.ok()) return taken;
    }
    return absl::OkStatus();
  }

  absl::Status CheckComplete() const {
    const std::pair<const char*, const CoverageTracker*> coverages[] = {
        {"SOURCE", &source_coverage_},
        {"TARGET_TRUE", &truth_coverage_},
        {"TARGET_QUERY", shapes_.num_query_heads > 0 ? &query_coverage_ : nullptr}};
    for (const auto& [role, coverage] : coverages) {
      if (coverage != nullptr && !coverage->Complete()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "stream ended before every ", role, " chunk arrived: ", coverage->FirstGap()));
      }
    }
    return absl::OkStatus();
  }

 private:
  const ValidateShapes& shapes_;

 public:
  CacheBuffers source, truth, queries;

 private:
  absl::Status Take(const v1::ValidateKVRequest& request) {
    if (request.has_header()) {
      return absl::InvalidArgumentError(
          "second header in the stream: a ValidateKV stream carries exactly one header");
    }
    if (!request.has_chunk()) {
      return absl::InvalidArgumentError("empty ValidateKVRequest: set header or chunk");
    }
    const v1::ValidateChunk& message = request.chunk();
    const ChunkExpectation* expect = nullptr;
    CoverageTracker* coverage = nullptr;
    CacheBuffers* buffers = nullptr;
    const LayerGeometry* geometry = nullptr;
    switch (message.role()) {
      case v1::VALIDATE_ROLE_SOURCE:
        expect = &source_chunks_, coverage = &source_coverage_, buffers = &source;
        geometry = &shapes_.source;
        break;
      case v1::VALIDATE_ROLE_TARGET_TRUE:
        expect = &truth_chunks_, coverage = &truth_coverage_, buffers = &truth;
        geometry = &shapes_.target;
        break;
      case v1::VALIDATE_ROLE_TARGET_QUERY:
        if (shapes_.num_query_heads == 0) {
          return absl::InvalidArgumentError(
              "chunk.role=VALIDATE_ROLE_TARGET_QUERY but header.num_query_heads=0: declare "
              "the query heads in the header");
        }
        expect = &query_chunks_, coverage = &query_coverage_, buffers = &queries;
        geometry = &shapes_.query;
        break;
      default:
        return absl::InvalidArgumentError(
            "chunk.role must be VALIDATE_ROLE_SOURCE, VALIDATE_ROLE_TARGET_TRUE or "
            "VALIDATE_ROLE_TARGET_QUERY");
    }
    const v1::KVChunk& chunk = message.chunk();
    absl::StatusOr<int> kind = CheckChunk(chunk, *expect);
    if (!kind.ok()) return kind.status();
    if (absl::Status added =
            coverage->Add(chunk.layer(), *kind, chunk.token_start(), chunk.token_count());
        !added.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(RoleName(message.role()), " ", added.message()));
    }
    ScatterChunk(*geometry, chunk.token_start(), chunk.token_count(), chunk.data().data(),
                 (*kind == 0 ? buffers->k : buffers->v)[chunk.layer()].get());
    return absl::OkStatus();
  }

  CoverageTracker source_coverage_, truth_coverage_, query_coverage_;
  const ChunkExpectation source_chunks_, truth_chunks_, query_chunks_;
};

// The three caches as views (the request's dtype and layout) for MeasureTranslation.
MeasureInputs Views(const ModelSpec& src, const ModelSpec& tgt, const ValidateShapes& shapes,
                    const InputHeader& input, const ValidateIntake& caches) {
  MeasureInputs in;
  for (CacheView* view : {&in.source, &in.truth, &in.queries}) {
    view->dtype = input.dtype;
    view->layout = input.layout;
    view->num_tokens = shapes.tokens;
  }
  in.source.num_kv_heads = src.num_kv_heads;
  in.source.head_dim = src.head_dim;
  for (int l = 0; l < src.num_layers; ++l) {
    in.source.k.push_back(caches.source.k[l].get());
    in.source.v.push_back(caches.source.v[l].get());
  }
  in.truth.num_kv_heads = tgt.num_kv_heads;
  in.truth.head_dim = tgt.head_dim;
  in.queries.num_kv_heads = shapes.num_query_heads;
  in.queries.head_dim = tgt.head_dim;
  for (int l = 0; l < tgt.num_layers; ++l) {
    in.truth.k.push_back(caches.truth.k[l].get());
    in.truth.v.push_back(caches.truth.v[l].get());
    if (shapes.num_query_heads > 0) in.queries.k.push_back(caches.queries.k[l].get());
  }
  in.positions = input.positions;
  return in;
}

// The response and the metrics record from the per-layer quality; the "validate done" line.
void Report(const std::string& request_id, const std::string& mapper_id, uint32_t turn,
            int64_t tokens, const std::vector<LayerQuality>& layers,
            v1::ValidateKVResponse* response, ValidateRecord* record) {
  const QualitySummary summary = SummarizeQuality(layers);
  response->set_request_id(request_id);
  response->set_mapper_id(mapper_id);
  for (size_t layer = 0; layer < layers.size(); ++layer) {
    FillLayerQuality(static_cast<uint32_t>(layer), layers[layer], response->add_layers());
  }
  FillLayerQuality(0, summary.all, response->mutable_overall());
  FillLayerQuality(0, summary.without_layer0, response->mutable_overall_without_layer0());

  // The histograms take the overall without layer 0 (it inflates the mean); a one-layer target
  // has only layer 0.
  const LayerQuality& recorded = layers.size() > 1 ? summary.without_layer0 : summary.all;
  record->has_quality = true;
  record->r2_k = recorded.r2_k;
  record->r2_v = recorded.r2_v;
  record->cosine_k = recorded.cosine_k;
  record->cosine_v = recorded.cosine_v;
  record->attention_cosine = recorded.attention_cosine;
  record->c_k = recorded.c_k;
  record->c_v = recorded.c_v;
  LogLine done(LogLevel::kInfo, "validate done");
  done.With("request_id", request_id)
      .With("mapper", mapper_id)
      .With("tokens", tokens)
      .With("turn", turn)
      .With("r2_k", recorded.r2_k)
      .With("r2_v", recorded.r2_v)
      .With("cosine_k", recorded.cosine_k)
      .With("cosine_v", recorded.cosine_v);
  if (recorded.attention_cosine) done.With("attention_cosine", *recorded.attention_cosine);
}

}  // namespace

grpc::Status TranslatorService::ValidateKV(grpc::ServerContext* context,
                                           grpc::ServerReader<v1::ValidateKVRequest>* reader,
                                           v1::ValidateKVResponse* response) {
  ValidateRecord record;
  const absl::Time start = absl::Now();
  grpc::Status status = Authorize(context, Role::kClient);
  if (status.ok()) status = ValidateKVImpl(context, reader, response, &record);
  record.code = static_cast<absl::StatusCode>(status.error_code());
  record.total_s = absl::ToDoubleSeconds(absl::Now() - start);
  if (metrics_ != nullptr) metrics_->RecordValidate(record);
  return status;
}

grpc::Status TranslatorService::ValidateKVImpl(grpc::ServerContext* context,
                                               grpc::ServerReader<v1::ValidateKVRequest>* reader,
                                               v1::ValidateKVResponse* response,
                                               ValidateRecord* record) {
  v1::ValidateKVRequest request;
  if (!reader->Read(&request)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "stream ended before its header: send a ValidateHeader first");
  }
  if (!request.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "first message must be a header (ValidateKVRequest.header)");
  }
  // Kept for the whole call: explicit positions are read from it in place.
  const v1::ValidateHeader header = request.header();
  // The stream prologue TranslateKV has too (server/translate/request_plan.h).
  const FailureLog fail("validate failed", request_ids_.Next(header.request_id()));
  if (absl::Status open = CheckNotDraining(draining()); !open.ok()) return fail(open);
  absl::StatusOr<InputHeader> input = CheckInputHeader(header, config_.limits.max_tokens);
  if (!input.ok()) return fail(input.status());
  const AcquireOptions mapper_wait = MapperWait(config_, absl::FromChrono(context->deadline()));
  absl::StatusOr<MapperHandle> mapper = AcquireMapper(store_, header, mapper_wait);
  if (!mapper.ok()) return fail(mapper.status());
  const MapperView& view = mapper->mapper().view();
  record->pair = PairLabels::Of(view);
  record->turn = header.turn();
  const ModelSpec& src = view.source;
  const ModelSpec& tgt = view.target;
  ValidateShapes shapes;
  // Checked as the wire's uint32 before it becomes an int: a narrowing first would turn
  // 4294967293 into -3, a multiple of 3 heads.
  const uint32_t query_heads = header.num_query_heads();
  constexpr uint32_t kMaxQueryHeads = 1 << 16;
  if (query_heads > kMaxQueryHeads ||
      query_heads % static_cast<uint32_t>(tgt.num_kv_heads) != 0) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "header.num_query_heads=", query_heads, " must be a multiple of the target's ",
        tgt.num_kv_heads, " KV heads (grouped-query attention), at most ", kMaxQueryHeads,
        ", or 0 for no queries")));
  }
  shapes.num_query_heads = static_cast<int>(query_heads);

  const int64_t T = shapes.tokens = input->num_tokens;
  const int64_t element = shapes.element = static_cast<int64_t>(DTypeSize(input->dtype));
  shapes.source = {input->layout, src.num_kv_heads, T, src.head_dim, element};
  shapes.target = {input->layout, tgt.num_kv_heads, T, tgt.head_dim, element};
  shapes.query = {input->layout, shapes.num_query_heads, T, tgt.head_dim, element};
  // Held at once: both caches and the queries as sent, one translated layer, and the float
  // copies of one layer the metrics read (mapped and true K and V, queries).
  shapes.target_layer_floats = static_cast<int64_t>(tgt.num_kv_heads) * T * tgt.head_dim;
  const int64_t bytes =
      2 * src.num_layers * shapes.source.layer_bytes() +
      2 * tgt.num_layers * shapes.target.layer_bytes() +
      tgt.num_layers * shapes.query.layer_bytes() + 2 * shapes.target.layer_bytes() +
      4 * (4 * shapes.target_layer_floats + shapes.query.layer_bytes() / element);
  if (bytes > config_.limits.max_request_bytes) {
    return fail(absl::ResourceExhaustedError(absl::StrCat(
        "header.num_tokens=", T, " makes ", bytes, " bytes of caches, queries and working copies, "
        "over limits.max_request_bytes=", config_.limits.max_request_bytes,
        "; validate fewer tokens")));
  }
  absl::StatusOr<AdmissionController::Ticket> ticket = admission_.TryAdmit(bytes);
  if (!ticket.ok()) return fail(ticket.status());
  absl::StatusOr<ComputeMapper> prepared =
      PinForCompute(store_, &shift_stats_, &*mapper, mapper_wait.deadline);
  if (!prepared.ok()) return fail(prepared.status());

  // --- Receive: three caches, each chunk checked as TranslateKV checks its chunks. ---
  ValidateIntake caches(src, tgt, shapes, input->dtype);
  if (absl::Status read = caches.ReadAll(reader); !read.ok()) return fail(read);
  if (context->IsCancelled()) return CancelledOrDeadline(context);
  if (absl::Status complete = caches.CheckComplete(); !complete.ok()) return fail(complete);

  // --- Translate and measure, layer by layer, on the compute executor. ---
  MeasureInputs measure = Views(src, tgt, shapes, *input, caches);
  measure.options.token_chunk = config_.backend.token_chunk;
  std::vector<LayerQuality> layers;
  absl::Status computed = compute_.Submit([&]() -> absl::Status {
    return MeasureTranslation(*mapper, *prepared, measure, absl::FromChrono(context->deadline()),
                              [context] { return context->IsCancelled(); }, &layers);
  }).get();
  if (context->IsCancelled()) return CancelledOrDeadline(context);
  if (!computed.ok()) return fail(computed);

  Report(fail.request_id(), mapper->mapper().id(), header.turn(), T, layers, response, record);
  return grpc::Status::OK;
}

}  // namespace kvt
