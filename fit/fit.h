// `kvt fit` end to end: calibration dumps -> probe statistics -> plan (probe R^2, top-k sigma) ->
// Gram / cross-covariance statistics -> ridge solve -> mapper directory + HTML report. Every
// phase's statistics can be written as a shard and summed (`--partial`, `merge`). `--kind mlp`
// trains the MLP chains on the same features and sigma; `--kind both` fits both and recommends one
// from the held-out attention-output cosine.
#pragma once

#include <cstdint>
#include <cstdio>
#include <array>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fit/calibration.h"
#include "fit/mlp.h"
#include "fit/solve.h"
#include "fit/stats.h"
#include "kernels/mapper_view.h"
#include "mapper_store/format/manifest.h"

namespace kvt {
namespace fit {

inline constexpr char kFitToolVersion[] = "kvt fit 0.1";
inline constexpr char kReportFileName[] = "report.html";

// A model as `kvt fit` knows it: the spec, and the config.json text it came from, which shard
// files carry so that `merge` needs no config paths.
struct FitModel {
  ModelSpec spec;
  std::string config_json;
};
// `path`: a config.json or a directory holding one. `name`: the mapper's model name (empty: the
// file's _name_or_path).
absl::StatusOr<FitModel> LoadFitModel(const std::string& path, const std::string& name);
absl::StatusOr<FitModel> FitModelFromJson(const std::string& json, const std::string& name,
                                          const std::string& label);

// How statistics become a mapper (also all `merge` needs).
struct SolveOptions {
  RidgeOptions ridge;
  DType weight_dtype = DType::kBF16;
  bool overwrite = false;  // replace an existing mapper directory
  // A progress bar (terminal) or log lines on `log` for every pass and the solve.
  bool show_progress = true;
  FILE* log = stderr;
};

enum class FitKind { kRidge, kMlp, kBoth };

// `kvt fit --kind mlp|both`: the chain's training and its layout.
struct MlpFitOptions {
  MlpOptions train;  // hidden, epochs, batch, lr, seed, max observations
  MlpGranularity granularity = MlpGranularity::kPerLayer;
};

// `kvt fit --refine=attention` (fit/refine.h): Adam from the closed-form ridge (or the
// MSE-trained MLP) on the error of the target's attention outputs under its own queries.
struct RefineOptions {
  bool attention = false;
  int steps = 100;
  int batch = 2;    // sequences per step
  int queries = 16;  // query tokens per sequence and step (a seeded sample); <= 0: every token
  // The queries: after a seeded handoff boundary per sequence and step (uniform in the second
  // half), reading the mapped keys and values before it and the target's own from it on, as
  // the target does after a real handoff; false: queries inside the mapped prefix, reading
  // mapped keys only (blind to a shift of every mapped score; docs/FIT.md compares the two).
  bool handoff = true;
  // Training sequences kept in memory after their first read, up to this many bytes (the rest
  // is read from disk each time it comes up): a bound, so a large model's set still streams.
  int64_t cache_bytes = int64_t{1} << 30;
  // Keep the start (closed-form ridge, MSE-trained MLP) when the objective does not fall on
  // the held-out sequences; false: keep the refined maps regardless (tests of the mechanics).
  bool keep_start_unless_better = true;
  double learning_rate = 0.003;  // relative: times each tensor's RMS at the start (docs/FIT.md)
  // The MLP's budget: steps, sequences per step, queries and step size of its own. A chain's
  // output moves with every hidden unit, so a step of the ridge's size overshoots; and the MLP
  // is dearer to train than the ridge is to solve, so more steps stay inside the same multiple
  // of its fit's wall time. Both measured on the bundled family (docs/FIT.md).
  int mlp_steps = 300;
  int mlp_batch = 4;
  int mlp_queries = 64;
  double mlp_learning_rate = 0.001;  // relative likewise
  uint64_t seed = 1;
  // Kind mlp or both: also write the MSE-trained MLP as it was before refinement to this mapper
  // directory (the same training: no second one); empty: not written.
  std::string unrefined_mlp_out;

  // These options with the MLP's budget in steps, batch, queries and learning_rate (what the
  // refinement loop reads), for the MLP's chains.
  RefineOptions ForMlp() const {
    RefineOptions mlp = *this;
    mlp.steps = mlp_steps;
    mlp.batch = mlp_batch;
    mlp.queries = mlp_queries;
    mlp.learning_rate = mlp_learning_rate;
    return mlp;
  }
};

// INVALID_ARGUMENT naming the flag when a budget (either kind's) is out of range (refine.cc).
absl::Status ValidateRefineOptions(const RefineOptions& options);

struct FitOptions {
  FitModel source, target;
  FitKind kind = FitKind::kRidge;
  MlpFitOptions mlp;
  RefineOptions refine;  // of every kind fitted (--kind both: the ridge and the MLP)
  // The calibration set (of this shard, for --partial), held-out marks already assigned.
  std::vector<SequencePair> sequences;
  int stride = 4;
  int k = 8;  // source layers per target layer; <= 0: all
  // Tokens each output token reads (manifest `window`; 1: SPEC 3's token-wise map): the k
  // chosen source layers at p, p-1, ..., p-window+1 (docs/FIT.md, "Window mappers").
  int window = 1;
  // The ridge's granularity is solve.ridge.per_head; this fits both (RunFitGranularityBoth).
  bool granularity_both = false;
  // `--per_head_probe=head_local`: a per_head fit of unmatched KV shapes ranks source layers by
  // the head-local probe (MakePlan) instead of the full-layer one (docs/FIT.md: worse on 3 of
  // the 4 U pairs, so not the default).
  bool head_local_probe = false;
  SolveOptions solve;
  double heldout_fraction = 0.1;  // recorded: the marks are in `sequences`
  HeldoutSplit heldout_split = HeldoutSplit::kHash;  // recorded
  uint64_t seed = 1;              // recorded
  std::string corpus;             // recorded as calibration.dataset
  // OpenBLAS threads for accumulation and solve; 0: every core. Set explicitly because a
  // CpuBackend in the same process sets it to 1 process-wide.
  int num_threads = 0;
  // Feature rows buffered per round of BLAS calls (bigger: fewer, more efficient calls).
  int64_t chunk_bytes = int64_t{256} << 20;
};

// Held-out quality of one fitted mapper as kvtd serves it (the written weight bytes through the
// CPU backend, the result in the target dump's dtype), against the target's own cache, with the
// target's post-RoPE queries from the dumps (SPEC 5): means over held-out sequences (those with
// queries) of the per-sequence layer means; per target layer, the mean over the same sequences.
// Fewer held-out sequences than this and `kvt fit` warns that the held-out figures cannot
// support kvtd's quality gate (docs/FIT.md, "Held-out quality and the gate", says how the number
// was chosen).
inline constexpr int kMinHeldoutSequences = 16;

struct HeldoutQuality {
  int sequences = 0;
  int64_t tokens = 0;
  double attention_cosine = 0, attention_cosine_without_layer0 = 0;  // without: all if 1 layer
  double c_k = 0, c_v = 0;
  double r2_k = 0, r2_v = 0;  // SPEC 5 R^2 of the same tokens (content-space K)
  std::vector<double> layer_attention_cosine;  // per target layer
  // attention_cosine_without_layer0 of each held-out sequence, and the one-sided 95% lower
  // bound of their mean (quality/mean_interval.h; absent with fewer than two sequences).
  std::vector<double> sequence_attention_cosine;
  std::optional<double> attention_cosine_lower95;
  // quality/kv_quality.h KvCosineOverLayers, averaged over the held-out sequences: the figure
  // kvtd's live verification compares its samples with (quality.kv_cosine_heldout).
  double kv_cosine = 0;
  double seconds = 0;  // wall time of the evaluation
};

// What `--refine=attention` ran for one mapper, for fit_report.json (the report.html facts
// say the same in prose): the budget as run (the MLP's: RefineOptions::ForMlp()), the wall time
// of the steps, and whether the held-out objective fell (else the start was kept).
struct RefinementSummary {
  int steps = 0;
  int batch = 0;
  int queries = 0;  // <= 0: every token
  double learning_rate = 0;
  bool handoff = true;
  double seconds = 0;
  bool kept_start = false;
  std::optional<double> heldout_before, heldout_after;
};

struct FitResult {
  std::string mapper_dir;
  std::string report_path;
  Manifest manifest;
  ProbeTables probe;
  std::vector<std::string> warnings;
  // Set when the fit had held-out sequences with target queries (then also recorded in the
  // manifest: layers[l].attention_cosine_heldout and quality.*).
  std::optional<HeldoutQuality> heldout;
  // Set when the mapper went through --refine=attention.
  std::optional<RefinementSummary> refinement;
};

// Sets OpenBLAS to `num_threads` (0: every core).
void SetBlasThreads(int num_threads);

// Pass 1 over the training sequences: probe statistics (phase "probe").
absl::StatusOr<StatSet> AccumulateProbe(const FitOptions& options);
// Probe R^2 tables from (summed) probe statistics: phase "plan", arrays plan.r2_k/plan.r2_v.
// `head_local` (--per_head_probe=head_local): unmatched KV shapes are probed head-locally
// (SolveProbe), the plan's metadata says so and the report names it.
absl::StatusOr<StatSet> MakePlan(const StatSet& probe, std::vector<std::string>* warnings,
                                 bool head_local = false);
// Pass 2 over all sequences: the blocks that sigma (top-k of the plan's scores) needs, training
// and held-out apart (phase "final"; carries the plan's tables).
absl::StatusOr<StatSet> AccumulateFinal(const FitOptions& options, const StatSet& plan);
// Solves every target layer from (summed) final statistics and writes `out_dir` (mapper format,
// with stats.source.* tensors) and its report.html. `warnings` seeds the report's list.
// `heldout` (optional: `merge` has no sequences): the run whose held-out sequences, when their
// target dumps carry queries, measure the written mapper (MeasureHeldout) before it is written,
// recording the attention-output cosine per layer and in the manifest's `quality` map.
absl::StatusOr<FitResult> SolveAndWrite(const StatSet& final_stats, const SolveOptions& options,
                                        const std::string& out_dir,
                                        std::vector<std::string> warnings = {},
                                        const FitOptions* heldout = nullptr);

// The single run: probe, plan, final, solve. `plan` (optional) skips the probe pass.
absl::StatusOr<FitResult> RunFit(const FitOptions& options, const std::string& out_dir,
                                 const StatSet* plan = nullptr);

// The held-out quality of `mapper` (a fitted mapper's view) on `options.sequences` marked held
// out whose target dumps have queries, one sequence at a time. FAILED_PRECONDITION when none has.
absl::StatusOr<HeldoutQuality> MeasureHeldout(const FitOptions& options, const MapperView& mapper);
// Whether any held-out target dump of `options` has queries (errors: a malformed one).
absl::StatusOr<bool> HeldoutHasQueries(const FitOptions& options);

// `--kind both`: `out_dir`/ridge and `out_dir`/mlp, and `out_dir`/fit_report.json with both
// kinds' held-out figures and the choice (higher held-out attention-output cosine; ridge on a
// tie within 1e-4, as the cheaper map). With refine.attention both are refined and the choice is
// between the refined mappers; refine.unrefined_mlp_out adds the MLP's MSE-trained start (its
// figures in the report as "mlp_unrefined", not a candidate). Needs target queries (dump_kv.py
// --queries) in at least one held-out sequence: checked before any training
// (FAILED_PRECONDITION naming the fix).
struct BothResult {
  FitResult ridge, mlp;
  HeldoutQuality ridge_quality, mlp_quality;
  std::optional<FitResult> mlp_unrefined;  // when refine.unrefined_mlp_out is set
  std::string recommended;  // "ridge" or "mlp"
  std::string report_json_path;
};
absl::StatusOr<BothResult> RunFitBoth(const FitOptions& options, const std::string& out_dir,
                                      const StatSet* plan = nullptr);
inline constexpr char kCompareFileName[] = "fit_report.json";

// `kvt fit --granularity both`: the ridge at both granularities from one probe and fit pass
// (the same sigma), `out_dir`/per_layer and `out_dir`/per_head, each measured as served on the
// held-out sequences, and `out_dir`/fit_report.json with both and the choice. per_head (n_t
// times fewer bytes and FLOPs when n_s = n_t) is recommended unless per_layer is better beyond
// noise: the one-sided 95% lower bound of the paired per-sequence difference (per_layer minus
// per_head, held-out attention-output cosine without layer 0: the figure kvtd gates on) is
// above 0; with fewer than 2 held-out sequences, the higher mean (per_head on a tie within
// 1e-4). Preconditions as RunFitBoth's (FAILED_PRECONDITION naming the fix).
struct GranularityResult {
  FitResult per_layer, per_head;
  // Wall time of each solve, refinement, held-out measurement and write (the statistics'
  // passes are shared).
  double per_layer_seconds = 0, per_head_seconds = 0;
  // per_head minus per_layer over the held-out sequences, with its lower bound (n >= 2) and
  // the upper bound -(lower bound of per_layer minus per_head).
  double difference = 0;
  std::optional<double> difference_lower95, difference_upper95;
  std::string recommended;  // "per_layer" or "per_head"
  std::string report_json_path;
};
absl::StatusOr<GranularityResult> RunFitGranularityBoth(const FitOptions& options,
                                                        const std::string& out_dir,
                                                        const StatSet* plan = nullptr);

// Sums shard files (every one the same phase, models, stride and split; disjoint sequences).
absl::StatusOr<StatSet> MergeStatFiles(const std::vector<std::string>& paths);

}  // namespace fit
}  // namespace kvt
