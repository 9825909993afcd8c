// The device kernels of the CUDA backend (cuda_backend.cu) as cuda_backend.cc launches them:
// plain structs, no absl, so nvcc compiles only the kernels. Element types use DType's order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvt {
namespace cuda {
namespace internal {

// kernels/types.h DType values, as ints the .cu file can use without the header.
enum ElementType : int { kBF16 = 0, kFP16 = 1, kFP32 = 2 };
// kernels/types.h Layout values.
enum CacheLayout : int { kHND = 0, kNHD = 1 };

// A chunk's RoPE of one model, computed on the host by kernels/rope: row i (`half` floats) of
// cos and sin is token chunk_begin + i (the gather's strip table: window_begin + i), already
// multiplied by the attention factor.
struct RopeTable {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int half = 0;        // r / 2
  int neox = 1;        // 1: m pairs with m + r/2; 0: 2m pairs with 2m + 1 (gptj)
  float scale = 1.0f;  // strip only: 1 / attention_factor^2 (cos/sin carry the factor once)
};

// Where one cache's layers are for one call: per [kind][layer] (kind 0 = K, 1 = V) either a
// device pointer to the whole layer (num_tokens tokens) or, when `stage_slot` >= 0, a slot of a
// staging buffer holding only the chunk's tokens (host-memory caches), same layout; a source
// slot holds tokens [window_begin, chunk_begin + chunk_tokens) (GatherParams). Sources use
// slot `stage_slot`; targets use slot (layer - layer_begin) * 2 + kind, since a staged target
// buffer holds one step's layers.
struct LayerTable {
  const void* const* pointers = nullptr;  // device array [2][num_layers]
  const int* stage_slot = nullptr;        // device array [2][num_layers]
  void* stage = nullptr;                  // staging buffer base
  int64_t stage_slot_elements = 0;        // elements per slot (>= its tokens * heads * dim)
};

struct GatherParams {
  // Source cache.
  LayerTable source;
  int num_source_layers = 0;
  int source_type = kBF16;
  int source_layout = kHND;
  int heads = 0;     // n_s
  int head_dim = 0;  // d_s
  int64_t num_tokens = 0;  // whole cache
  // Chunk and target layers of this step.
  int64_t chunk_begin = 0;
  int64_t chunk_tokens = 0;
  int layer_begin = 0;
  int num_layers = 0;
  // sigma: device [target layer][kind][max_blocks], -1 past |sigma|: those blocks are zeros
  // (their weight rows are zero too), so every layer has the same GEMM shape.
  const int* sigma = nullptr;
  int max_blocks = 0;
  // Window mappers: block o * max_blocks + b of token t's row is sigma block b at token t - o
  // (zeros before token 0), stripped at that token's position. window_begin =
  // max(0, chunk_begin - (window - 1)), the first token the chunk reads: row 0 of the strip
  // table and of a staged source slot.
  int window = 1;
  int64_t window_begin = 0;
  // Output X: [num_layers][2][chunk_tokens][window * max_blocks * heads * head_dim] in x_type.
  void* x = nullptr;
  // Head-local ridge: chains (n_t) > 0 writes X head-major instead, [num_layers][2][chains]
  // [chunk_tokens][chain_width], chain c's row holding source heads [chain_first[c],
  // chain_first[c] + group) of every block (offset-major, then sigma); 0: the whole row.
  int chains = 0;
  int group = 0;
  const int* chain_first = nullptr;  // device [chains], from the plan's chain_sources
  int64_t chain_width = 0;           // window * max_blocks * group * head_dim
  int x_type = kBF16;
  RopeTable strip;
};

struct EpilogueParams {
  // GEMM output Y: [num_layers][2][chunk_tokens][heads * head_dim] fp32, or with y_head_major
  // [num_layers][2][heads][chunk_tokens][head_dim] (per-head MLP chains, one GEMM entry each).
  const float* y = nullptr;
  int y_head_major = 0;
  // Bias: device [target layer][kind][heads * head_dim] fp32 (zeros where the mapper has none).
  const float* bias = nullptr;
  LayerTable target;
  int num_target_layers = 0;
  int target_type = kBF16;
  int target_layout = kHND;
  int heads = 0;     // n_t
  int head_dim = 0;  // d_t
  int64_t num_tokens = 0;
  int64_t chunk_begin = 0;
  int64_t chunk_tokens = 0;
  int layer_begin = 0;
  int num_layers = 0;
  RopeTable apply;
};

// Between the MLP's GEMMs: out = relu(y + bias), converted to out_type (the next GEMM's input
// type). Rows are the step's (target layer, kind) pairs.
struct BiasReluParams {
  // fp32 GEMM output: y_interleaved 1: [rows][chunk_tokens][heads * hidden] (the first GEMM,
  // every head from the shared x); 0: [rows][heads][chunk_tokens][hidden], out's layout.
  const float* y = nullptr;
  int y_interleaved = 1;
  const float* bias = nullptr;  // [rows][heads * hidden] fp32: c1 or c2 of the step's layers
  void* out = nullptr;          // [rows][heads][chunk_tokens][hidden] in out_type
  int out_type = kBF16;
  int heads = 1;
  int hidden = 0;
  int64_t rows = 0;
  int64_t chunk_tokens = 0;
};

// Gathers sigma's source layers of the step's target layers (K and V) into X, stripping the
// source RoPE from K on the way.
cudaError_t LaunchGather(const GatherParams& params, cudaStream_t stream);

// Y + bias, target RoPE on K, conversion to the target dtype, written in the target layout.
cudaError_t LaunchEpilogue(const EpilogueParams& params, cudaStream_t stream);

// relu(y + bias) of the MLP's hidden units, NaN kept (a NaN must not turn into a zero).
cudaError_t LaunchBiasRelu(const BiasReluParams& params, cudaStream_t stream);

// dst[i] = float(src[i]) for `count` elements of `src_type`.
cudaError_t LaunchToFloat(const void* src, int src_type, float* dst, int64_t count,
                          cudaStream_t stream);

}  // namespace internal
}  // namespace cuda
}  // namespace kvt
