// Non-owning view of a loaded mapper as the backends consume it: both models' shapes and RoPE,
// and per target layer the ordered source-layer lists and the K / V weights (SPEC section 3).
// The mapper store owns the bytes; a view is valid while the store's handle is held.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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

// A dense row-major matrix or vector in a stored dtype.
struct WeightView {
  const void* data = nullptr;
  DType dtype = DType::kFP32;
  int64_t rows = 0;  // 1 for a bias vector
  int64_t cols = 0;
};

// One weight matrix of a mapper as a GEMM: x [rows, k] * W [k, n].
struct GemmShape {
  int64_t k = 0;
  int64_t n = 0;
  bool operator==(const GemmShape& other) const { return k == other.k && n == other.n; }
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
  std::vector<LayerMapView> layers;  // target.num_layers entries
};

}  // namespace kvt
