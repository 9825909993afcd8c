// Non-owning view of a loaded mapper as the backends consume it: both models' shapes and RoPE,
// and per target layer the ordered source-layer lists and the K / V weights (SPEC section 3).
// The mapper store owns the bytes; a view is valid while the store's handle is held.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/rope.h"
#include "kernels/types.h"

namespace kvt {

struct ModelSpec {
  std::string name;  // e.g. "Qwen/Qwen3-14B"
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  RopeConfig rope;
};

// A model with plain neox RoPE over the whole head (no scaling): synthetic mappers, custom
// shapes and tests. Real models come from config.json (mapper_store/hf_config.h) or the synth presets.
inline ModelSpec NeoxModelSpec(std::string name, int num_layers, int num_kv_heads, int head_dim,
                               double theta = 10000.0) {
  ModelSpec model;
  model.name = std::move(name);
  model.num_layers = num_layers;
  model.num_kv_heads = num_kv_heads;
  model.head_dim = head_dim;
  model.rope.theta = theta;
  model.rope.rotary_dim = head_dim;
  model.rope.style = RopeStyle::kNeox;
  return model;
}

// Head-local ("per_head") ridge: the source heads target head h reads, [first, first + count).
struct HeadSources {
  int first = 0;
  int count = 0;
};

// Head-local maps pair heads only when one head count divides the other: target head h reads the
// g = max(1, n_s / n_t) source heads from (h n_s) / n_t on (when n_t > n_s, n_t / n_s target
// heads share one source head). INVALID_ARGUMENT naming both counts otherwise.
inline absl::Status CheckHeadLocalHeads(const ModelSpec& source, const ModelSpec& target) {
  const int ns = source.num_kv_heads, nt = target.num_kv_heads;
  if (ns <= 0 || nt <= 0 || (ns % nt != 0 && nt % ns != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "per_head ridge needs one head count to divide the other, but source.num_kv_heads=", ns,
        " and target.num_kv_heads=", nt));
  }
  return absl::OkStatus();
}

// The one home of the head matching (fit, reference and every executor call it). Meaningful
// for heads that passed CheckHeadLocalHeads (a non-positive count is clamped to 1 so that sizing
// an unchecked manifest cannot divide by zero).
inline HeadSources HeadLocalSources(const ModelSpec& source, const ModelSpec& target,
                                    int target_head) {
  const int ns = std::max(1, source.num_kv_heads), nt = std::max(1, target.num_kv_heads);
  HeadSources out;
  out.first = static_cast<int>(static_cast<int64_t>(target_head) * ns / nt);
  out.count = std::max(1, ns / nt);
  return out;
}

// Input columns of one head-local chain: for each window offset, for each sigma block, the
// chain's source heads: window * |sigma| * g * d_s.
inline int64_t HeadLocalInputWidth(const ModelSpec& source, const ModelSpec& target, int window,
                                   size_t sigma_size) {
  return static_cast<int64_t>(window) * static_cast<int64_t>(sigma_size) *
         HeadLocalSources(source, target, 0).count * source.head_dim;
}

// A dense row-major matrix or vector in a stored dtype.
struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::kFP32;
  int64_t rows = 0;  // 1 for a bias vector
  int64_t cols = 0;
};

enum class MapKind { kRidge, kMlp };

// One K or V chain of an MLP mapper, relu(relu(x A1 + c1) A2 + c2) A3 + c3 (SPEC 3), on the same
// gathered, RoPE-stripped x as ridge. per_head: `heads` = n_t and each matrix stacks the heads
// along rows (a1: rows = heads*in, cols = H; a2: heads*H x H; a3: heads*H x d_t; c1, c2: heads x H;
// c3: heads x d_t); head h writes output columns [h d_t, (h+1) d_t). per_layer: heads = 1, a3
// cols = n_t d_t.
struct MlpView {
  int heads = 1;
  int64_t hidden = 0;
  WeightView a1, c1, a2, c2, a3, c3;
};

// One target layer of a ridge ("linear") mapper:
//   x_K = concat_{j in sigma_k} strip_S(K_s^j) head-major  -> k_K * n_s * d_s
//   K_t = apply_T(x_K W_K + b_K)      W_K: (|sigma_k| n_s d_s) x (n_t d_t)
//   V_t = x_V W_V + b_V               W_V: (|sigma_v| n_s d_s) x (n_t d_t)
//
// Head-local ridge (MapperView::head_local): target head h maps only its own source heads
// (HeadLocalSources) of the same gathered row, x_h = for o in window, for b in sigma, heads
// [first, first + g) of block (o, b): d_s values each, in that order. w_k stacks the n_t heads'
// matrices along rows (rows = n_t * |x_h|, cols = d_t, as MlpView stacks chains); b_k is
// n_t x d_t (the same bytes as the per-layer 1 x n_t d_t). n_t GEMMs of |x_h| x d_t instead of
// one of n_s |sigma| d_s x n_t d_t: n_kv times fewer bytes and FLOPs when n_s = n_t.
struct LayerMapView {
  std::vector<int> sigma_k;
  std::vector<int> sigma_v;
  WeightView w_k, b_k, w_v, b_v;  // empty for MLP mappers
  MlpView mlp_k, mlp_v;           // set for MLP mappers only
};

struct MapperView {
  MapKind kind = MapKind::kRidge;
  ModelSpec source;
  ModelSpec target;
  // Tokens each output token reads (manifest `window`): x(p) is the sigma blocks of tokens p,
  // p-1, ..., p-window+1 side by side, offset-major, each block stripped at its own token's
  // position; blocks before the request's first token are zero. The weights' input rows are
  // window * |sigma| * n_s * d_s. 1: SPEC 3's token-wise map.
  int window = 1;
  // Ridge only: per_head granularity (see LayerMapView); false is the per_layer map.
  bool head_local = false;
  std::vector<LayerMapView> layers;  // target.num_layers entries
};

}  // namespace kvt
