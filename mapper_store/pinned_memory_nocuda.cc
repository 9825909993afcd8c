// Fallback of mapper_store/pinned_memory.h for builds without the CUDA toolkit.
#include "mapper_store/pinned_memory.h"

#if !KVT_HAVE_CUDA
namespace kvt {

bool PinnedMemoryAvailable() { return false; }

absl::StatusOr<HostBuffer> AllocatePinnedHostBuffer(size_t) {
  return absl::FailedPreconditionError("built without the CUDA toolkit: no pinned memory");
}

absl::StatusOr<double> PinnedHostToDeviceSeconds(size_t, int) {
  return absl::FailedPreconditionError("built without the CUDA toolkit");
}

}  // namespace kvt
#endif
