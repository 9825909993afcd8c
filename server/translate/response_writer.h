// Step 5 of a TranslateKV: what goes back. The response header; the LayerSinks the layer
// pipeline delivers target layers to (inline chunks sent zero-copy through a writer function,
// a packed region computed in place, a paged region scattered into, a CUDA region copied out
// of its host staging); and the trailer with the stage timings and telemetry.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "kernels/backend.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/translate/layer_pipeline.h"
#include "server/translate/request_plan.h"
#include "server/translate/staging.h"
#include "transport/chunk_wire.h"

namespace kvt {

// The first response message: the request id, mapper, models, target shape, output dtype and
// layout, tokens, and the backend and device that compute.
TranslateResponseMessage ResponseHeader(const std::string& request_id, const TranslatePlan& plan,
                                        const Backend& backend);

// header.output.inline: each target layer as K then V chunks of at most
// limits.response_chunk_bytes (and header.output.inline.chunk_tokens) tokens, whose slices point
// into the layer buffers (kept alive by the slices until gRPC has sent them).
class InlineChunkSink : public LayerSink {
 public:
  // `closed`: the status to end with when `write` fails (the client went away).
  InlineChunkSink(const TranslatePlan& plan, int64_t response_chunk_bytes, ResponseWriter write,
                  std::function<grpc::Status()> closed);
  grpc::Status Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                       const std::shared_ptr<LayerBuffer>& v) override;
  int64_t tokens_per_chunk() const { return tokens_per_chunk_; }

 private:
  const LayerGeometry geometry_;
  const int64_t num_tokens_;
  int64_t tokens_per_chunk_;
  const ResponseWriter write_;
  const std::function<grpc::Status()> closed_;
  TranslateResponseMessage response_;
};

// A packed output region (layer-major, K then V per layer): target layers are computed straight
// into `base`. With `cuda_device` >= 0, `base` is the host staging of the CUDA region at
// `device_base`, and each layer is copied there once computed (`fail` ends the stream on a copy
// error).
class PackedRegionSink : public LayerSink {
 public:
  PackedRegionSink(char* base, int64_t layer_bytes, int cuda_device = -1,
                   char* device_base = nullptr,
                   std::function<grpc::Status(const absl::Status&)> fail = nullptr);
  bool in_place() const override { return true; }
  char* InPlace(int layer, int kind) override {
    return base_ + (2 * layer + kind) * layer_bytes_;
  }
  grpc::Status Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                       const std::shared_ptr<LayerBuffer>& v) override;

 private:
  char* const base_;
  const int64_t layer_bytes_;
  const int cuda_device_;
  char* const device_base_;
  const std::function<grpc::Status(const absl::Status&)> fail_;
};

// A paged output region: each target layer's tokens [tokens.first, tokens.second) scattered
// from its buffers into the request's blocks of layer tensor `layer` (PagedLayout, block table
// checked by staging).
class PagedRegionSink : public LayerSink {
 public:
  PagedRegionSink(const PagedLayout& pages, const uint32_t* block_table,
                  std::pair<int64_t, int64_t> tokens, char* base, const LayerGeometry& geometry);
  grpc::Status Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                       const std::shared_ptr<LayerBuffer>& v) override;

 private:
  const PagedLayout pages_;
  const uint32_t* const block_table_;
  const std::pair<int64_t, int64_t> tokens_;
  char* const base_;
  const LayerGeometry geometry_;
};

// header.region_layer_notices: wraps a region sink; once `inner` has a target layer in the
// region, tells the caller with one data-less KVChunk for its K and one for its V.
class LayerNoticeSink : public LayerSink {
 public:
  LayerNoticeSink(std::unique_ptr<LayerSink> inner, int64_t num_tokens, ResponseWriter write,
                  std::function<grpc::Status()> closed);
  bool in_place() const override { return inner_->in_place(); }
  char* InPlace(int layer, int kind) override { return inner_->InPlace(layer, kind); }
  grpc::Status Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                       const std::shared_ptr<LayerBuffer>& v) override;

 private:
  const std::unique_ptr<LayerSink> inner_;
  const int64_t num_tokens_;
  const ResponseWriter write_;
  const std::function<grpc::Status()> closed_;
};

// The sink the plan's output kind asks for, over the staged output base.
std::unique_ptr<LayerSink> MakeLayerSink(const TranslatePlan& plan, const RequestStaging& staging,
                                         const KvtdConfig& config, ResponseWriter write,
                                         const StreamHooks& hooks);

// What the trailer reports.
struct TrailerInputs {
  std::string request_id;
  absl::Time start, admitted, staged_in, end;
  absl::Time first_output = absl::InfiniteFuture();
  double compute_ms = 0, stage_out_ms = 0;
  bool pipelined = false;
  int64_t num_tokens = 0, input_bytes = 0, output_bytes = 0;
  double reprefill_estimate_ms = 0;  // header.reprefill_estimate_ms; <= 0: use the config's
  std::optional<double> input_shift;
};

// The last response message: stage timings, bytes, the speed-up estimate (the caller's
// re-prefill estimate, else the target model's cost model from metrics.prefill_cost) and the
// input-shift score. Fills the metrics `record` with the same.
TranslateResponseMessage ResponseTrailer(const TrailerInputs& in, const KvtdConfig& config,
                                         const std::string& target_model,
                                         TranslateRecord* record);

}  // namespace kvt
