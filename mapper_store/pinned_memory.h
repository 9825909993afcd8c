// The yardstick for device page-ins: how long a plain cudaMemcpy of N bytes from pinned host
// memory to device memory takes on this machine, measured in the same run as the pager.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"

namespace kvt {

// Best of `repeats` synchronous host-to-device copies of `bytes` from cudaHostAlloc'd memory
// on the current device, in seconds (after one warm-up copy). FAILED_PRECONDITION without a
// CUDA build or device.
absl::StatusOr<double> PinnedHostToDeviceSeconds(size_t bytes, int repeats);

}  // namespace kvt
