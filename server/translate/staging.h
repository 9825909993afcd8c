// Step 2 of a TranslateKV: where its bytes live. Leases the header's shared-memory regions
// (system shm packed or paged, CUDA IPC), stages CUDA regions through host memory, allocates the
// source layer buffers chunks are scattered into, builds the source CacheView (inline buffers, a
// packed region or a stored prefix read in place, a paged region gathered), the output base the
// target is computed into, and the bytes admission must account for.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/types.h"
#include "proto/kvt/v1/translate.pb.h"
#include "server/translate/request_plan.h"
#include "transport/buffer_pool.h"
#include "transport/cuda_registry.h"
#include "transport/paged.h"
#include "transport/shm_registry.h"

namespace kvt {

// A whole-layer byte buffer, uninitialised (GBs of zeroing would be wasted work), from the
// service's pool: fresh memory costs a page fault and kernel zeroing per page on first touch.
struct LayerBuffer {
  struct Bytes {
    std::shared_ptr<BufferPool::Buffer> buffer;
    char* get() const { return buffer->data(); }
  } bytes;
  LayerBuffer(BufferPool* pool, int64_t size) : bytes{pool->Get(size)} {}
};

class RequestStaging {
 public:
  // Leases the plan's regions for the whole request (an unregister waits for them), after
  // checking their byte sizes and paged block tables. `plan` and `header` must outlive this.
  static absl::StatusOr<std::unique_ptr<RequestStaging>> Lease(
      const TranslatePlan& plan, const v1::TranslateHeader& header,
      SystemMemoryRegistry* system_memory, CudaMemoryRegistry* cuda_memory);

  // The bytes this request makes kvtd hold: the inline (or paged) source cache, four target
  // layers (two double-buffered slots of K and V) unless the target is computed straight into
  // a packed region, and the host copies of CUDA regions. Other region bytes live in the client.
  int64_t AdmissionBytes() const;

  // A CUDA input region copied to host memory; a host buffer for a CUDA output region.
  absl::Status StageCuda(BufferPool* pool);
  // The source layer buffers (inline or paged input), a paged input gathered into them, and
  // the source view over wherever the source cache now is.
  void StageSource(BufferPool* pool);

  // The leased regions still hold the client's bytes now that the request read and wrote them
  // (a client may have truncated its shm object meanwhile); errors name the header field.
  absl::Status CheckRegionsIntact() const;

  // Returns the layer buffers (source and CUDA host copies) to the pool; the leases stay until
  // this object goes. The source view must not be read after this.
  void ReleaseBuffers();

  const CacheView& source() const { return source_; }
  // The buffer chunk intake scatters source (layer, kind 0=K / 1=V) into.
  char* SourceLayer(int layer, int kind) {
    return (kind == 0 ? source_k_ : source_v_)[layer].bytes.get();
  }
  // Where the target is computed into (packed output) or scattered into (paged output): the
  // output region, or its host copy when it is CUDA memory. Null for inline output.
  char* output_base() const { return output_base_; }
  bool output_cuda() const { return output_region_.device_id() >= 0; }
  bool input_cuda() const { return input_region_.device_id() >= 0; }
  const SystemMemoryRegistry::Lease& output_region() const { return output_region_; }
  const PagedLayout& output_pages() const { return output_pages_; }
  const uint32_t* output_block_table() const;
  // Paged output: the tokens written, [first_token, end_token or num_tokens)
  // (header.output.region.paged).
  std::pair<int64_t, int64_t> output_tokens() const;

 private:
  RequestStaging(const TranslatePlan& plan, const v1::TranslateHeader& header)
      : plan_(plan), header_(header) {}
  absl::Status LeaseOne(const v1::RegionRef& ref, const char* field, bool output,
                        SystemMemoryRegistry* system_memory, CudaMemoryRegistry* cuda_memory);

  const TranslatePlan& plan_;
  const v1::TranslateHeader& header_;
  SystemMemoryRegistry::Lease input_region_, output_region_;
  PagedLayout input_pages_, output_pages_;
  const char* input_base_ = nullptr;
  char* output_base_ = nullptr;
  std::unique_ptr<LayerBuffer> input_host_, output_host_;  // CUDA regions' host copies
  std::vector<LayerBuffer> source_k_, source_v_;
  CacheView source_;
};

}  // namespace kvt
