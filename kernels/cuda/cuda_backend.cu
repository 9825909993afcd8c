// Device kernels of the CUDA backend: the fused gather + source-RoPE strip before the GEMMs, the
// MLP's bias + ReLU between its GEMMs and the fused epilogue (bias + target RoPE + dtype +
// layout) after them. Launched by cuda_backend.cc; the GEMMs themselves are cuBLAS.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/cuda/cuda_kernels.h"

namespace kvt {
namespace cuda {
namespace internal {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops: enough blocks to fill any current GPU several times over.
constexpr int64_t kMaxBlocks = 132 * 32;

__device__ __forceinline__ float Load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ float Load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float Load(const float* p, int64_t i) { return p[i]; }

// Round to nearest even, as kernels/dtype does on the CPU.
__device__ __forceinline__ void Store(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void Store(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void Store(float* p, int64_t i, float v) { p[i] = v; }

// The two dimensions element pair `q` of a head covers: a rotary pair (neox: q, q + r/2; gptj:
// 2q, 2q + 1) for q < r/2, two neighbouring pass-through dimensions after that. d1 may equal
// head_dim for an odd head_dim's last pair (then it is skipped).
__device__ __forceinline__ void PairDims(int q, int half, int neox, bool rotary, int* d0,
                                         int* d1) {
  if (rotary && q < half && neox) {
    *d0 = q;
    *d1 = q + half;
  } else {
    *d0 = 2 * q;
    *d1 = 2 * q + 1;
  }
}

// Element offset of (head, token, dim 0) in a layer of `tokens` tokens: kernels/types.h
// CacheOffset on the device (that one is a host function; making it constexpr would let nvcc
// call it here, at the price of recompiling every file that includes types.h).
__device__ __forceinline__ int64_t HeadOffset(int layout, int heads, int64_t tokens, int head_dim,
                                              int head, int64_t token) {
  return layout == kHND ? (static_cast<int64_t>(head) * tokens + token) * head_dim
                        : (token * heads + head) * static_cast<int64_t>(head_dim);
}

// One block per row of X (a (target layer, kind, token) triple, 64-bit index arithmetic once),
// its threads over the row's (block, head, pair) items with 32-bit index arithmetic:
// neighbouring threads read and write neighbouring elements. Head-local (p.chains > 0): the
// items are (chain, block, chain head, pair) and each chain's part goes to its own head-major row.
template <typename In, typename X>
__global__ void __launch_bounds__(kThreads) GatherKernel(GatherParams p) {
  const int pairs = (p.head_dim + 1) / 2;
  const int blocks = p.window * p.max_blocks;
  const int row_items = (p.chains > 0 ? p.chains * blocks * p.group : blocks * p.heads) * pairs;
  const int64_t width = static_cast<int64_t>(blocks) * p.heads * p.head_dim;
  const int64_t rows = static_cast<int64_t>(p.num_layers) * 2 * p.chunk_tokens;
  // A staged source slot holds tokens [window_begin, chunk_begin + chunk_tokens).
  const int64_t staged_tokens = p.chunk_begin + p.chunk_tokens - p.window_begin;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    // row = (g * 2 + kind) * chunk_tokens + i
    const int64_t i = row % p.chunk_tokens;
    const int kind = static_cast<int>((row / p.chunk_tokens) % 2);
    const int g = static_cast<int>(row / p.chunk_tokens / 2);
    const int layer = p.layer_begin + g;
    const int* sigma = p.sigma + (static_cast<int64_t>(layer) * 2 + kind) * p.max_blocks;
    X* out_row = static_cast<X*>(p.x) + row * width;
    // Offset 0 (this row's own token): its token and its row of the strip table and of a staged
    // slot; offset o reads o tokens, and o table rows, earlier.
    const int64_t t0 = p.chunk_begin + i;
    const int64_t r0 = t0 - p.window_begin;
    const float* cos_row = p.strip.cos + r0 * p.strip.half;
    const float* sin_row = p.strip.sin + r0 * p.strip.half;
    for (int item = threadIdx.x; item < row_items; item += blockDim.x) {
      // item = ((o * max_blocks + b) * heads + h) * pairs + q, or head-local
      // ((c * blocks + o * max_blocks + b) * group + s) * pairs + q reading head chain_first[c] + s.
      const int q = item % pairs;
      const int bh = item / pairs;
      int h, ob;
      X* out;
      if (p.chains > 0) {
        const int s = bh % p.group;
        const int cob = bh / p.group;
        ob = cob % blocks;
        const int c = cob / blocks;
        h = p.chain_first[c] + s;
        out = static_cast<X*>(p.x) +
              (((row / p.chunk_tokens) * p.chains + c) * p.chunk_tokens + i) * p.chain_width +
              static_cast<int64_t>(ob * p.group + s) * p.head_dim;
      } else {
        h = bh % p.heads;
        ob = bh / p.heads;
        out = out_row + static_cast<int64_t>(bh) * p.head_dim;
      }
      // The division only where there is a window (uniform across the grid).
      const int o = p.window == 1 ? 0 : ob / p.max_blocks;
      const int b = ob - o * p.max_blocks;
      const bool rotary = kind == 0 && q < p.strip.half;
      int d0, d1;
      PairDims(q, p.strip.half, p.strip.neox, kind == 0, &d0, &d1);
      const bool second = d1 < p.head_dim;
      const int j = sigma[b];
      // A padding block of a shorter sigma list, or a token before the request's first.
      if (j < 0 || o > t0) {
        Store(out, d0, 0.0f);
        if (second) Store(out, d1, 0.0f);
        continue;
      }
      const int table = kind * p.num_source_layers + j;
      const int slot = p.source.stage_slot[table];
      const In* src;
      int64_t tokens, token;
      if (slot >= 0) {
        src = static_cast<const In*>(p.source.stage) + slot * p.source.stage_slot_elements;
        tokens = staged_tokens;
        token = r0 - o;
      } else {
        src = static_cast<const In*>(p.source.pointers[table]);
        tokens = p.num_tokens;
        token = t0 - o;
      }
      src += HeadOffset(p.source_layout, p.heads, tokens, p.head_dim, h, token);
      const float a = Load(src, d0);
      const float c = second ? Load(src, d1) : 0.0f;
      if (rotary) {
        // R(p)^-1 of a cache written as A R(p) x: the table's cos/sin carry A, so divide by A^2.
        const int at = q - o * p.strip.half;
        const float cs = cos_row[at];
        const float sn = sin_row[at];
        Store(out, d0, (a * cs + c * sn) * p.strip.scale);
        Store(out, d1, (c * cs - a * sn) * p.strip.scale);
      } else {
        Store(out, d0, a);
        if (second) Store(out, d1, c);
      }
    }
  }
}

// Same shape as the gather: one block per (target layer, kind, token) row of Y.
template <typename Out>
__global__ void __launch_bounds__(kThreads) EpilogueKernel(EpilogueParams p) {
  const int pairs = (p.head_dim + 1) / 2;
  const int row_items = p.heads * pairs;
  const int64_t width = static_cast<int64_t>(p.heads) * p.head_dim;
  const int64_t rows = static_cast<int64_t>(p.num_layers) * 2 * p.chunk_tokens;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t i = row % p.chunk_tokens;
    const int kind = static_cast<int>((row / p.chunk_tokens) % 2);
    const int g = static_cast<int>(row / p.chunk_tokens / 2);
    const int layer = p.layer_begin + g;
    const float* y_row = p.y + row * width;
    const float* bias_row = p.bias + (static_cast<int64_t>(layer) * 2 + kind) * width;
    const float* cos_row = p.apply.cos + i * p.apply.half;
    const float* sin_row = p.apply.sin + i * p.apply.half;
    const int table = kind * p.num_target_layers + layer;
    Out* dst;
    int64_t tokens, token;
    if (p.target.stage_slot[table] >= 0) {
      dst = static_cast<Out*>(p.target.stage) +
            (static_cast<int64_t>(g) * 2 + kind) * p.target.stage_slot_elements;
      tokens = p.chunk_tokens;
      token = i;
    } else {
      dst = static_cast<Out*>(const_cast<void*>(p.target.pointers[table]));
      tokens = p.num_tokens;
      token = p.chunk_begin + i;
    }
    for (int item = threadIdx.x; item < row_items; item += blockDim.x) {
      const int q = item % pairs;
      const int h = item / pairs;
      const bool rotary = kind == 0 && q < p.apply.half;
      int d0, d1;
      PairDims(q, p.apply.half, p.apply.neox, kind == 0, &d0, &d1);
      const bool second = d1 < p.head_dim;
      const int64_t column = static_cast<int64_t>(h) * p.head_dim;
      // row / chunk_tokens is the (layer, kind) pair g * 2 + kind.
      const float* y_head =
          p.y_head_major
              ? p.y + ((row / p.chunk_tokens) * p.heads + h) * p.chunk_tokens * p.head_dim +
                    i * p.head_dim
              : y_row + column;
      float a = y_head[d0] + bias_row[column + d0];
      float c = second ? y_head[d1] + bias_row[column + d1] : 0.0f;
      if (rotary) {
        const float cs = cos_row[q];
        const float sn = sin_row[q];
        const float ra = a * cs - c * sn;
        c = c * cs + a * sn;
        a = ra;
      }
      Out* out = dst + HeadOffset(p.target_layout, p.heads, tokens, p.head_dim, h, token);
      Store(out, d0, a);
      if (second) Store(out, d1, c);
    }
  }
}

// One block per (layer, kind, token) row: its threads over the hidden units of each head, so
// reads and writes of neighbouring threads are neighbouring elements in both layouts.
template <typename Out>
__global__ void __launch_bounds__(kThreads) BiasReluKernel(BiasReluParams p) {
  const int64_t width = static_cast<int64_t>(p.heads) * p.hidden;
  const int64_t rows = p.rows * p.chunk_tokens;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t pair = row / p.chunk_tokens;
    const int64_t i = row % p.chunk_tokens;
    const float* bias_row = p.bias + pair * width;
    for (int h = 0; h < p.heads; ++h) {
      const int64_t out_row = ((pair * p.heads + h) * p.chunk_tokens + i) * p.hidden;
      const float* y_row = p.y + (p.y_interleaved ? row * width + h * p.hidden : out_row);
      Out* out = static_cast<Out*>(p.out) + out_row;
      for (int j = threadIdx.x; j < p.hidden; j += blockDim.x) {
        const float v = y_row[j] + bias_row[h * p.hidden + j];
        Store(out, j, v < 0.0f ? 0.0f : v);
      }
    }
  }
}

template <typename In>
__global__ void __launch_bounds__(kThreads) ToFloatKernel(const In* src, float* dst,
                                                          int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = Load(src, i);
  }
}

// Blocks for `items` elements, one per thread.
int Blocks(int64_t items) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min(kMaxBlocks, (items + kThreads - 1) / kThreads)));
}

// One block per row, up to the grid's limit (the kernels stride over the rest).
int RowBlocks(int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t{1} << 30)));
}

// Calls launch(T{}) with T the element type that `type` names (kBF16, kFP16, kFP32): the one
// place the launchers map an ElementType to a C++ type.
template <typename Launch>
cudaError_t ByElementType(int type, Launch&& launch) {
  switch (type) {
    case kBF16:
      return launch(__nv_bfloat16{});
    case kFP16:
      return launch(__half{});
    case kFP32:
      return launch(float{});
  }
  return cudaErrorInvalidValue;
}

// X is the cache's dtype or fp32 (cuda_plan.h GemmDType): only those pairs are built.
template <typename In>
cudaError_t LaunchGatherFrom(const GatherParams& p, int64_t rows, cudaStream_t stream) {
  if (p.x_type == kFP32) {
    GatherKernel<In, float><<<RowBlocks(rows), kThreads, 0, stream>>>(p);
  } else {
    GatherKernel<In, In><<<RowBlocks(rows), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchGather(const GatherParams& p, cudaStream_t stream) {
  if (p.x_type != kFP32 && p.x_type != p.source_type) return cudaErrorInvalidValue;
  const int64_t rows = static_cast<int64_t>(p.num_layers) * 2 * p.chunk_tokens;
  if (rows == 0 || p.max_blocks == 0 || p.heads == 0 || p.head_dim == 0) return cudaSuccess;
  // The strip table and staged slots start where the window's first token does: any other
  // start would read outside them.
  if (p.window < 1 ||
      p.window_begin != std::max<int64_t>(0, p.chunk_begin - (p.window - 1))) {
    return cudaErrorInvalidValue;
  }
  return ByElementType(p.source_type, [&](auto in) {
    return LaunchGatherFrom<decltype(in)>(p, rows, stream);
  });
}

cudaError_t LaunchEpilogue(const EpilogueParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_layers) * 2 * p.chunk_tokens;
  if (rows == 0 || p.heads == 0 || p.head_dim == 0) return cudaSuccess;
  return ByElementType(p.target_type, [&](auto out) {
    EpilogueKernel<decltype(out)><<<RowBlocks(rows), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t LaunchBiasRelu(const BiasReluParams& p, cudaStream_t stream) {
  const int64_t rows = p.rows * p.chunk_tokens;
  if (rows == 0 || p.heads == 0 || p.hidden == 0) return cudaSuccess;
  return ByElementType(p.out_type, [&](auto out) {
    BiasReluKernel<decltype(out)><<<RowBlocks(rows), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t LaunchToFloat(const void* src, int src_type, float* dst, int64_t count,
                          cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (src_type) {
    case kBF16:
      ToFloatKernel<<<Blocks(count), kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(src), dst, count);
      return cudaGetLastError();
    case kFP16:
      ToFloatKernel<<<Blocks(count), kThreads, 0, stream>>>(static_cast<const __half*>(src), dst,
                                                            count);
      return cudaGetLastError();
    case kFP32:
      return cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToDevice, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace internal
}  // namespace cuda
}  // namespace kvt
