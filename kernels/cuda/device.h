// CUDA device discovery and the smallest pieces of device code every GPU check needs: how many
// usable GPUs there are (0, with the reason, when the build has no CUDA or the driver is
// missing) and filling a device buffer with a poison pattern so unwritten output shows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvt {
namespace cuda {

// True when this binary was built with the CUDA toolkit.
bool BuiltWithCuda();

// Usable CUDA devices. An error (never a crash) says why there are none: no toolkit at build
// time, no driver ("insufficient driver"), or no device.
absl::StatusOr<int> DeviceCount();

// Fills `bytes` of device memory at `device_ptr` with the byte pattern 0xFF (a NaN in bf16, fp16
// and fp32), on the current device, synchronously.
absl::Status PoisonDeviceBuffer(void* device_ptr, size_t bytes);

}  // namespace cuda
}  // namespace kvt
