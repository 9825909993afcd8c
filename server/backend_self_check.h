// kvtd's start-up self-check of a translation backend: before the daemon serves on an engine it
// translates a small synthetic mapper (ridge and MLP, bf16 and fp32; in memory, from
// mapper_store/synth.h) through that engine, exactly as a request would (BeginPrepare /
// PrepareLayer, then TranslateLayer per target layer in token chunks), and compares the output
// with the float64 reference of SPEC 3 (kernels/reference.h) and, for a device backend, with the
// CPU backend's output of the same translation. Tolerances are SPEC 3's: max relative error
// (MaxRelError) <= 1e-5 for fp32 outputs and <= 1e-2 for bf16 against float64; twice that
// against the CPU backend (both sit within the tolerance of the reference).
//
// Any backend error (a CUDA / cuBLAS failure comes back as a Status naming the call), NaN or
// mismatch fails the check; server/backend_select.h decides what a failure means (auto: fall
// back to CPU; forced cuda: refuse to start; cpu: refuse to start). docs/OPERATIONS.md.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"

namespace kvt {

// One translation of the check: a mapper kind and the dtype of its weights, cache and output.
struct SelfCheckCase {
  MapKind kind = MapKind::kRidge;
  DType dtype = DType::kFP32;
  std::string name() const;  // "ridge/fp32", "mlp/bf16"
};

// The four cases kvtd runs: ridge and MLP, each in fp32 and bf16.
std::vector<SelfCheckCase> DefaultSelfCheckCases();

struct SelfCheckCaseResult {
  SelfCheckCase test;
  // The backend's (or the check's own) error; OK when the translation ran.
  absl::Status status;
  // Max over every target layer, K and V, of MaxRelError against the float64 reference, and
  // against the CPU backend (unset when no CPU backend was given). Infinity on NaN output.
  double error_vs_reference = 0;
  std::optional<double> error_vs_cpu;
  double tolerance = 0;      // SPEC 3 for the output dtype, against the reference
  double cpu_tolerance = 0;  // 2 * tolerance, against the CPU backend
  double seconds = 0;

  bool passed() const;
  // "ridge/fp32 ok (max rel. error 3.66e-07 vs float64; tolerance 1.00e-05)", or what failed:
  // "mlp/bf16: max relative error 3.10e-02 vs the float64 reference exceeds the SPEC 3
  // tolerance 1.00e-02", "ridge/fp32: INTERNAL: TranslateLayer(0): cublas...".
  std::string Describe() const;
};

struct SelfCheckReport {
  std::string backend;  // Backend::name(): "cpu", "cuda"
  std::string device;   // Backend::device(): "cpu", "cuda:0"
  std::vector<SelfCheckCaseResult> cases;
  double seconds = 0;  // the whole check, preparation included

  bool passed() const;
  // The metric label: "pass", "error" (some case could not run), or "mismatch".
  std::string result() const;
  // One line: "cuda:0 self-check passed: 4 cases in 3.2 ms (<every case's Describe()>)" or
  // "cuda:0 self-check failed: 4 cases in 3.2 ms (<every failing case's Describe()>)".
  std::string Summary() const;
};

// Runs `cases` through `backend` and compares as described above; `cpu` (may be null, and must
// not be `backend`) is the CPU backend to compare a device backend with. Never crashes on a
// backend error: every failure is in the report. About 7 ms of CPU time on the CPU backend.
SelfCheckReport RunBackendSelfCheck(Backend& backend, Backend* cpu,
                                    const std::vector<SelfCheckCase>& cases =
                                        DefaultSelfCheckCases());

// Logs one self-check: info "backend self-check passed" or warning "backend self-check
// failed", with backend, device, result, ms and the summary.
void LogSelfCheck(const SelfCheckReport& report);

}  // namespace kvt
