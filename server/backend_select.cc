#include "server/backend_select.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu_backend.h"
#include "kernels/onednn_matmul.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"

namespace kvt {

absl::StatusOr<SelectedBackend> SelectBackend(const KvtdConfig::Backend& config) {
  if (config.type != "auto" && config.type != "cpu" && config.type != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend.type='", config.type, "' is not one of auto, cpu, cuda"));
  }
  SelectedBackend selected;
  CpuBackendOptions cpu_options;
  cpu_options.num_threads = static_cast<int>(config.cpu_threads);
  cpu_options.token_chunk = config.token_chunk;
  absl::StatusOr<CpuGemmPath> gemm_path = ParseCpuGemmPath(config.cpu_gemm);
  if (!gemm_path.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend.cpu_gemm='", config.cpu_gemm, "' is not one of auto, bf16, fp32"));
  }
  cpu_options.gemm_path = *gemm_path;
  const auto use_cpu = [&] {
    auto cpu = std::make_unique<CpuBackend>(cpu_options);
    selected.cpu_gemm_path = CpuGemmPathName(cpu->gemm_path());
    selected.cpu_gemm_reason = cpu->gemm_reason();
    selected.cpu_isa = OnednnIsaName();
    selected.backend = std::move(cpu);
  };
  if (config.type == "cpu") {
    use_cpu();
    selected.reason = "backend.type=cpu";
    return selected;
  }
  const absl::StatusOr<int> devices = cuda::DeviceCount();
  CudaBackendOptions cuda_options;  // device 0; token chunk and workspace from the backend
  if (config.type == "cuda") {
    // Forced: no silent fallback, the daemon must not start on the wrong engine.
    absl::StatusOr<std::unique_ptr<Backend>> cuda = NewCudaBackend(cuda_options);
    if (!cuda.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "backend.type=cuda but the CUDA backend cannot start: ", cuda.status().message(),
          "; use backend.type=auto or cpu"));
    }
    selected.backend = *std::move(cuda);
    selected.reason = absl::StrCat("backend.type=cuda (", *devices, " CUDA device(s))");
    return selected;
  }
  if (devices.ok()) {
    absl::StatusOr<std::unique_ptr<Backend>> cuda = NewCudaBackend(cuda_options);
    if (cuda.ok()) {
      selected.backend = *std::move(cuda);
      selected.reason =
          absl::StrCat("auto: ", *devices, " CUDA device(s); using ", selected.backend->device());
      return selected;
    }
    selected.reason = absl::StrCat("auto: CUDA device(s) present but the CUDA backend failed to "
                                   "start (", cuda.status().message(), "); using CPU");
  } else {
    selected.reason = absl::StrCat("auto: no usable CUDA device (", devices.status().message(),
                                   "); using CPU");
  }
  use_cpu();
  return selected;
}

}  // namespace kvt
