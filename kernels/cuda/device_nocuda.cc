// Fallback of kernels/cuda/device.h for builds without the CUDA toolkit.
#include "kernels/cuda/device.h"

#if !KVT_HAVE_CUDA
namespace kvt {
namespace cuda {

bool BuiltWithCuda() { return false; }

absl::StatusOr<int> DeviceCount() {
  return absl::FailedPreconditionError("built without the CUDA toolkit");
}

absl::Status PoisonDeviceBuffer(void*, size_t) {
  return absl::FailedPreconditionError("built without the CUDA toolkit");
}

}  // namespace cuda
}  // namespace kvt
#endif
