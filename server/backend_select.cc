#include "server/backend_select.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "kernels/cpu_backend.h"
#include "kernels/onednn_matmul.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"

namespace kvt {

void ExportSelfChecks(const std::vector<SelfCheckReport>& reports, Metrics* metrics) {
  for (const SelfCheckReport& report : reports) {
    metrics->SetBackendSelfCheck(report.backend, report.device, report.result());
  }
}

absl::StatusOr<SelectedBackend> SelectBackend(const KvtdConfig::Backend& config,
                                              const BackendFactories& factories) {
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
  std::unique_ptr<Backend> cpu =
      factories.new_cpu ? factories.new_cpu(cpu_options) : NewCpuBackend(cpu_options);
  // A broken BLAS / oneDNN dispatch would serve wrong caches: fatal in every mode.
  selected.self_checks.push_back(RunBackendSelfCheck(*cpu, nullptr));
  LogSelfCheck(selected.self_checks.back());
  if (!selected.self_checks.back().passed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the CPU backend failed its start-up self-check: ",
                     selected.self_checks.back().Summary()));
  }
  // The CPU engine's GEMM path is reported only when it is the one serving.
  const auto use_cpu = [&] {
    if (const auto* engine = dynamic_cast<const CpuBackend*>(cpu.get())) {
      selected.cpu_gemm_path = CpuGemmPathName(engine->gemm_path());
      selected.cpu_gemm_reason = engine->gemm_reason();
      selected.cpu_isa = OnednnIsaName();
    }
    selected.backend = std::move(cpu);
  };
  if (config.type == "cpu") {
    use_cpu();
    selected.reason = "backend.type=cpu";
    return selected;
  }
  const absl::StatusOr<int> devices =
      factories.device_count ? factories.device_count() : cuda::DeviceCount();
  CudaBackendOptions cuda_options;  // device 0; token chunk and workspace from the backend
  const auto new_cuda = [&]() {
    return factories.new_cuda ? factories.new_cuda(cuda_options) : NewCudaBackend(cuda_options);
  };
  if (config.type == "cuda") {
    // Forced: no silent fallback, the daemon must not start on the wrong engine.
    absl::StatusOr<std::unique_ptr<Backend>> cuda = new_cuda();
    if (!cuda.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "backend.type=cuda but the CUDA backend cannot start: ", cuda.status().message(),
          "; use backend.type=auto or cpu"));
    }
    selected.self_checks.push_back(RunBackendSelfCheck(**cuda, cpu.get()));
    LogSelfCheck(selected.self_checks.back());
    if (!selected.self_checks.back().passed()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "backend.type=cuda but the CUDA backend failed its start-up self-check: ",
          selected.self_checks.back().Summary(), "; use backend.type=auto or cpu"));
    }
    selected.backend = *std::move(cuda);
    selected.reason = absl::StrCat("backend.type=cuda (",
                                   devices.ok() ? absl::StrCat(*devices) : "?",
                                   " CUDA device(s)); self-check passed");
    return selected;
  }
  if (devices.ok()) {
    absl::StatusOr<std::unique_ptr<Backend>> cuda = new_cuda();
    if (cuda.ok()) {
      selected.self_checks.push_back(RunBackendSelfCheck(**cuda, cpu.get()));
      LogSelfCheck(selected.self_checks.back());
      if (selected.self_checks.back().passed()) {
        selected.backend = *std::move(cuda);
        selected.reason = absl::StrCat("auto: ", *devices, " CUDA device(s); using ",
                                       selected.backend->device(), " (self-check passed)");
        return selected;
      }
      selected.reason = absl::StrCat("auto: ", (*cuda)->device(),
                                     " failed its start-up self-check (",
                                     selected.self_checks.back().Summary(), "); using CPU");
      KVT_LOG(kWarning, "backend self-check failed, using CPU")
          .With("device", (*cuda)->device())
          .With("reason", selected.reason);
    } else {
      selected.reason = absl::StrCat("auto: CUDA device(s) present but the CUDA backend failed "
                                     "to start (", cuda.status().message(), "); using CPU");
    }
  } else {
    selected.reason = absl::StrCat("auto: no usable CUDA device (", devices.status().message(),
                                   "); using CPU");
  }
  use_cpu();
  return selected;
}

}  // namespace kvt
