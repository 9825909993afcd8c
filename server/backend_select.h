// Chooses the translation backend from `backend.type` (auto | cpu | cuda) and what the machine
// has, runs the start-up self-check (server/backend_self_check.h) on what it chooses, and says
// why, so the daemon can log and export the choice.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "server/backend_self_check.h"
#include "server/config.h"
#include "server/metrics.h"

namespace kvt {

struct SelectedBackend {
  std::unique_ptr<Backend> backend;
  std::string reason;  // e.g. "auto: no CUDA device (cudaGetDeviceCount failed: ...)"
  // Every self-check that ran, in order: the CPU backend's always, then the CUDA backend's when
  // one was tried (a failed one too, when auto fell back to CPU).
  std::vector<SelfCheckReport> self_checks;
  // CPU backend only: the GEMM path of bf16 / fp16 mappers ("onednn_bf16" or "sgemm"), why,
  // and the ISA oneDNN dispatches; empty for CUDA.
  std::string cpu_gemm_path;
  std::string cpu_fp32_gemm_path;  // the engine of fp32 mappers ("onednn_f32" or "sgemm")
  std::string cpu_gemm_reason;
  std::string cpu_isa;
  // What `cpu_gemm: auto` measured; nullopt when the path was forced or on CUDA.
  std::optional<GemmProbeResult> cpu_gemm_probe;
};

// How SelectBackend finds and builds engines; empty members mean the real ones
// (cuda::DeviceCount, NewCudaBackend, NewCpuBackend). Tests substitute faulty engines.
struct BackendFactories {
  std::function<absl::StatusOr<int>()> device_count;
  std::function<absl::StatusOr<std::unique_ptr<Backend>>(const CudaBackendOptions&)> new_cuda;
  std::function<std::unique_ptr<Backend>(const CpuBackendOptions&)> new_cpu;
};

// The CPU backend is built and self-checked first in every mode (it is the fallback and the
// comparison for a device): its failure is an error (FAILED_PRECONDITION "the CPU backend
// failed its start-up self-check: ..."). Then by backend.type:
//   cpu:  the CPU backend.
//   cuda: the CUDA backend on GPU 0, self-checked against the CPU backend and float64; an
//         engine that cannot start or fails the check is FAILED_PRECONDITION naming the case
//         (kind/dtype, max error vs tolerance) or the CUDA error. Never a silent fallback.
//   auto: CUDA when a device is usable and the backend starts and passes its self-check, else
//         CPU; a failed self-check is logged as a warning ("backend self-check failed, using
//         CPU") and kept in self_checks for the metric.
// Every self-check is logged (info when it passes, with its time).
// `served_shapes`: the GEMM shapes of the mappers kvtd will serve (ServedGemmShapes), on which
// `cpu_gemm: auto` times its engines; empty: a Qwen3-class default. In auto, a GEMM path that
// fails the self-check gives way to the other one (with a warning) before the CPU counts as
// failed.
absl::StatusOr<SelectedBackend> SelectBackend(const KvtdConfig::Backend& config,
                                              const BackendFactories& factories = {},
                                              const std::vector<GemmShape>& served_shapes = {});

// The GEMM shapes (mapper_store MapperGemmShapes) of every mapper directory under `store_path`
// whose manifest parses; unreadable ones are skipped (the store reports them when it opens).
std::vector<GemmShape> ServedGemmShapes(const std::string& store_path);

// kvt_backend_self_check{backend, device, result} = 1 for every report (see Metrics).
void ExportSelfChecks(const std::vector<SelfCheckReport>& reports, Metrics* metrics);

}  // namespace kvt
