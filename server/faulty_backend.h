// Test support: a Backend that wraps a working one and misbehaves on purpose, to prove what
// kvtd does when an engine fails its start-up self-check (server/backend_self_check.h).
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/types.h"

namespace kvt {
namespace testing {

enum class Fault {
  kNone,
  // TranslateLayer returns INTERNAL with `error_message` (e.g. a CUDA error).
  kTranslateError,
  // BeginPrepare returns RESOURCE_EXHAUSTED with `error_message`.
  kPrepareError,
  // Adds `offset` to element 0 of every target layer's K it writes: a wrong kernel that still
  // returns OK.
  kPerturb,
};

struct FaultyBackendOptions {
  Fault fault = Fault::kNone;
  std::string name = "cuda";      // what name() / device() report
  std::string device = "cuda:0";
  std::string error_message = "injected: cudaErrorIllegalAddress (an illegal memory access)";
  double offset = 0.5;
};

std::unique_ptr<Backend> NewFaultyBackend(std::unique_ptr<Backend> inner,
                                          const FaultyBackendOptions& options);

}  // namespace testing
}  // namespace kvt
