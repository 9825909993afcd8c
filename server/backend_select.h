// Chooses the translation backend from `backend.type` (auto | cpu | cuda) and what the machine
// has, and says why, so the daemon can log and export the choice.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/config.h"

namespace kvt {

struct SelectedBackend {
  std::unique_ptr<Backend> backend;
  std::string reason;  // e.g. "auto: no CUDA device (cudaGetDeviceCount failed: ...)"
  // CPU backend only: the GEMM path of bf16 / fp16 mappers ("onednn_bf16" or "sgemm"), why,
  // and the ISA oneDNN dispatches; empty for CUDA.
  std::string cpu_gemm_path;
  std::string cpu_gemm_reason;
  std::string cpu_isa;
};

absl::StatusOr<SelectedBackend> SelectBackend(const KvtdConfig::Backend& config);

}  // namespace kvt
