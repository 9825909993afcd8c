// kvt::HostCache: one model's KV cache in host memory, the unit the client sends and receives
// and the offline fitter reads from dumps; no RPC code, so `kvt fit` needs no gRPC client.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/types.h"

namespace kvt {

// One model's KV cache in host memory: per layer, K and V each contiguous in `layout`.
struct HostCache {
  DType dtype = DType::kBF16;
  Layout layout = Layout::kHND;
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t num_tokens = 0;
  std::vector<std::vector<char>> k;  // num_layers buffers
  std::vector<std::vector<char>> v;

  int64_t layer_bytes() const {
    return static_cast<int64_t>(num_kv_heads) * num_tokens * head_dim *
           static_cast<int64_t>(DTypeSize(dtype));
  }
  // A cache of this form and shape with zeroed buffers.
  static HostCache Zeros(DType dtype, Layout layout, int num_layers, int num_kv_heads,
                         int head_dim, int64_t num_tokens);
  // Allocates zeroed buffers for the shape already set.
  void Allocate();
  // Sizes the buffers for the shape already set, keeping those that already have the size
  // (their old bytes stay: for a result about to be overwritten) and zeroing new ones.
  void Resize();
  // A read-only engine view of the buffers (valid while they are neither resized nor freed).
  CacheView view() const;
};

// Tokens [begin, end) of `cache` as a cache of their own (its dtype, layout and shape).
HostCache SliceTokens(const HostCache& cache, int64_t begin, int64_t end);
// `first`'s tokens, then `second`'s, in `first`'s form (`second` must have the same dtype,
// layers, heads and head_dim; its layout may differ). In HND a layer is [heads, tokens, dim],
// so joining re-strides every head: both go through chunk form (transport/kv_chunks.h).
HostCache ConcatTokens(const HostCache& first, const HostCache& second);

}  // namespace kvt
