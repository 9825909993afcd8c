#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "mapper_store/pinned_memory.h"

namespace kvt {
namespace {

absl::Status CudaError(const char* call, cudaError_t error) {
  return absl::FailedPreconditionError(absl::StrCat(call, " failed: ", cudaGetErrorName(error),
                                                    ": ", cudaGetErrorString(error)));
}

}  // namespace

bool PinnedMemoryAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::StatusOr<HostBuffer> AllocatePinnedHostBuffer(size_t size) {
  void* data = nullptr;
  if (cudaError_t e = cudaHostAlloc(&data, size == 0 ? 1 : size, cudaHostAllocDefault);
      e != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cudaHostAlloc of ", size, " bytes of pinned host memory failed: ", cudaGetErrorName(e),
        ": ", cudaGetErrorString(e)));
  }
  return HostBuffer(data, size, [](void* p) { cudaFreeHost(p); });
}

absl::StatusOr<double> PinnedHostToDeviceSeconds(size_t bytes, int repeats) {
  void* host = nullptr;
  void* device = nullptr;
  if (cudaError_t e = cudaHostAlloc(&host, bytes, cudaHostAllocDefault); e != cudaSuccess) {
    return CudaError("cudaHostAlloc", e);
  }
  if (cudaError_t e = cudaMalloc(&device, bytes); e != cudaSuccess) {
    cudaFreeHost(host);
    return CudaError("cudaMalloc", e);
  }
  std::fill_n(static_cast<char*>(host), bytes, 1);  // touch every page before timing
  double best = 1e30;
  absl::Status status;
  for (int i = 0; i <= repeats && status.ok(); ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (cudaError_t e = cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      status.Update(CudaError("cudaMemcpy", e));  // not `=`: nvcc flags the discarded Status&
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i > 0) best = std::min(best, seconds);  // i == 0 warms up
  }
  cudaFree(device);
  cudaFreeHost(host);
  if (!status.ok()) return status;
  return best;
}

}  // namespace kvt
