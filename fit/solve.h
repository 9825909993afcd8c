// The closed-form side of `kvt fit` (SPEC 4.1-4.3): probe R^2 tables from the probe moments,
// top-k source selection, and per target layer the centred ridge by Cholesky with in-sample and
// held-out R^2, all from the additive statistics of stats.h.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fit/stats.h"
#include "mapper_store/format/manifest.h"

namespace kvt {
namespace fit {

// Head-averaged single-layer probe R^2 (SPEC 4.2), [j * L_t + l] for source layer j and target
// layer l, for K (RoPE-stripped) and V.
struct ProbeTables {
  int source_layers = 0;
  int target_layers = 0;
  std::vector<double> r2_k, r2_v;
  double score(int j, int l) const {
    return 0.5 * (r2_k[j * target_layers + l] + r2_v[j * target_layers + l]);
  }
};

// Head-averaged R^2 (SPEC 4.3) from per-column residual and total sums of squares: columns
// [offset + h d, offset + (h+1) d) are head h; heads with a zero total are left out (nullopt if
// all are). Shared by ridge and the MLP's held-out R^2.
std::optional<double> HeadAveragedR2(const std::vector<double>& sse, const std::vector<double>& sst,
                                     int64_t offset, int heads, int d);

// Probe ridge uses lambda = kProbeRidge x the mean diagonal of S_xx (SPEC 4.2: "tiny, for
// stability"). Warnings (constant target heads, ...) are appended to `warnings`.
inline constexpr double kProbeRidge = 1e-6;
// `head_local` (a per_head fit): unmatched shapes score each target head on its matching
// source heads only (the head-local map's probe); matched shapes always do.
absl::StatusOr<ProbeTables> SolveProbe(const FitShape& shape, const StatSet& probe,
                                       std::vector<std::string>* warnings,
                                       bool head_local = false);

// sigma(l): the k source layers with the highest score (R2_K + R2_V) / 2, ties to the lower
// index, in descending-score order. k <= 0 or k >= L_s: all source layers.
std::vector<std::vector<int>> SelectLayers(const ProbeTables& tables, int k);

struct RidgeOptions {
  double lambda = 0.01;
  LambdaScale scale = LambdaScale::kCovariance;
  // Head-local maps (manifest ridge.granularity per_head): target head h is fitted from its
  // matching source heads only (HeadSourceRows), on the sub-blocks of the same statistics.
  bool per_head = false;
  // per_head only: each head minimises its residuals weighted by the attention mass the
  // target's own queries give each token (CacheBridge; the "aw.*" arrays of stats.h) instead of
  // plain MSE.
  bool attention_weighted = false;
};

// INVALID_ARGUMENT naming --granularity=per_head unless one KV head count divides the other
// (the pairing is kernels/mapper_view.h's HeadLocalSources).
absl::Status CheckHeadMatching(const FitShape& shape);

// One target layer's maps, row-major float64 in the mapper's layout (rows: sigma's source layers
// in order, head-major inside; columns: target heads). A head-local fit keeps this dense layout
// with exact zeros outside each head's rows and columns (HeadSourceRows), so every consumer of
// a LayerFit (R^2, refinement, the held-out evaluation) reads it unchanged.
struct LayerFit {
  std::vector<double> w_k, b_k, w_v, b_v;
  std::optional<double> r2_k, r2_v, r2_k_heldout, r2_v_heldout;
};

// Solves target layer `l` for K and V from the "train.*" blocks of `final_stats` (and evaluates
// on "heldout.*" when it has tokens). Refuses, naming layer and kind, what would put NaN or
// meaningless weights in a mapper: lambda = 0 with a singular S_xx (constant features, fewer
// tokens than features, or numerically rank-deficient), non-finite results. Constant features
// (zero variance) get weight exactly 0 (DegenerateInputWarnings reports them).
absl::StatusOr<LayerFit> SolveLayer(const FitShape& shape, const StatSet& final_stats, int l,
                                    const std::vector<int>& sigma, const RidgeOptions& options);

// Sets fit's r2_* for its own weights (any W, b: a refined map need not be the least-squares
// one) from the same statistics SolveLayer reads: residual y - b - x W on both splits.
void EvaluateLayerR2(const FitShape& shape, const StatSet& final_stats, int l,
                     const std::vector<int>& sigma, LayerFit* fit);

// Warnings about the training data of a final StatSet, once per fit: constant source features
// (per source layer and kind), fewer training tokens than the largest design has features.
std::vector<std::string> DegenerateInputWarnings(const FitShape& shape, const StatSet& final_stats,
                                                 const std::vector<std::vector<int>>& sigma);

}  // namespace fit
}  // namespace kvt
