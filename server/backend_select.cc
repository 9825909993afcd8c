#include "server/backend_select.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/device.h"

namespace kvt {

absl::StatusOr<SelectedBackend> SelectBackend(const KvtdConfig::Backend& config) {
  SelectedBackend selected;
  CpuBackendOptions cpu_options;
  cpu_options.num_threads = static_cast<int>(config.cpu_threads);
  cpu_options.token_chunk = config.token_chunk;
  const absl::StatusOr<int> devices = cuda::DeviceCount();
  if (config.type == "cuda") {
    // The CUDA translation backend is not part of this build yet; never pretend.
    return absl::FailedPreconditionError(absl::StrCat(
        "backend.type=cuda: this build has no CUDA translation backend (devices: ",
        devices.ok() ? absl::StrCat(*devices) : std::string(devices.status().message()),
        "); use backend.type=auto or cpu"));
  }
  selected.backend = NewCpuBackend(cpu_options);
  if (config.type == "cpu") {
    selected.reason = "backend.type=cpu";
  } else if (devices.ok()) {
    selected.reason = absl::StrCat("auto: ", *devices,
                                   " CUDA device(s) present but no CUDA translation backend in "
                                   "this build; using CPU");
  } else {
    selected.reason = absl::StrCat("auto: no usable CUDA device (", devices.status().message(),
                                   "); using CPU");
  }
  return selected;
}

}  // namespace kvt
