#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/ipc.h"

namespace kvt {
namespace cuda {
namespace {

std::string CudaErrorText(const char* call, cudaError_t error) {
  return absl::StrCat(call, " failed: ", cudaGetErrorName(error), " (", static_cast<int>(error),
                      "): ", cudaGetErrorString(error));
}

// UNAVAILABLE unless a driver and `device_id` exist; INVALID_ARGUMENT for a device id out of
// range. Leaves `device_id` current on this thread.
absl::Status UseDevice(int device_id) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device on this server (",
        error != cudaSuccess ? CudaErrorText("cudaGetDeviceCount", error)
                             : std::string("cudaGetDeviceCount: 0 devices"),
        ")"));
  }
  if (device_id < 0 || device_id >= count) {
    return absl::InvalidArgumentError(absl::StrCat("device_id=", device_id, " but this server has ",
                                                   count, " CUDA device(s): 0..", count - 1));
  }
  const cudaError_t set = cudaSetDevice(device_id);
  if (set != cudaSuccess) {
    return absl::UnavailableError(CudaErrorText("cudaSetDevice", set));
  }
  return absl::OkStatus();
}

// cuMemGetAddressRange from the driver the runtime already loaded: no -lcuda link, so kvtd
// starts on machines without a driver.
absl::StatusOr<PFN_cuMemGetAddressRange_v3020> AddressRangeFunction() {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t error = cudaGetDriverEntryPointByVersion(
      "cuMemGetAddressRange", &function, 3020, cudaEnableDefault, &found);
  if (error != cudaSuccess || found != cudaDriverEntryPointSuccess || function == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("the CUDA driver has no cuMemGetAddressRange (",
                     error != cudaSuccess ? CudaErrorText("cudaGetDriverEntryPointByVersion", error)
                                          : std::string("symbol not found"),
                     ")"));
  }
  return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(function);
}

struct AddressRange {
  char* base = nullptr;
  uint64_t bytes = 0;
};

// The allocation holding `pointer`.
absl::StatusOr<AddressRange> RangeOf(PFN_cuMemGetAddressRange_v3020 address_range,
                                     const void* pointer) {
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult ranged = address_range(&base, &size, reinterpret_cast<CUdeviceptr>(pointer));
  if (ranged != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed: CUresult ", ranged));
  }
  return AddressRange{reinterpret_cast<char*>(base), static_cast<uint64_t>(size)};
}

// A pageable cudaMemcpy returns once the bytes are staged, not landed: wait for the legacy
// stream it ran on.
absl::Status Landed(const char* what) {
  const cudaError_t error = cudaStreamSynchronize(cudaStreamLegacy);
  if (error != cudaSuccess) {
    return absl::InternalError(CudaErrorText(what, error));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<IpcMapping> OpenIpcHandle(const std::string& raw_handle, int device_id,
                                         uint64_t byte_size) {
  if (raw_handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle has ", raw_handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ",
                                                   kIpcHandleBytes));
  }
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  if (absl::Status device = UseDevice(device_id); !device.ok()) return device;
  absl::StatusOr<PFN_cuMemGetAddressRange_v3020> address_range = AddressRangeFunction();
  if (!address_range.ok()) return address_range.status();

  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, raw_handle.data(), kIpcHandleBytes);
  void* pointer = nullptr;
  const cudaError_t opened =
      cudaIpcOpenMemHandle(&pointer, handle, cudaIpcMemLazyEnablePeerAccess);
  if (opened != cudaSuccess) {
    cudaGetLastError();  // the error is the caller's, not sticky for later calls
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_handle: ", CudaErrorText("cudaIpcOpenMemHandle", opened),
        " (a handle must come from cudaIpcGetMemHandle in another process, for a live "
        "allocation on device_id=",
        device_id, ")"));
  }
  absl::StatusOr<AddressRange> range = RangeOf(*address_range, pointer);
  if (!range.ok()) {
    cudaIpcCloseMemHandle(pointer);
    return range.status();
  }
  // The region starts at the allocation base (ipc.h), also if a driver returned another
  // pointer inside the allocation.
  if (byte_size > range->bytes) {
    cudaIpcCloseMemHandle(pointer);
    return absl::InvalidArgumentError(absl::StrCat(
        "byte_size=", byte_size, " exceeds the ", range->bytes,
        " bytes of the exported CUDA allocation from its base (cuMemGetAddressRange; offsets "
        "count from the allocation base, not from the exported pointer)"));
  }
  IpcMapping mapping;
  mapping.device_ptr = range->base;
  mapping.allocation_bytes = range->bytes;
  mapping.device_id = device_id;
  mapping.opened_ptr = pointer;
  return mapping;
}

void CloseIpcHandle(const IpcMapping& mapping) {
  if (mapping.device_ptr == nullptr) return;
  cudaSetDevice(mapping.device_id);
  cudaIpcCloseMemHandle(mapping.opened_ptr != nullptr ? mapping.opened_ptr : mapping.device_ptr);
}

absl::Status CopyToHost(int device_id, const void* device_src, void* host_dst, size_t bytes) {
  if (absl::Status device = UseDevice(device_id); !device.ok()) return device;
  const cudaError_t error = cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost);
  if (error != cudaSuccess) return absl::InternalError(CudaErrorText("cudaMemcpy D2H", error));
  return Landed("cudaStreamSynchronize after cudaMemcpy D2H");
}

absl::Status CopyToDevice(int device_id, const void* host_src, void* device_dst, size_t bytes) {
  if (absl::Status device = UseDevice(device_id); !device.ok()) return device;
  const cudaError_t error = cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyHostToDevice);
  if (error != cudaSuccess) return absl::InternalError(CudaErrorText("cudaMemcpy H2D", error));
  return Landed("cudaStreamSynchronize after cudaMemcpy H2D");
}

absl::StatusOr<void*> AllocateDevice(int device_id, size_t bytes) {
  if (absl::Status device = UseDevice(device_id); !device.ok()) return device;
  void* pointer = nullptr;
  const cudaError_t error = cudaMalloc(&pointer, bytes);
  if (error != cudaSuccess) {
    return absl::ResourceExhaustedError(CudaErrorText("cudaMalloc", error));
  }
  return pointer;
}

void FreeDevice(int device_id, void* device_ptr) {
  if (device_ptr == nullptr) return;
  cudaSetDevice(device_id);
  cudaFree(device_ptr);
}

absl::StatusOr<IpcExport> ExportIpcHandle(int device_id, void* device_ptr) {
  if (absl::Status device = UseDevice(device_id); !device.ok()) return device;
  absl::StatusOr<PFN_cuMemGetAddressRange_v3020> address_range = AddressRangeFunction();
  if (!address_range.ok()) return address_range.status();
  absl::StatusOr<AddressRange> range = RangeOf(*address_range, device_ptr);
  if (!range.ok()) return range.status();
  // The handle of the allocation's base (the driver documents base pointers only; PyTorch
  // exports the same way), with device_ptr's place in it as the offset.
  cudaIpcMemHandle_t handle;
  const cudaError_t error = cudaIpcGetMemHandle(&handle, range->base);
  if (error != cudaSuccess) return absl::InternalError(CudaErrorText("cudaIpcGetMemHandle", error));
  IpcExport exported;
  exported.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  exported.offset = static_cast<uint64_t>(static_cast<char*>(device_ptr) - range->base);
  exported.allocation_bytes = range->bytes;
  return exported;
}

}  // namespace cuda
}  // namespace kvt
