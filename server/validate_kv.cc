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
#include "common/logging.h"
#include "quality/kv_quality.h"
#include "server/grpc_status.h"
#include "server/request_checks.h"
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
  const std::string request_id = RequestId(header.request_id());
  auto fail = [&](const absl::Status& status) {
    KVT_LOG(kWarning, "validate failed")
        .With("request_id", request_id)
        .With("code", absl::StatusCodeToString(status.code()))
        .With("error", status.message());
    return ToGrpcStatus(status);
  };
  if (draining()) {
    return fail(absl::UnavailableError(
        "server is draining (shutting down); retry on another replica"));
  }
  absl::StatusOr<InputHeader> input = CheckInputHeader(header, config_.limits.max_tokens);
  if (!input.ok()) return fail(input.status());
  const AcquireOptions mapper_wait = MapperWait(context);
  absl::StatusOr<MapperHandle> mapper = AcquireMapper(store_, header, mapper_wait);
  if (!mapper.ok()) return fail(mapper.status());
  const MapperView& view = mapper->mapper().view();
  record->pair = PairLabels::Of(view);
  record->turn = header.turn();
  const ModelSpec& src = view.source;
  const ModelSpec& tgt = view.target;
  const int num_query_heads = static_cast<int>(header.num_query_heads());
  if (num_query_heads % tgt.num_kv_heads != 0) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "header.num_query_heads=", num_query_heads, " must be a multiple of the target's ",
        tgt.num_kv_heads, " KV heads (grouped-query attention), or 0 for no queries")));
  }

  const int64_t T = input->num_tokens;
  const int64_t element = static_cast<int64_t>(DTypeSize(input->dtype));
  const LayerGeometry source_geometry{input->layout, src.num_kv_heads, T, src.head_dim, element};
  const LayerGeometry target_geometry{input->layout, tgt.num_kv_heads, T, tgt.head_dim, element};
  const LayerGeometry query_geometry{input->layout, num_query_heads, T, tgt.head_dim, element};
  // Held at once: both caches and the queries as sent, one translated layer, and the float
  // copies of one layer the metrics read (mapped and true K and V, queries).
  const int64_t target_layer_floats = static_cast<int64_t>(tgt.num_kv_heads) * T * tgt.head_dim;
  const int64_t bytes = 2 * src.num_layers * source_geometry.layer_bytes() +
                        2 * tgt.num_layers * target_geometry.layer_bytes() +
                        tgt.num_layers * query_geometry.layer_bytes() +
                        2 * target_geometry.layer_bytes() +
                        4 * (4 * target_layer_floats + query_geometry.layer_bytes() / element);
  if (bytes > config_.limits.max_request_bytes) {
    return fail(absl::ResourceExhaustedError(absl::StrCat(
        "header.num_tokens=", T, " makes ", bytes, " bytes of caches, queries and working copies, "
        "over limits.max_request_bytes=", config_.limits.max_request_bytes,
        "; validate fewer tokens")));
  }
  absl::StatusOr<AdmissionController::Ticket> ticket = admission_.TryAdmit(bytes);
  if (!ticket.ok()) return fail(ticket.status());
  absl::StatusOr<Derived> prepared = Prepared(&*mapper, mapper_wait.deadline);
  if (!prepared.ok()) return fail(prepared.status());

  // --- Receive: three caches, each chunk checked as TranslateKV checks its chunks. ---
  CacheBuffers source(src.num_layers, source_geometry.layer_bytes(), true);
  CacheBuffers truth(tgt.num_layers, target_geometry.layer_bytes(), true);
  CacheBuffers queries(num_query_heads > 0 ? tgt.num_layers : 0, query_geometry.layer_bytes(),
                       false);
  CoverageTracker source_coverage(src.num_layers, T);
  CoverageTracker truth_coverage(tgt.num_layers, T);
  CoverageTracker query_coverage(tgt.num_layers, T);
  // Queries have no V half: count it as received, so completeness means every query token.
  for (int l = 0; l < tgt.num_layers; ++l) query_coverage.Add(l, 1, 0, T).IgnoreError();
  const ChunkExpectation source_chunks{"chunk.chunk", absl::StrCat("source model ", src.name),
                                       src.num_layers, source_geometry, input->dtype, false};
  const ChunkExpectation truth_chunks{"chunk.chunk", absl::StrCat("target model ", tgt.name),
                                      tgt.num_layers, target_geometry, input->dtype, false};
  const ChunkExpectation query_chunks{
      "chunk.chunk", absl::StrCat("target model ", tgt.name, " (queries)"), tgt.num_layers,
      query_geometry, input->dtype, true};
  while (reader->Read(&request)) {
    if (request.has_header()) {
      return fail(absl::InvalidArgumentError(
          "second header in the stream: a ValidateKV stream carries exactly one header"));
    }
    if (!request.has_chunk()) {
      return fail(absl::InvalidArgumentError("empty ValidateKVRequest: set header or chunk"));
    }
    const v1::ValidateChunk& message = request.chunk();
    const ChunkExpectation* expect = nullptr;
    CoverageTracker* coverage = nullptr;
    CacheBuffers* buffers = nullptr;
    const LayerGeometry* geometry = nullptr;
    switch (message.role()) {
      case v1::VALIDATE_ROLE_SOURCE:
        expect = &source_chunks, coverage = &source_coverage, buffers = &source;
        geometry = &source_geometry;
        break;
      case v1::VALIDATE_ROLE_TARGET_TRUE:
        expect = &truth_chunks, coverage = &truth_coverage, buffers = &truth;
        geometry = &target_geometry;
        break;
      case v1::VALIDATE_ROLE_TARGET_QUERY:
        if (num_query_heads == 0) {
          return fail(absl::InvalidArgumentError(
              "chunk.role=VALIDATE_ROLE_TARGET_QUERY but header.num_query_heads=0: declare "
              "the query heads in the header"));
        }
        expect = &query_chunks, coverage = &query_coverage, buffers = &queries;
        geometry = &query_geometry;
        break;
      default:
        return fail(absl::InvalidArgumentError(
            "chunk.role must be VALIDATE_ROLE_SOURCE, VALIDATE_ROLE_TARGET_TRUE or "
            "VALIDATE_ROLE_TARGET_QUERY"));
    }
    const v1::KVChunk& chunk = message.chunk();
    absl::StatusOr<int> kind = CheckChunk(chunk, *expect);
    if (!kind.ok()) return fail(kind.status());
    if (absl::Status added =
            coverage->Add(chunk.layer(), *kind, chunk.token_start(), chunk.token_count());
        !added.ok()) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat(RoleName(message.role()), " ", added.message())));
    }
    ScatterChunk(*geometry, chunk.token_start(), chunk.token_count(), chunk.data().data(),
                 (*kind == 0 ? buffers->k : buffers->v)[chunk.layer()].get());
  }
  if (context->IsCancelled()) return CancelledOrDeadline(context);
  const std::pair<const char*, const CoverageTracker*> coverages[] = {
      {"SOURCE", &source_coverage},
      {"TARGET_TRUE", &truth_coverage},
      {"TARGET_QUERY", num_query_heads > 0 ? &query_coverage : nullptr}};
  for (const auto& [role, coverage] : coverages) {
    if (coverage != nullptr && !coverage->Complete()) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "stream ended before every ", role, " chunk arrived: ", coverage->FirstGap())));
    }
  }

  // --- Translate and measure, layer by layer, on the compute executor. ---
  CacheView source_view;
  source_view.dtype = input->dtype;
  source_view.layout = input->layout;
  source_view.num_kv_heads = src.num_kv_heads;
  source_view.head_dim = src.head_dim;
  source_view.num_tokens = T;
  for (int l = 0; l < src.num_layers; ++l) {
    source_view.k.push_back(source.k[l].get());
    source_view.v.push_back(source.v[l].get());
  }
  absl::StatusOr<Rope> target_rope = Rope::Create(tgt.rope, tgt.head_dim);
  if (!target_rope.ok()) return fail(target_rope.status());
  std::vector<LayerQuality> layers(tgt.num_layers);
  const Positions positions = input->positions;
  TranslateOptions options;
  options.token_chunk = config_.backend.token_chunk;
  absl::Status computed = compute_.Submit([&]() -> absl::Status {
    // The translation as TranslateKV returns it by default (the request's dtype), token-major.
    const LayerGeometry mapped_geometry{Layout::kNHD, tgt.num_kv_heads, T, tgt.head_dim, element};
    CacheBuffers mapped(1, mapped_geometry.layer_bytes(), true);
    MutableCacheView target;
    target.dtype = input->dtype;
    target.layout = Layout::kNHD;
    target.num_kv_heads = tgt.num_kv_heads;
    target.head_dim = tgt.head_dim;
    target.num_tokens = T;
    std::vector<float> k_mapped(target_layer_floats), v_mapped(target_layer_floats),
        k_true(target_layer_floats), v_true(target_layer_floats),
        q(static_cast<size_t>(num_query_heads) * T * tgt.head_dim);
    for (int layer = 0; layer < tgt.num_layers; ++layer) {
      if (context->IsCancelled()) return absl::CancelledError("client went away");
      target.k.assign(tgt.num_layers, nullptr);
      target.v.assign(tgt.num_layers, nullptr);
      target.k[layer] = mapped.k[0].get();
      target.v[layer] = mapped.v[0].get();
      // A cold page-in streams per layer: this layer's weights may still be arriving.
      absl::Status status =
          mapper->WaitLayerReady(layer, absl::FromChrono(context->deadline()));
      if (status.ok()) {
        status = prepared->backend->TranslateLayer(*prepared->prepared, layer, source_view,
                                                   positions, options, &target);
      }
      if (!status.ok()) return status;
      ToTokenMajorFloat(input->dtype, Layout::kNHD, tgt.num_kv_heads, T, tgt.head_dim,
                        mapped.k[0].get(), k_mapped.data());
      ToTokenMajorFloat(input->dtype, Layout::kNHD, tgt.num_kv_heads, T, tgt.head_dim,
                        mapped.v[0].get(), v_mapped.data());
      ToTokenMajorFloat(input->dtype, input->layout, tgt.num_kv_heads, T, tgt.head_dim,
                        truth.k[layer].get(), k_true.data());
      ToTokenMajorFloat(input->dtype, input->layout, tgt.num_kv_heads, T, tgt.head_dim,
                        truth.v[layer].get(), v_true.data());
      LayerQualityInputs in;
      in.num_tokens = T;
      in.num_kv_heads = tgt.num_kv_heads;
      in.head_dim = tgt.head_dim;
      in.k_mapped = k_mapped.data();
      in.v_mapped = v_mapped.data();
      in.k_true = k_true.data();
      in.v_true = v_true.data();
      if (num_query_heads > 0) {
        ToTokenMajorFloat(input->dtype, input->layout, num_query_heads, T, tgt.head_dim,
                          queries.k[layer].get(), q.data());
        in.num_query_heads = num_query_heads;
        in.queries = q.data();
      }
      absl::StatusOr<LayerQuality> quality = ComputeLayerQuality(in, *target_rope, positions);
      if (!quality.ok()) return quality.status();
      layers[layer] = *quality;
    }
    return absl::OkStatus();
  }).get();
  if (context->IsCancelled()) return CancelledOrDeadline(context);
  if (!computed.ok()) return fail(computed);

  const QualitySummary summary = SummarizeQuality(layers);
  response->set_request_id(request_id);
  response->set_mapper_id(mapper->mapper().id());
  for (int layer = 0; layer < tgt.num_layers; ++layer) {
    FillLayerQuality(layer, layers[layer], response->add_layers());
  }
  FillLayerQuality(0, summary.all, response->mutable_overall());
  FillLayerQuality(0, summary.without_layer0, response->mutable_overall_without_layer0());

  // The histograms take the overall without layer 0 (it inflates the mean); a one-layer target
  // has only layer 0.
  const LayerQuality& recorded = tgt.num_layers > 1 ? summary.without_layer0 : summary.all;
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
      .With("mapper", mapper->mapper().id())
      .With("tokens", T)
      .With("turn", header.turn())
      .With("r2_k", recorded.r2_k)
      .With("r2_v", recorded.r2_v)
      .With("cosine_k", recorded.cosine_k)
      .With("cosine_v", recorded.cosine_v);
  if (recorded.attention_cosine) done.With("attention_cosine", *recorded.attention_cosine);
  return grpc::Status::OK;
}

}  // namespace kvt
