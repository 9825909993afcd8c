#include "kernels/cuda/device.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace kvt {
namespace cuda {
namespace {

__global__ void FillBytes(uint32_t* words, size_t count, uint32_t pattern) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    words[i] = pattern;
  }
}

absl::Status CudaError(const char* call, cudaError_t error) {
  return absl::FailedPreconditionError(
      absl::StrCat(call, " failed: ", cudaGetErrorName(error), " (", static_cast<int>(error),
                   "): ", cudaGetErrorString(error)));
}

}  // namespace

bool BuiltWithCuda() { return true; }

absl::StatusOr<int> DeviceCount() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return CudaError("cudaGetDeviceCount", error);
  if (count == 0) return absl::NotFoundError("cudaGetDeviceCount: no CUDA device");
  return count;
}

absl::Status PoisonDeviceBuffer(void* device_ptr, size_t bytes) {
  if (bytes % 4 != 0) {
    const cudaError_t error = cudaMemset(device_ptr, 0xFF, bytes);
    if (error != cudaSuccess) return CudaError("cudaMemset", error);
    return absl::OkStatus();
  }
  const size_t words = bytes / 4;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<size_t>((words + threads - 1) / threads, 4096));
  if (words > 0) FillBytes<<<blocks, threads>>>(static_cast<uint32_t*>(device_ptr), words,
                                                0xFFFFFFFFu);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return CudaError("FillBytes<<<>>>", error);
  error = cudaDeviceSynchronize();
  if (error != cudaSuccess) return CudaError("cudaDeviceSynchronize", error);
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace kvt
