// Pinned (page-locked, cudaHostAlloc) host memory for CUDA builds: the host tier's allocator,
// so device page-ins copy at full PCIe/NVLink speed, and the yardstick the page-in benchmark
// compares against (a plain cudaMemcpy from pinned memory). Fallbacks without CUDA.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "common/host_buffer.h"

namespace kvt {

// True when this binary has CUDA and a device is usable (so pinning memory is possible).
bool PinnedMemoryAvailable();

// `size` bytes of cudaHostAlloc'd memory, freed with cudaFreeHost: a HostAllocator for
// LoadOptions::allocator. RESOURCE_EXHAUSTED when the driver refuses (too much pinned memory),
// FAILED_PRECONDITION without CUDA.
absl::StatusOr<HostBuffer> AllocatePinnedHostBuffer(size_t size);

// Best of `repeats` synchronous host-to-device copies of `bytes` from cudaHostAlloc'd memory
// on the current device, in seconds (after one warm-up copy). FAILED_PRECONDITION without a
// CUDA build or device.
absl::StatusOr<double> PinnedHostToDeviceSeconds(size_t bytes, int repeats);

}  // namespace kvt
