#include "server/backend_select.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "kernels/cpu_backend.h"
#include "kernels/onednn_matmul.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "mapper_store/format/manifest.h"
#include "mapper_store/mapper.h"

namespace kvt {

void ExportSelfChecks(const std::vector<SelfCheckReport>& reports, Metrics* metrics) {
  for (const SelfCheckReport& report : reports) {
    metrics->SetBackendSelfCheck(report.backend, report.device, report.result());
  }
}

std::vector<GemmShape> ServedGemmShapes(const std::string& store_path) {
  std::vector<GemmShape> shapes;
  absl::StatusOr<std::vector<std::string>> dirs = ListSubdirectories(store_path);
  if (!dirs.ok()) return shapes;
  for (const std::string& dir : *dirs) {
    absl::StatusOr<Manifest> manifest =
        ReadManifestFile(JoinPath(JoinPath(store_path, dir), kManifestFileName));
    if (!manifest.ok()) continue;
    for (const GemmShape& shape : MapperGemmShapes(*manifest)) {
      if (std::find(shapes.begin(), shapes.end(), shape) == shapes.end()) shapes.push_back(shape);
    }
  }
  return shapes;
}

namespace {

// The CPU engine, self-checked. When auto's measured GEMM path fails the check, the engine is
// rebuilt on sgemm, the exact path: a path that computes wrong values must never serve,
// however fast it measured.
absl::StatusOr<std::unique_ptr<Backend>> CheckedCpuBackend(CpuBackendOptions options,
                                                           const BackendFactories& factories,
                                                           SelectedBackend* selected) {
  const auto build_and_check = [&] {
    std::unique_ptr<Backend> cpu =
        factories.new_cpu ? factories.new_cpu(options) : NewCpuBackend(options);
    selected->self_checks.push_back(RunBackendSelfCheck(*cpu, nullptr));
    LogSelfCheck(selected->self_checks.back());
    return cpu;
  };
  std::unique_ptr<Backend> cpu = build_and_check();
  if (!selected->self_checks.back().passed() && options.gemm_path == CpuGemmPath::kAuto) {
    KVT_LOG(kWarning, "the measured cpu_gemm path failed its self-check, trying sgemm")
        .With("self_check", selected->self_checks.back().Summary());
    options.gemm_path = CpuGemmPath::kSgemm;
    cpu = build_and_check();
  }
  // A broken BLAS / oneDNN dispatch would serve wrong caches: fatal in every mode.
  if (!selected->self_checks.back().passed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the CPU backend failed its start-up self-check: ",
                     selected->self_checks.back().Summary()));
  }
  return cpu;
}

}  // namespace

absl::StatusOr<SelectedBackend> SelectBackend(const KvtdConfig::Backend& config,
                                              const BackendFactories& factories,
                                              const std::vector<GemmShape>& served_shapes) {
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
        "backend.cpu_gemm='", config.cpu_gemm, "' is not one of auto, bf16, fp32, onednn_f32"));
  }
  cpu_options.gemm_path = *gemm_path;
  cpu_options.probe_shapes = served_shapes;
  absl::StatusOr<std::unique_ptr<Backend>> checked =
      CheckedCpuBackend(cpu_options, factories, &selected);
  if (!checked.ok()) return checked.status();
  std::unique_ptr<Backend> cpu = *std::move(checked);
  // The CPU engine's GEMM path is reported only when it is the one serving.
  const auto use_cpu = [&] {
    if (const auto* engine = dynamic_cast<const CpuBackend*>(cpu.get())) {
      selected.cpu_gemm_path = CpuGemmPathName(engine->gemm_path());
      selected.cpu_fp32_gemm_path = CpuGemmPathName(engine->fp32_gemm_path());
      selected.cpu_gemm_reason = engine->gemm_reason();
      selected.cpu_isa = OnednnIsaName();
      selected.cpu_gemm_probe = engine->gemm_probe();
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
