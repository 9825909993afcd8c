// The additive float64 statistics of `kvt fit` (SPEC 4.1, 4.2, 4.4): per-head probe moments,
// the Gram and cross-covariance blocks of the chosen layers, their streaming accumulation through
// BLAS, and the shard file that `kvt fit --partial` writes and `kvt fit merge` sums.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fit/calibration.h"
#include "kernels/mapper_view.h"

namespace kvt {
namespace fit {

// Named float64 arrays plus string metadata. Everything in a StatSet is a plain sum over
// calibration tokens (so shards add up to the whole), except arrays named "plan.*", which are
// results carried along (the probe's R^2 tables) and must be equal in every shard.
struct StatSet {
  std::map<std::string, std::vector<double>> arrays;
  std::map<std::string, std::string> metadata;

  std::vector<double>& at(const std::string& name) { return arrays.at(name); }
  const std::vector<double>& at(const std::string& name) const { return arrays.at(name); }

  // this += other. The two must hold the same arrays with the same sizes and equal metadata,
  // except "sequences" (which must be disjoint: a sequence counted twice is an error naming it)
  // and "shard". Errors name `label` and the array or key that differs.
  absl::Status Add(const StatSet& other, const std::string& label);
};

// Writes a shard file. The safetensors reader of the mapper store takes only BF16/F16/F32, so
// each float64 is stored bit for bit as two F32 words (shape [count, 2]) and metadata
// "kvt_fit_stats" marks the encoding; the numbers round-trip exactly.
absl::Status WriteStatSet(const std::string& path, const StatSet& stats);
absl::StatusOr<StatSet> ReadStatSet(const std::string& path);

// Shapes of a fit: both models, whether the probe matches heads (SPEC 4.2: n_s = n_t and
// d_s = d_t) or regresses each target head on the whole source layer.
struct FitShape {
  ModelSpec source, target;
  // A window mapper's fit (manifest `window`): source layer j at token t - o is the source block
  // o * L_s + j, so the final statistics, solver and trainers see source_blocks() columns blocks
  // and sigma lists of blocks (WindowBlocks). The probe always runs with window 1.
  int window = 1;
  int64_t source_blocks() const { return int64_t{source.num_layers} * window; }
  int64_t ds() const { return int64_t{source.num_kv_heads} * source.head_dim; }  // n_s d_s
  int64_t dt() const { return int64_t{target.num_kv_heads} * target.head_dim; }  // n_t d_t
  bool matched() const {
    return source.num_kv_heads == target.num_kv_heads && source.head_dim == target.head_dim;
  }
};

// The source blocks a window fit reads for `sigma`, offset-major: (o, sigma[i]) is block
// o * source_layers + sigma[i] (the mapper's weight-row order, MapperView::window).
std::vector<int> WindowBlocks(const std::vector<int>& sigma, int source_layers, int window);
// The manifest's sigma of a block list from WindowBlocks: its offset-0 blocks.
std::vector<int> SigmaOfBlocks(const std::vector<int>& blocks, int window);

// The columns of a gathered row of `blocks` source blocks (block-major, head-major inside,
// n_s d_s each) that target head h of a head-local map reads, in order (kernels/mapper_view.h
// HeadLocalSources pairs the heads): in_h = blocks * g * d_s of them.
std::vector<int64_t> HeadSourceRows(const FitShape& shape, int64_t blocks, int h);

// "k" or "v": index 0 is K (RoPE-stripped), 1 is V.
inline const char* KindName(int kind) { return kind == 0 ? "k" : "v"; }

// Accumulates, over the training tokens, for K and V:
//   probe.n (tokens), probe.{c}.sum_x [L_s n_s d_s], sum_y and sumsq_y [L_t n_t d_t],
//   probe.{c}.gram.{j}   [n_s d_s, n_s d_s]  raw X_j^T X_j of each source layer (upper triangle),
//   matched:   probe.{c}.cross.h{h} [L_s d, L_t d]  head h of every source layer x head h of
//              every target layer (rows [j d, (j+1) d), columns [l d, (l+1) d));
//   unmatched: probe.{c}.cross [L_s n_s d_s, L_t n_t d_t]  every layer with every layer.
class ProbeAccumulator {
 public:
  explicit ProbeAccumulator(const FitShape& shape);
  void Add(const FeatureRows& rows);
  StatSet& stats() { return stats_; }

 private:
  FitShape shape_;
  StatSet stats_;
  std::vector<double> head_x_, head_y_;  // one head's columns gathered contiguously
};

// The source-layer pairs whose blocks the final fit needs, from the sigma lists (one list per
// target layer, used for K and V alike).
struct BlockPlan {
  std::vector<std::pair<int, int>> gram;   // (j, j2), j <= j2
  std::vector<std::pair<int, int>> cross;  // (j, l)
  static BlockPlan FromSigma(const std::vector<std::vector<int>>& sigma);
};

// Accumulates, for split s in {train, heldout} and c in {k, v}:
//   {s}.n (tokens), {s}.{c}.sum_x and sumsq_x [L_s n_s d_s], sum_y and sumsq_y [L_t n_t d_t],
//   {s}.{c}.gram.{j}.{j2} [n_s d_s, n_s d_s] raw X_j^T X_j2 (j == j2: upper triangle),
//   {s}.{c}.cross.{j}.{l} [n_s d_s, n_t d_t] raw X_j^T Y_l.
class FinalAccumulator {
 public:
  FinalAccumulator(const FitShape& shape, const BlockPlan& plan);
  void Add(const FeatureRows& rows, bool heldout);
  StatSet& stats() { return stats_; }

 private:
  FitShape shape_;
  BlockPlan plan_;
  StatSet stats_;
};

// Head-local attention-weighted statistics (`--per_head_objective=attention_weighted`), for c in
// {k, v}, target layer l and head h, over the training tokens, token t weighted by w_t (its
// attention mass, AttentionMass), on head h's input columns (HeadSourceRows of sigma[l]):
//   aw.{c}.{l}.{h}.n (sum of w), sum_x [in_h], gram [in_h, in_h] (full), cross [in_h, d_t],
//   sum_y and sumsq_y [d_t] (head h's columns of target layer l), all weighted sums.
class HeadWeightedAccumulator {
 public:
  HeadWeightedAccumulator(const FitShape& shape, const std::vector<std::vector<int>>& sigma);
  // `rows`: training rows of one sequence; `weights` [L_t][n_t][rows.rows] (AttentionMass).
  void Add(const FeatureRows& rows, const std::vector<double>& weights);
  StatSet& stats() { return stats_; }

 private:
  FitShape shape_;
  std::vector<std::vector<int>> sigma_;
  StatSet stats_;
};

// Array names, shared by the accumulators and the solver.
std::string WeightedName(int kind, int l, int h, const std::string& what);
std::string ProbeName(int kind, const std::string& what);
std::string FinalName(bool heldout, int kind, const std::string& what);
std::string GramName(bool heldout, int kind, int j, int j2);
std::string CrossName(bool heldout, int kind, int j, int l);

}  // namespace fit
}  // namespace kvt
