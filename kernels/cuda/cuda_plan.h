// Host-side decisions of the CUDA backend that need no GPU: the device copy's layout of a mapper
// (ridge or MLP), the GEMM element type for a request, how many tokens and target layers one step
// may take within the workspace budget, and how a failed CUDA or cuBLAS call becomes an
// absl::Status. Kept apart so CI tests them without a GPU.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"

namespace kvt {
namespace cuda {

// The GEMM operands' type (cuBLAS needs A and B of one type). The cache's own 16-bit dtype when
// the weights and the requested output have it too: X (the stripped source) is then rounded to
// that dtype, an error the size of the output's own rounding, and the GEMM runs bf16 x bf16 on
// the tensor cores with fp32 accumulation. Otherwise fp32 for both, so an fp32 output keeps
// SPEC 3's 1e-5 whatever the input and weight dtypes.
DType GemmDType(DType input, DType weights, DType output);

// Device memory a call's context holds besides its workspace: the cuBLAS handle's own workspace
// (32 MiB on Hopper), pointer tables and stream state, rounded up.
inline constexpr int64_t kContextOverheadBytes = int64_t{64} << 20;

// What the device copy of a mapper looks like. One weight dtype for all layers (a batched GEMM
// has one type): the stored one when every weight matrix agrees, else fp32. Every (layer, kind)
// is padded to the longest sigma list (zero rows) so all GEMMs of a step share one shape. A
// window mapper's input rows are offset-major, each token offset padded on its own: row
// (o * max_blocks + b) * n_s d_s + e is the stored row (o * |sigma| + b) * n_s d_s + e, so the
// gather finds offset o's blocks at the same place in every (layer, kind).
// Ridge: W [layer][kind][input_width][target_width]. MLP, per (layer, kind), `heads` chains
// (1 per_layer, n_t per_head) stored as three arrays so each is one strided batch:
//   A1 [layer][kind][input_width][heads * hidden]  (per_head: head h in columns [h H, (h+1) H),
//                                                   so one GEMM feeds every head from the shared x)
//   A2 [layer][kind][heads][hidden][hidden]
//   A3 [layer][kind][heads][hidden][head_out]      (head_out: n_t d_t per_layer, d_t per_head)
// Head-local ridge (MapperView::head_local): W [layer][kind][n_t][chain_width][d_t], chain_width
// = window * max_blocks * g * d_s padded per token offset like the whole row, and the gathered
// X head-major [pair][n_t][T][chain_width], so one strided batch over (pair, head) multiplies it
// (RidgeHeadGemm); chain_first [n_t] ints: each chain's first source head (HeadLocalSources).
// Biases are fp32: the output bias (ridge b, MLP c3) [layer][kind][target_width], and for MLP
// c1 and c2 [layer][kind][heads * hidden] each. sigma: [layer][kind][max_blocks] ints.
struct DeviceLayout {
  MapKind kind = MapKind::kRidge;
  DType weight_dtype = DType::kFP32;
  int max_blocks = 0;
  int window = 1;            // MapperView::window: token offsets per input row
  int64_t input_width = 0;   // window * max_blocks * n_s * d_s
  int64_t target_width = 0;  // n_t * d_t
  bool padded = false;       // some sigma list is shorter than max_blocks
  int heads = 0;             // MLP chains per (layer, kind); 0 for ridge
  int64_t hidden = 0;        // MLP hidden width H
  int64_t head_out = 0;      // output columns of one chain: MLP, or head-local ridge (d_t)
  // Head-local ridge: chains (n_t) per (layer, kind), source heads per chain (g) and each
  // chain's input rows; 0 for the per_layer map.
  int ridge_heads = 0;
  int group = 0;
  int64_t chain_width = 0;

  bool head_local() const { return ridge_heads > 0; }
  int64_t hidden_width() const { return heads * hidden; }  // 0 for ridge
  // Rows of the matrix stage 0 multiplies X by: chain_width head-local, else input_width.
  int64_t stage0_rows() const { return head_local() ? chain_width : input_width; }
  // Gathered X elements per (pair, token): the whole row, or every chain's row.
  int64_t gathered_width() const { return head_local() ? ridge_heads * chain_width : input_width; }
  // Input rows of one token offset: max_blocks * n_s * d_s (head-local: max_blocks * g * d_s).
  int64_t offset_width() const { return stage0_rows() / window; }
  int64_t ridge_elements() const {
    return head_local() ? ridge_heads * chain_width * head_out : input_width * target_width;
  }
  int64_t a1_elements() const { return input_width * heads * hidden; }
  int64_t a2_elements() const { return static_cast<int64_t>(heads) * hidden * hidden; }
  int64_t a3_elements() const { return static_cast<int64_t>(heads) * hidden * head_out; }
  // Weight elements of one (layer, kind): W, or A1 + A2 + A3.
  int64_t matrix_elements() const {
    return kind == MapKind::kMlp ? a1_elements() + a2_elements() + a3_elements()
                                 : ridge_elements();
  }
  // Elements per (layer, kind) of the device array GemmStage `index` reads: ridge W or MLP A1
  // (0), A2 (1), A3 (2).
  int64_t stage_elements(int index) const {
    if (index == 1) return a2_elements();
    if (index == 2) return a3_elements();
    return kind == MapKind::kMlp ? a1_elements() : ridge_elements();
  }
  uint64_t weight_bytes(int layers) const {
    return static_cast<uint64_t>(layers) * 2 * matrix_elements() * DTypeSize(weight_dtype);
  }
  // Everything a prepared mapper holds on the device: weights, fp32 biases, sigma lists (and a
  // head-local ridge's chain_first).
  uint64_t prepared_bytes(int layers) const {
    const uint64_t bias_floats = static_cast<uint64_t>(target_width) + 2 * hidden_width();
    return weight_bytes(layers) + static_cast<uint64_t>(layers) * 2 * bias_floats * sizeof(float) +
           static_cast<uint64_t>(layers) * 2 * max_blocks * sizeof(int) +
           static_cast<uint64_t>(ridge_heads) * sizeof(int);
  }
};

// The device layout of a mapper that CheckMapperView accepted (INVALID_ARGUMENT for a window
// below 1, which CheckMapperView refuses too). MLP: INVALID_ARGUMENT, naming
// the chain, when the chains do not all share one granularity and hidden width (the format has
// one `mlp:` block per mapper; the batched GEMMs need one shape), or when a GEMM dimension
// exceeds cuBLAS's int range.
absl::StatusOr<DeviceLayout> DeviceLayoutOf(const MapperView& mapper);

// A per_head A1 as stored, [heads][rows][cols] row-major, into the device's [rows][heads * cols]
// (head h in columns [h cols, (h+1) cols)); elements of `element_bytes` bytes are moved as they
// are. `dst` must not overlap `src`.
void InterleaveHeads(const void* src, size_t element_bytes, int heads, int64_t rows, int64_t cols,
                     void* dst);

// Where PrepareLayer puts a stored W or A1 of `rows` input rows (window * its own |sigma| *
// n_s * d_s; one head-local chain's: window * |sigma| * g * d_s) of `row_bytes` each (A1 after InterleaveHeads): copy o < count moves `bytes` from
// the stored matrix + o * bytes to its (layer, kind)'s device slot + o * device_stride. One
// copy when the rows need no moving (no window, or |sigma| = max_blocks); else one per token
// offset, each to its own block of offset_width() rows.
struct InputRowCopies {
  int count = 1;
  int64_t bytes = 0;
  int64_t device_stride = 0;
};
InputRowCopies InputRowCopiesOf(const DeviceLayout& layout, int64_t rows, int64_t row_bytes);

// One cublasGemmStridedBatchedEx call as cuBLAS sees it (column-major, no transposes): for
// b < batch, C_b (m x n, ldc) = A_b (m x k, lda) B_b (k x n, ldb), each operand's entry b at
// its base + b * stride elements. A row-major product R[T, N] = L[T, K] M[K, N] is the
// column-major R^T = M^T L^T: m = N, n = T, k = K, A = M (lda N), B = L (ldb K), C = R (ldc N).
struct StridedGemm {
  int m = 0, n = 0, k = 0;
  int lda = 0, ldb = 0, ldc = 0;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  int batch = 0;
};

// The MLP chain of `pairs` (target layer, kind) pairs over `tokens` tokens, on the device
// layout's arrays offset to the step's first pair:
//   [0] A = A1, B = X [pair][T][input_width]      -> C = Y [pair][T][heads H]
//   (bias + ReLU: Y -> activations [pair][head][T][H])
//   [1] A = A2, B = activations                    -> C = Y [pair][head][T][H]
//   (bias + ReLU: Y -> activations)
//   [2] A = A3, B = activations                    -> C = Y [pair][head][T][head_out]
std::array<StridedGemm, 3> MlpGemms(const DeviceLayout& layout, int64_t tokens, int64_t pairs);

// Head-local ridge over `pairs` pairs: one entry per (pair, head), A = W [pair][head][chain_width]
// [d_t], B = X [pair][head][T][chain_width] -> C = Y [pair][head][T][d_t] (the epilogue's
// head-major Y).
StridedGemm RidgeHeadGemm(const DeviceLayout& layout, int64_t tokens, int64_t pairs);

// What one translation call needs per token and per layer; bytes are device bytes.
struct StepShape {
  int64_t num_tokens = 0;
  int num_layers = 0;            // target layers in the call
  // K: window * the widest |sigma| * n_s * d_s (head-local: DeviceLayout::gathered_width).
  int64_t input_width = 0;
  int64_t target_width = 0;      // n_t * d_t
  // MLP: hidden activations per token of one (layer, kind), heads * H (0 for ridge). They take
  // an fp32 GEMM output (sharing the output buffer, max(target, hidden) wide) plus a copy in the
  // gemm dtype after bias + ReLU that the next GEMM reads.
  int64_t hidden_width = 0;
  // Weight elements of one (layer, kind) (DeviceLayout::matrix_elements); 0: input_width *
  // target_width, the ridge W. Only counted when convert_weights.
  int64_t weight_elements = 0;
  DType gemm_dtype = DType::kFP32;
  bool convert_weights = false;  // weights converted to fp32 per step (mixed dtypes)
  int rope_half_source = 0;      // r_s / 2
  int rope_half_target = 0;      // r_t / 2
  // A window mapper's chunk also reads the window - 1 tokens before it: their source RoPE
  // rows and, for host-memory sources, their staged rows.
  int window = 1;
  // Host-memory caches are staged through device buffers of the chunk's tokens (sources: and of
  // the window - 1 tokens before it).
  int64_t staged_source_bytes_per_token = 0;  // all staged source layers, K and V
  int64_t staged_target_bytes_per_layer_token = 0;  // K and V of one target layer
};

struct StepPlan {
  int64_t chunk_tokens = 0;     // tokens per step (the last step may have fewer)
  int layers_per_group = 0;     // target layers per batched GEMM
  int num_chunks = 0;
  int num_groups = 0;
  // Device workspace, in bytes, for one step of chunk_tokens x layers_per_group.
  int64_t x_bytes = 0;          // gathered inputs, gemm dtype
  int64_t y_bytes = 0;          // GEMM outputs, fp32 (MLP: every GEMM of the chain in turn)
  int64_t hidden_bytes = 0;     // MLP hidden activations after bias + ReLU, gemm dtype
  int64_t weights32_bytes = 0;  // fp32 copies of the group's weights (mixed dtypes only)
  // RoPE cos/sin of both models for the chunk; the source's also for the window - 1 tokens
  // before it.
  int64_t table_bytes = 0;
  int64_t staged_source_bytes = 0;  // chunk_tokens + window - 1 tokens of every staged layer
  int64_t staged_target_bytes = 0;
  int64_t total_bytes() const {
    return x_bytes + y_bytes + hidden_bytes + weights32_bytes + table_bytes +
           staged_source_bytes + staged_target_bytes;
  }
};

// Tokens first (every extra chunk re-reads all weights), then as many target layers per step
// as the budget allows (one batched GEMM over more layers fills the GPU at small T), balanced
// so the groups are equal. `token_chunk` > 0 caps the tokens per step. RESOURCE_EXHAUSTED when
// even one token of one layer does not fit `budget_bytes`.
absl::StatusOr<StepPlan> PlanSteps(const StepShape& shape, int64_t token_chunk,
                                   int64_t budget_bytes);

// What a failed call's code means for the caller.
enum class CudaFailure {
  kOutOfMemory,    // cudaErrorMemoryAllocation, CUBLAS_STATUS_ALLOC_FAILED
  kNoDevice,       // no driver, no device, device unavailable
  kNotSupported,   // CUBLAS_STATUS_NOT_SUPPORTED, unsupported PTX / arch
  kInvalidValue,   // a bad argument reached the library: a bug or a bad pointer
  kOther,
};

// "cublasGemmStridedBatchedEx failed: CUBLAS_STATUS_NOT_SUPPORTED (15): <what>", with the code
// the failure deserves: RESOURCE_EXHAUSTED, FAILED_PRECONDITION, UNIMPLEMENTED, INTERNAL.
absl::Status CudaCallStatus(const char* call, CudaFailure failure, int code,
                            const std::string& code_name, const std::string& description);

}  // namespace cuda
}  // namespace kvt
