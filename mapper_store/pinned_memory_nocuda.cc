// Fallback of mapper_store/pinned_copy.h for builds without the CUDA toolkit.
#include "mapper_store/pinned_copy.h"

#if !KVT_HAVE_CUDA
namespace kvt {

absl::StatusOr<double> PinnedHostToDeviceSeconds(size_t, int) {
  return absl::FailedPreconditionError("built without the CUDA toolkit");
}

}  // namespace kvt
#endif
