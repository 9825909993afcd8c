// CUDA IPC memory: opening a device allocation another process exported (cudaIpcGetMemHandle)
// with its real size checked through the driver, copies between it and host memory, and the
// exporting side's helpers for clients and tests. Every call names what failed; without a CUDA
// build they return FAILED_PRECONDITION "built without CUDA", without a usable device
// UNAVAILABLE "no CUDA device".
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvt {
namespace cuda {

// sizeof(cudaIpcMemHandle_t).
inline constexpr size_t kIpcHandleBytes = 64;

struct IpcMapping {
  char* device_ptr = nullptr;  // start of the exported allocation, in this process
  uint64_t allocation_bytes = 0;  // its real size (cuMemGetAddressRange)
  int device_id = 0;
};

// Opens `raw_handle` (kIpcHandleBytes bytes) on `device_id` and checks that `byte_size` fits
// the allocation the driver reports. INVALID_ARGUMENT: handle size, device_id out of range,
// byte_size 0 or beyond the allocation (the mapping is closed again); FAILED_PRECONDITION /
// UNAVAILABLE as above; INVALID_ARGUMENT naming the CUDA error when the driver refuses the
// handle (stale, from this process, or from another device).
absl::StatusOr<IpcMapping> OpenIpcHandle(const std::string& raw_handle, int device_id,
                                         uint64_t byte_size);
void CloseIpcHandle(const IpcMapping& mapping);

// Synchronous copies between host memory and device memory on `device_id`.
absl::Status CopyToHost(int device_id, const void* device_src, void* host_dst, size_t bytes);
absl::Status CopyToDevice(int device_id, const void* host_src, void* device_dst, size_t bytes);

// The exporting side (a client, a test): an allocation on `device_id`, its IPC handle bytes.
absl::StatusOr<void*> AllocateDevice(int device_id, size_t bytes);
void FreeDevice(int device_id, void* device_ptr);
absl::StatusOr<std::string> ExportIpcHandle(int device_id, void* device_ptr);

}  // namespace cuda
}  // namespace kvt
