// CUDA IPC memory: opening another process's exported allocation, copies, exporting helpers.
#pragma once

// A handle names a whole allocation: cudaIpcOpenMemHandle maps it at its *base*, whichever
// pointer inside it was exported. A region is therefore the allocation from its base, and
// offsets into it (RegionRef.offset) count from that base; an exporter of a tensor carved from
// a larger allocation (PyTorch's caching allocator) sends the tensor's offset from the base,
// which ExportIpcHandle returns. Every call names what failed; without a CUDA build they return
// FAILED_PRECONDITION "built without CUDA", without a usable device UNAVAILABLE "no CUDA device".

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
  char* device_ptr = nullptr;     // base of the exported allocation, in this process
  uint64_t allocation_bytes = 0;  // its real size (cuMemGetAddressRange)
  int device_id = 0;
  void* opened_ptr = nullptr;     // what cudaIpcOpenMemHandle returned (closed by it)
};

// Opens `raw_handle` (kIpcHandleBytes bytes) on `device_id` and checks that `byte_size`, counted
// from the allocation base, fits the allocation the driver reports. INVALID_ARGUMENT: handle size, device_id out of range,
// byte_size 0 or beyond the allocation (the mapping is closed again); FAILED_PRECONDITION /
// UNAVAILABLE as above; INVALID_ARGUMENT naming the CUDA error when the driver refuses the
// handle (stale, from this process, or from another device).
absl::StatusOr<IpcMapping> OpenIpcHandle(const std::string& raw_handle, int device_id,
                                         uint64_t byte_size);
void CloseIpcHandle(const IpcMapping& mapping);

// Copies between host memory and device memory on `device_id` that return only once the bytes
// have landed (a pageable cudaMemcpy alone may return before its DMA to the device ends), so a
// notice sent after CopyToDevice finds the data in place.
absl::Status CopyToHost(int device_id, const void* device_src, void* host_dst, size_t bytes);
absl::Status CopyToDevice(int device_id, const void* host_src, void* device_dst, size_t bytes);

// The exporting side (a client, a test): an allocation on `device_id`, its IPC handle.
absl::StatusOr<void*> AllocateDevice(int device_id, size_t bytes);
void FreeDevice(int device_id, void* device_ptr);

struct IpcExport {
  std::string handle;             // kIpcHandleBytes bytes, for RegisterCudaMemory
  uint64_t offset = 0;            // device_ptr - allocation base: add it to RegionRef offsets
  uint64_t allocation_bytes = 0;  // from the base; the most a registration may cover
};
// The handle of the allocation holding `device_ptr` (any pointer inside it) and where
// `device_ptr` lies in it.
absl::StatusOr<IpcExport> ExportIpcHandle(int device_id, void* device_ptr);

}  // namespace cuda
}  // namespace kvt
