// Host-side decisions of the CUDA backend that need no GPU: the GEMM element type for a request,
// how many tokens and target layers one step may take within the workspace budget, and how a
// failed CUDA or cuBLAS call becomes an absl::Status. Kept apart so CI tests them without a GPU.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/types.h"

namespace kvt {
namespace cuda {

// The GEMM operands' type (cuBLAS needs A and B of one type). The cache's own 16-bit dtype when
// the weights and the requested output have it too: X (the stripped source) is then rounded to
// that dtype, an error the size of the output's own rounding, and the GEMM runs bf16 x bf16 on
// the tensor cores with fp32 accumulation. Otherwise fp32 for both, so an fp32 output keeps
// SPEC 3's 1e-5 whatever the input and weight dtypes.
DType GemmDType(DType input, DType weights, DType output);

// What one translation call needs per token and per layer; bytes are device bytes.
struct StepShape {
  int64_t num_tokens = 0;
  int num_layers = 0;            // target layers in the call
  int64_t input_width = 0;       // K: the widest |sigma| * n_s * d_s over the call's layers
  int64_t target_width = 0;      // n_t * d_t
  DType gemm_dtype = DType::kFP32;
  bool convert_weights = false;  // weights converted to fp32 per step (mixed dtypes)
  int rope_half_source = 0;      // r_s / 2
  int rope_half_target = 0;      // r_t / 2
  // Host-memory caches are staged through device buffers of the chunk's tokens.
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
  int64_t y_bytes = 0;          // GEMM outputs, fp32
  int64_t weights32_bytes = 0;  // fp32 copies of the group's weights (mixed dtypes only)
  int64_t table_bytes = 0;      // RoPE cos/sin of both models for the chunk
  int64_t staged_source_bytes = 0;
  int64_t staged_target_bytes = 0;
  int64_t total_bytes() const {
    return x_bytes + y_bytes + weights32_bytes + table_bytes + staged_source_bytes +
           staged_target_bytes;
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
