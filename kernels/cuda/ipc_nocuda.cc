// Fallback of kernels/cuda/ipc.h for builds without the CUDA toolkit.
#include "kernels/cuda/ipc.h"

#if !KVT_HAVE_CUDA
namespace kvt {
namespace cuda {
namespace {
absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "kvtd was built without CUDA: CUDA IPC regions are not available; use system shared "
      "memory or inline KV");
}
}  // namespace

absl::StatusOr<IpcMapping> OpenIpcHandle(const std::string&, int, uint64_t) { return NoCuda(); }
void CloseIpcHandle(const IpcMapping&) {}
absl::Status CopyToHost(int, const void*, void*, size_t) { return NoCuda(); }
absl::Status CopyToDevice(int, const void*, void*, size_t) { return NoCuda(); }
absl::StatusOr<void*> AllocateDevice(int, size_t) { return NoCuda(); }
void FreeDevice(int, void*) {}
absl::StatusOr<IpcExport> ExportIpcHandle(int, void*) { return NoCuda(); }

}  // namespace cuda
}  // namespace kvt
#endif
