// The CUDA executor of the translation plan (kernels/translation_plan.h): per step of tokens and
// target layers, a fused gather that strips the source RoPE into a workspace, one cuBLAS
// strided-batched GEMM (fp32 accumulate) over the step's target layers (K and V), then a fused
// epilogue (bias + target RoPE + dtype + layout). MLP mappers (kind: mlp) run three such GEMMs
// with a bias + ReLU kernel between them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvt {

// Caches may live in device memory of the backend's GPU (read and written in place: the fast
// path, e.g. CUDA IPC regions) or in host memory (staged per chunk through pinned buffers;
// PCIe-bound). Each layer pointer is classified on its own with cudaPointerGetAttributes.
// Thread-safe: concurrent calls each take their own stream, cuBLAS handle and workspace.
struct CudaBackendOptions {
  int device = 0;
  // Device workspace per concurrent call (gathered inputs, GEMM outputs, RoPE tables, staging).
  // The token chunk and the target layers per batched GEMM are chosen to fit it.
  int64_t workspace_bytes = int64_t{2} << 30;
  // Calls that run at once, each with its own workspace (never shrunk); more wait for one to
  // end. Their workspaces are what ReservedDeviceBytes reports, so the mapper store's
  // automatic device budget leaves them room.
  int max_concurrent_calls = 4;
  // Tokens per step when TranslateOptions::token_chunk is 0; 0: as many as the workspace allows.
  int64_t token_chunk = 0;
};

// The backend on `options.device`. FAILED_PRECONDITION when the build has no CUDA or there is
// no usable device (the message says which).
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(
    const CudaBackendOptions& options = CudaBackendOptions());

}  // namespace kvt
