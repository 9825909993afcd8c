#include "server/translate/response_writer.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"
#include "kernels/cuda/ipc.h"
#include "transport/kv_chunks.h"
#include "transport/paged.h"
#include "transport/proto_convert.h"

namespace kvt {
namespace {

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

}  // namespace

TranslateResponseMessage ResponseHeader(const std::string& request_id, const TranslatePlan& plan,
                                        const Backend& backend) {
  const ModelSpec& tgt_model = plan.target_model();
  TranslateResponseMessage response;
  v1::TranslateResponseHeader* out = response.proto.mutable_header();
  out->set_request_id(request_id);
  out->set_mapper_id(plan.mapper->id());
  out->set_source_model(plan.source_model().name);
  out->set_target_model(tgt_model.name);
  out->mutable_target_shape()->set_num_layers(tgt_model.num_layers);
  out->mutable_target_shape()->set_num_kv_heads(tgt_model.num_kv_heads);
  out->mutable_target_shape()->set_head_dim(tgt_model.head_dim);
  out->set_output_dtype(DTypeToProto(plan.output_dtype));
  out->set_output_layout(LayoutToProto(plan.output_layout));
  out->set_num_tokens(plan.num_tokens);
  out->set_backend(backend.name());
  out->set_device(backend.device());
  out->set_window(static_cast<uint32_t>(std::max(1, plan.view().window)));
  return response;
}

InlineChunkSink::InlineChunkSink(const TranslatePlan& plan, int64_t response_chunk_bytes,
                                 ResponseWriter write, std::function<grpc::Status()> closed)
    : geometry_(plan.target_geometry),
      num_tokens_(plan.num_tokens),
      tokens_per_chunk_(TokensPerChunk(plan.target_geometry, response_chunk_bytes)),
      write_(std::move(write)),
      closed_(std::move(closed)) {
  if (plan.response_chunk_tokens > 0) {
    tokens_per_chunk_ = std::min(tokens_per_chunk_, plan.response_chunk_tokens);
  }
}

grpc::Status InlineChunkSink::Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                                      const std::shared_ptr<LayerBuffer>& v) {
  const absl::Time send_begin = absl::Now();
  for (int kind = 0; kind < 2; ++kind) {
    // Zero-copy: the chunk's slices point into the layer buffer, which they keep alive until
    // gRPC has sent them (the producer never reuses a buffer gRPC still holds).
    const std::shared_ptr<LayerBuffer>& buffer = kind == 0 ? k : v;
    for (int64_t first = 0; first < num_tokens_; first += tokens_per_chunk_) {
      const int64_t count = std::min(tokens_per_chunk_, num_tokens_ - first);
      v1::KVChunk* chunk = response_.proto.mutable_chunk();
      chunk->set_layer(layer);
      chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
      chunk->set_token_start(static_cast<uint32_t>(first));
      chunk->set_token_count(static_cast<uint32_t>(count));
      response_.data = ChunkBytesOfLayer(geometry_, first, count, buffer->bytes.get(), buffer);
      output_bytes_ += static_cast<int64_t>(response_.data.size());
      if (!write_(response_)) return closed_();
    }
  }
  response_.data = ChunkBytes();
  stage_out_ms_ += Ms(absl::Now() - send_begin);
  return grpc::Status::OK;
}

PackedRegionSink::PackedRegionSink(char* base, int64_t layer_bytes, int cuda_device,
                                   char* device_base,
                                   std::function<grpc::Status(const absl::Status&)> fail)
    : base_(base),
      layer_bytes_(layer_bytes),
      cuda_device_(cuda_device),
      device_base_(device_base),
      fail_(std::move(fail)) {}

grpc::Status PackedRegionSink::Deliver(int layer, const std::shared_ptr<LayerBuffer>&,
                                       const std::shared_ptr<LayerBuffer>&) {
  if (cuda_device_ >= 0) {
    // CopyToDevice returns once the bytes are in device memory, so a layer notice that
    // follows (LayerNoticeSink) never reaches the client before its data.
    const int64_t at = 2 * layer * layer_bytes_;
    if (absl::Status copied =
            cuda::CopyToDevice(cuda_device_, base_ + at, device_base_ + at, 2 * layer_bytes_);
        !copied.ok()) {
      return fail_(copied);
    }
  }
  output_bytes_ += 2 * layer_bytes_;
  return grpc::Status::OK;
}

PagedRegionSink::PagedRegionSink(const PagedLayout& pages, const uint32_t* block_table,
                                 std::pair<int64_t, int64_t> tokens, char* base,
                                 const LayerGeometry& geometry)
    : pages_(pages),
      block_table_(block_table),
      tokens_(tokens),
      base_(base),
      geometry_(geometry) {}

grpc::Status PagedRegionSink::Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                                      const std::shared_ptr<LayerBuffer>& v) {
  char* paged_layer = base_ + pages_.LayerOffset(layer);
  ScatterPaged(pages_, block_table_, 0, k->bytes.get(), geometry_, paged_layer, tokens_.first,
               tokens_.second);
  ScatterPaged(pages_, block_table_, 1, v->bytes.get(), geometry_, paged_layer, tokens_.first,
               tokens_.second);
  output_bytes_ += 2 * geometry_.layer_bytes();
  return grpc::Status::OK;
}

LayerNoticeSink::LayerNoticeSink(std::unique_ptr<LayerSink> inner, int64_t num_tokens,
                                 ResponseWriter write, std::function<grpc::Status()> closed)
    : inner_(std::move(inner)),
      num_tokens_(num_tokens),
      write_(std::move(write)),
      closed_(std::move(closed)) {}

grpc::Status LayerNoticeSink::Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                                      const std::shared_ptr<LayerBuffer>& v) {
  grpc::Status delivered = inner_->Deliver(layer, k, v);
  output_bytes_ = inner_->output_bytes();
  stage_out_ms_ = inner_->stage_out_ms();
  if (!delivered.ok()) return delivered;
  const absl::Time send_begin = absl::Now();
  TranslateResponseMessage notice;
  v1::KVChunk* chunk = notice.proto.mutable_chunk();
  chunk->set_layer(layer);
  chunk->set_token_start(0);
  chunk->set_token_count(static_cast<uint32_t>(num_tokens_));
  for (const v1::CacheKind kind : {v1::CACHE_KIND_K, v1::CACHE_KIND_V}) {
    chunk->set_kind(kind);
    if (!write_(notice)) return closed_();
  }
  stage_out_ms_ += Ms(absl::Now() - send_begin);
  return grpc::Status::OK;
}

namespace {

std::unique_ptr<LayerSink> MakeRegionSink(const TranslatePlan& plan,
                                          const RequestStaging& staging,
                                          const StreamHooks& hooks) {
  if (plan.output_paged) {
    return std::make_unique<PagedRegionSink>(
        staging.output_pages(), staging.output_block_table(), staging.output_tokens(),
        staging.output_base(), plan.target_geometry);
  }
  const bool cuda = staging.output_cuda();
  return std::make_unique<PackedRegionSink>(
      staging.output_base(), plan.target_geometry.layer_bytes(),
      cuda ? staging.output_region().device_id() : -1,
      cuda ? staging.output_region().data() : nullptr, hooks.fail);
}

}  // namespace

std::unique_ptr<LayerSink> MakeLayerSink(const TranslatePlan& plan, const RequestStaging& staging,
                                         const KvtdConfig& config, ResponseWriter write,
                                         const StreamHooks& hooks) {
  if (plan.output_in_region) {
    std::unique_ptr<LayerSink> region = MakeRegionSink(plan, staging, hooks);
    if (!plan.region_layer_notices) return region;
    return std::make_unique<LayerNoticeSink>(std::move(region), plan.num_tokens,
                                             std::move(write), hooks.closed);
  }
  return std::make_unique<InlineChunkSink>(plan, config.limits.response_chunk_bytes,
                                           std::move(write), hooks.closed);
}

TranslateResponseMessage ResponseTrailer(const TrailerInputs& in, const KvtdConfig& config,
                                         const std::string& target_model,
                                         TranslateRecord* record) {
  TranslateResponseMessage trailer_message;
  v1::TranslateTrailer* trailer = trailer_message.proto.mutable_trailer();
  trailer->set_request_id(in.request_id);
  v1::StageTimings* timings = trailer->mutable_timings();
  timings->set_queue_ms(Ms(in.admitted - in.start));
  timings->set_stage_in_ms(Ms(in.staged_in - in.admitted));
  timings->set_compute_ms(in.compute_ms);
  timings->set_stage_out_ms(in.stage_out_ms);
  timings->set_total_ms(Ms(in.end - in.start));
  if (in.first_output != absl::InfiniteFuture()) {
    timings->set_first_output_ms(Ms(in.first_output - in.start));
  }
  trailer->set_pipelined(in.pipelined);
  trailer->set_num_tokens(in.num_tokens);
  trailer->set_input_bytes(in.input_bytes);
  trailer->set_output_bytes(in.output_bytes);
  // The caller's re-prefill estimate, else the target model's cost model from the config.
  double reprefill_ms = in.reprefill_estimate_ms;
  if (reprefill_ms <= 0) {
    auto cost = config.metrics.prefill_cost.find(target_model);
    if (cost != config.metrics.prefill_cost.end()) reprefill_ms = cost->second.Ms(in.num_tokens);
  }
  if (reprefill_ms > 0 && timings->total_ms() > 0) {
    trailer->set_speedup_estimate(reprefill_ms / timings->total_ms());
    record->speedup = trailer->speedup_estimate();
  }
  if (in.input_shift.has_value()) trailer->set_input_shift_score(*in.input_shift);
  record->input_shift = in.input_shift;
  record->queue_s = timings->queue_ms() / 1000;
  record->stage_in_s = timings->stage_in_ms() / 1000;
  record->compute_s = in.compute_ms / 1000;
  record->stage_out_s = in.stage_out_ms / 1000;
  record->total_s = timings->total_ms() / 1000;
  record->tokens = in.num_tokens;
  return trailer_message;
}

}  // namespace kvt
