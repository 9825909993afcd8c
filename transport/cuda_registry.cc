#include "transport/cuda_registry.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/ipc.h"

namespace kvt {

absl::Status CudaMemoryRegistry::Register(const std::string& name, const std::string& raw_handle,
                                          int device_id, uint64_t byte_size) {
  if (name.empty()) return absl::InvalidArgumentError("name must not be empty");
  if (raw_handle.size() != cuda::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle has ", raw_handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ",
                                                   cuda::kIpcHandleBytes));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  if (Contains(name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("a CUDA memory region named '", name, "' is registered"));
  }
  absl::StatusOr<cuda::IpcMapping> mapping = cuda::OpenIpcHandle(raw_handle, device_id, byte_size);
  if (!mapping.ok()) return mapping.status();
  RegionRegistry::Region region;
  region.name = name;
  region.byte_size = byte_size;
  region.device_id = device_id;
  region.base = mapping->device_ptr;
  region.release = [mapping = *mapping] { cuda::CloseIpcHandle(mapping); };
  return Add(std::move(region));
}

}  // namespace kvt
