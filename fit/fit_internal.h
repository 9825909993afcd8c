// Internals of fit.cc that the MLP and comparison paths (fit_mlp.cc) share; not the fit API.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "fit/fit.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"

namespace kvt {
namespace fit {

// Reads the sequences in order into feature-row buffers (training, held-out unless
// `training_only`), handing a buffer to `consume` every chunk and at the end; logs each sequence.
absl::Status StreamSequences(const FitOptions& options, const FitShape& shape,
                             const std::string& what, bool training_only,
                             const std::function<void(const FeatureRows&, bool)>& consume,
                             nlohmann::json* log);

// Final statistics, read back: shapes, the probe tables and sigma.
struct ParsedFinal {
  FitShape shape;
  ProbeTables tables;
  std::vector<std::vector<int>> sigma;
};
absl::StatusOr<ParsedFinal> ParseFinal(const StatSet& stats);

// The manifest fields every kind shares (models, k, dtype, tool); ridge also gets lambda.
Manifest BaseManifest(const ParsedFinal& parsed, const SolveOptions& options, MapperKind kind);

// float64 -> `dtype` bytes, and -> the float32 values those bytes hold (what kvtd serves).
std::vector<uint8_t> ToBytes(const std::vector<double>& values, DType dtype);
std::vector<float> RoundTrip(const std::vector<double>& values, DType dtype);

// Writes `out_dir` from a manifest whose layers are filled and the mapping tensors' bytes in
// MapperTensorSpecs order: adds the stats.source.* tensors and the calibration map from `stats`,
// writes the mapper and report.html. `kind_facts` extend the report's calibration facts.
// `heldout` (optional): measure the mapper on its held-out sequences first and record it.
absl::StatusOr<FitResult> WriteFitted(const StatSet& stats, const ParsedFinal& parsed,
                                      Manifest manifest,
                                      std::vector<std::vector<uint8_t>> storage,
                                      const SolveOptions& options, const std::string& out_dir,
                                      std::vector<std::string> warnings,
                                      const std::vector<std::pair<std::string, std::string>>&
                                          kind_facts,
                                      const FitOptions* heldout);

// A ridge manifest's layers (sigma, R^2) and its mapping tensors' bytes, in MapperTensorSpecs
// order, from per-layer fits (head-local ones, manifest ridge_granularity per_head, stored
// compact: HeadLocalWeights).
std::vector<std::vector<uint8_t>> RidgeStorage(const std::vector<std::vector<int>>& sigma,
                                               const std::vector<LayerFit>& fits, DType dtype,
                                               Manifest* manifest);

// `--refine=attention` on solved ridge fits (fit/refine.cc): measures the closed-form mapper as
// served on the held-out sequences (when they have queries), refines `fits` in place (head-local
// ones with `per_head`, keeping their zeros), recomputes their R^2 from `stats`, and returns the
// report facts (and, when `summary` is set, what ran).
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> RefineLayers(
    const FitOptions& options, const StatSet& stats, const ParsedFinal& parsed,
    const Manifest& manifest, DType dtype, std::vector<LayerFit>* fits, bool per_head,
    RefinementSummary* summary = nullptr);

// The held-out quality (MeasureHeldout) of a mapper in memory: `manifest` with its layers, the
// mapping tensors' bytes in MapperTensorSpecs order; nullopt when no held-out target dump has
// queries. Logs it as `what`'s when progress is shown. The refinement's "before".
absl::StatusOr<std::optional<HeldoutQuality>> MeasureInMemory(
    const FitOptions& options, const Manifest& manifest,
    const std::vector<std::vector<uint8_t>>& storage, const std::string& what);

// The MapperView of a manifest and its tensors in memory, built as LoadMapperDir builds it from
// the written file (the same bytes): what the held-out evaluation serves.
absl::StatusOr<MapperView> MapperViewOf(const Manifest& manifest,
                                        const std::vector<TensorRef>& tensors);

// One mapper's held-out figures for a comparison's fit_report.json (`--kind both`,
// `--granularity both`): cosines, c_K, c_V, R^2, the mapper path and any refinement.
nlohmann::json QualityJson(const HeldoutQuality& q, const FitResult& fit);

// What a comparison needs before any work (`what` names it: "--kind both"): held-out sequences,
// target queries in one of them, and none of `subdirs` under `out_dir` unless overwriting;
// creates `out_dir`.
absl::Status CheckComparable(const FitOptions& options, const std::string& out_dir,
                             const std::string& what, const std::vector<std::string>& subdirs);

// `plan` when set, else the probe pass and the plan from it.
absl::StatusOr<StatSet> PlanOrProbe(const FitOptions& options, const StatSet* plan,
                                    std::vector<std::string>* warnings);

// The MLP mapper from final statistics (sigma, split, calibration facts) and a third pass over
// the sequences that keeps the feature rows in memory for training; with
// options.refine.attention, refined on the attention-output error (fit/refine.h) from the
// MSE-trained chains, which are also written to options.refine.unrefined_mlp_out when set (their
// FitResult into `unrefined`, optional).
absl::StatusOr<FitResult> TrainAndWriteMlp(const FitOptions& options, const StatSet& final_stats,
                                           const std::string& out_dir,
                                           std::vector<std::string> warnings,
                                           FitResult* unrefined = nullptr);

}  // namespace fit
}  // namespace kvt
