#include "server/translate/staging.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ipc.h"
#include "transport/proto_convert.h"

namespace kvt {
namespace {

}  // namespace

absl::StatusOr<std::unique_ptr<RequestStaging>> RequestStaging::Lease(
    const TranslatePlan& plan, const v1::TranslateHeader& header,
    SystemMemoryRegistry* system_memory, CudaMemoryRegistry* cuda_memory) {
  std::unique_ptr<RequestStaging> staging(new RequestStaging(plan, header));
  if (plan.input_in_region) {
    if (absl::Status s = staging->LeaseOne(header.input().region(), "header.input.region",
                                           /*output=*/false, system_memory, cuda_memory);
        !s.ok()) {
      return s;
    }
  }
  if (plan.output_in_region) {
    if (absl::Status s = staging->LeaseOne(header.output().region(), "header.output.region",
                                           /*output=*/true, system_memory, cuda_memory);
        !s.ok()) {
      return s;
    }
  }
  staging->input_base_ = staging->input_region_.data();
  staging->output_base_ = staging->output_region_.data();
  return staging;
}

absl::Status RequestStaging::LeaseOne(const v1::RegionRef& ref, const char* field, bool output,
                                      SystemMemoryRegistry* system_memory,
                                      CudaMemoryRegistry* cuda_memory) {
  const int64_t expected = output ? plan_.target_bytes : plan_.source_bytes;
  if (ref.has_paged()) {
    const ModelSpec& model = output ? plan_.target_model() : plan_.source_model();
    const LayerGeometry& geometry = output ? plan_.target_geometry : plan_.source_geometry;
    absl::StatusOr<PagedLayout> pages = PagedLayoutFromProto(
        ref, geometry.layout, model.num_layers, geometry.num_heads, geometry.head_dim,
        geometry.element_size, plan_.num_tokens, output, field);
    if (!pages.ok()) return pages.status();
    (output ? output_pages_ : input_pages_) = *std::move(pages);
  } else if (ref.byte_size() != static_cast<uint64_t>(expected)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".byte_size=", ref.byte_size(), " but the cache is ", expected,
        " bytes (layer-major, K then V per layer, in the request's layout and dtype)"));
  }
  // Names are unique across both registries (the Register RPCs refuse duplicates).
  const bool cuda = cuda_memory->Contains(ref.region());
  if (cuda && ref.has_paged()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".paged: region '", ref.region(),
        "' is CUDA memory; the paged layout is read and written in system-memory regions only"));
  }
  absl::StatusOr<SystemMemoryRegistry::Lease> leased =
      cuda ? cuda_memory->Acquire(ref.region(), ref.offset(), ref.byte_size(), field)
           : system_memory->Acquire(ref.region(), ref.offset(), ref.byte_size(), field);
  if (!leased.ok()) return leased.status();
  (output ? output_region_ : input_region_) = std::move(*leased);
  return absl::OkStatus();
}

std::pair<int64_t, int64_t> RequestStaging::output_tokens() const {
  const v1::PagedBlocks& paged = header_.output().region().paged();
  return {paged.first_token(), paged.end_token() ? paged.end_token() : plan_.num_tokens};
}

int64_t RequestStaging::AdmissionBytes() const {
  return (plan_.input_in_place() && !plan_.input_paged ? 0 : plan_.source_bytes) +
         (plan_.output_in_region && !plan_.output_paged
              ? 0
              : 4 * plan_.target_geometry.layer_bytes()) +
         (input_cuda() ? plan_.source_bytes : 0) + (output_cuda() ? plan_.target_bytes : 0);
}

absl::Status RequestStaging::StageCuda(BufferPool* pool) {
  // The engine here reads and writes host memory: one copy each way.
  if (input_cuda()) {
    input_host_ = std::make_unique<LayerBuffer>(pool, plan_.source_bytes);
    if (absl::Status copied = cuda::CopyToHost(input_region_.device_id(), input_region_.data(),
                                               input_host_->bytes.get(), plan_.source_bytes);
        !copied.ok()) {
      return copied;
    }
    input_base_ = input_host_->bytes.get();
  }
  if (output_cuda()) {
    output_host_ = std::make_unique<LayerBuffer>(pool, plan_.target_bytes);
    output_base_ = output_host_->bytes.get();
  }
  return absl::OkStatus();
}

void RequestStaging::StageSource(BufferPool* pool) {
  const ModelSpec& src_model = plan_.source_model();
  const LayerGeometry& geometry = plan_.source_geometry;
  if (!plan_.input_in_place() || plan_.input_paged) {
    source_k_.reserve(src_model.num_layers);
    source_v_.reserve(src_model.num_layers);
    for (int l = 0; l < src_model.num_layers; ++l) {
      source_k_.emplace_back(pool, geometry.layer_bytes());
      source_v_.emplace_back(pool, geometry.layer_bytes());
    }
  }
  if (plan_.input_paged) {
    const uint32_t* table = header_.input().region().paged().block_table().data();
    for (int l = 0; l < src_model.num_layers; ++l) {
      const char* layer = input_base_ + input_pages_.LayerOffset(l);
      GatherPaged(input_pages_, table, 0, layer, geometry, source_k_[l].bytes.get());
      GatherPaged(input_pages_, table, 1, layer, geometry, source_v_[l].bytes.get());
    }
  }
  source_.dtype = plan_.input_dtype;
  source_.layout = plan_.input_layout;
  source_.num_kv_heads = src_model.num_kv_heads;
  source_.head_dim = src_model.head_dim;
  source_.num_tokens = plan_.num_tokens;
  const int64_t layer_bytes = geometry.layer_bytes();
  const CacheView cached_view = plan_.input_cached ? plan_.prefix_lease.View() : CacheView{};
  for (int l = 0; l < src_model.num_layers; ++l) {
    if (plan_.input_cached) {
      source_.k.push_back(cached_view.k[l]);
      source_.v.push_back(cached_view.v[l]);
    } else if (plan_.input_in_region && !plan_.input_paged) {  // layer-major, K then V
      source_.k.push_back(input_base_ + (2 * l) * layer_bytes);
      source_.v.push_back(input_base_ + (2 * l + 1) * layer_bytes);
    } else {
      source_.k.push_back(source_k_[l].bytes.get());
      source_.v.push_back(source_v_[l].bytes.get());
    }
  }
}

void RequestStaging::ReleaseBuffers() {
  source_v_.clear();
  source_k_.clear();
  output_host_.reset();
  input_host_.reset();
}

const uint32_t* RequestStaging::output_block_table() const {
  return header_.output().region().paged().block_table().data();
}

absl::Status RequestStaging::CheckRegionsIntact() const {
  if (absl::Status input = input_region_.CheckIntact("header.input.region"); !input.ok()) {
    return input;
  }
  return output_region_.CheckIntact("header.output.region");
}

}  // namespace kvt
