// `kvt fit --refine=attention`: moves a closed-form ridge mapper, or an MSE-trained MLP mapper,
// towards what the target reads, the error of its causal attention outputs under its own
// post-RoPE queries (SPEC 5), per target layer with the K and V maps jointly, by Adam over the
// calibration sequences (streamed). The attention error and its gradient with respect to the
// mapped keys and values have one home (AttentionOutputErrorAndGradient); each mapper kind
// backpropagates that through its own maps.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "fit/fit.h"
#include "fit/fit_internal.h"
#include "fit/mlp.h"
#include "fit/solve.h"
#include "kernels/rope.h"

namespace kvt {
namespace fit {

// One target layer's ridge maps, float64 in the mapper layout: K^ = x_k W_k + b_k (content
// space, target RoPE applied after), V^ = x_v W_v + b_v; W [in, out], out = n_t d_t.
struct RidgeMaps {
  int64_t in = 0, out = 0;
  std::vector<double> w_k, b_k, w_v, b_v;
  void Resize(int64_t in, int64_t out);  // zero-filled
  std::vector<std::vector<double>*> Tensors() { return {&w_k, &b_k, &w_v, &b_v}; }
};

// The target RoPE at each token of a sequence, float64, attention factor included: row t holds
// rotary_dim / 2 cos and sin values.
struct RopeRows {
  RopeStyle style = RopeStyle::kNeox;
  int half = 0;
  std::vector<double> cos, sin;
  static RopeRows Of(const Rope& rope, const std::vector<uint64_t>& positions);
  // In place on m [tokens, heads * head_dim] (rows < tokens): x <- R x, or R^T x (`transpose`).
  void Rotate(int64_t tokens, int heads, int head_dim, bool transpose, double* m) const;
};

// One sequence at one target layer. Attention is causal over token order, query head q reads KV
// head q / (query_heads / kv_heads), scores scaled by 1 / sqrt(head_dim) (quality/kv_quality).
struct AttentionProblem {
  int64_t tokens = 0;
  int kv_heads = 0, head_dim = 0, query_heads = 0;
  const double* x_k = nullptr;     // [tokens, in] source K features (content space), sigma order
  const double* x_v = nullptr;     // [tokens, in]
  const double* k_true = nullptr;  // [tokens, out] the target's keys, post-RoPE
  const double* v_true = nullptr;  // [tokens, out]
  const double* queries = nullptr;  // [tokens, query_heads, head_dim], post-RoPE
  const RopeRows* rope = nullptr;
  std::vector<int64_t> rows;  // query tokens whose outputs count, ascending
  // Tokens from here on keep the target's own keys and values, as after a handoff: a translated
  // prefix, then tokens the target computed itself. Queries past the boundary then weigh the
  // mapped keys against real ones, which a loss over the prefix alone cannot see (a shift of
  // every mapped score cancels in its softmax). -1: every visible token is mapped.
  int64_t own_from = -1;
};

// Sums over `rows` and query heads: error = ||o^ - o||^2, norm = ||o||^2.
struct AttentionError {
  double error = 0, norm = 0;
};

// Tokens whose mapped keys and values the error reads: [0, last counted query row].
inline int64_t VisibleTokens(const AttentionProblem& p) {
  return p.rows.empty() ? 0 : p.rows.back() + 1;
}

// Tokens whose keys and values come from the mapper: the visible ones before p.own_from.
inline int64_t MappedTokens(const AttentionProblem& p) {
  const int64_t te = VisibleTokens(p);
  return p.own_from < 0 ? te : std::min(p.own_from, te);
}

// The shared part: the error of the attention outputs that mapped keys and values give against
// the target's own. k_hat, v_hat [VisibleTokens(p), kv_heads * head_dim] in content space (K^
// before the target's RoPE, which this applies, as kvtd does); when dk_hat and dv_hat are set
// (same shape) they receive d error / d k_hat and d error / d v_hat (overwritten; zero from
// p.own_from on, where the target's own keys and values stand in). Ignores p.x_k and p.x_v.
AttentionError AttentionOutputErrorAndGradient(const AttentionProblem& p, const double* k_hat,
                                               const double* v_hat, double* dk_hat,
                                               double* dv_hat);

// The error of `maps`' attention outputs against the target's own, and (when `grad` is set,
// sized like `maps`) adds d error / d maps to it.
AttentionError AttentionErrorAndGradient(const AttentionProblem& problem, const RidgeMaps& maps,
                                         RidgeMaps* grad);

// One target layer's MLP chains (kind: mlp): per_layer one chain each for K and V of
// kv_heads * head_dim outputs; per_head kv_heads chains each of head_dim outputs (head h's
// columns). K^ = chain(x_k) in content space, V^ = chain(x_v).
struct MlpMaps {
  std::vector<MlpWeights> k, v;
  // Sized like `like`, zero-filled.
  static MlpMaps ZerosLike(const MlpMaps& like);
  // Every chain's six tensors, K chains first: (weight, bias) pairs.
  std::vector<std::vector<float>*> Tensors();
};

// As AttentionErrorAndGradient for MLP chains: forward through sgemm (float32 inputs, outputs
// widened to float64 for the shared error), d error / d K^, V^ backpropagated by MlpBackward;
// adds d error / d parameters to `grad` (sized like `maps`) when set.
AttentionError MlpAttentionErrorAndGradient(const AttentionProblem& problem, const MlpMaps& maps,
                                            MlpMaps* grad);

struct RefineLog {
  // Per step: the mean over target layers of error / norm of that step's batch.
  std::vector<double> loss;
  int sequences = 0;  // training sequences with target queries (of those read)
  double seconds = 0;
  // The same objective on the held-out sequences with queries (HeldoutLoss), before and after;
  // unset when none has queries.
  std::optional<double> heldout_before, heldout_after;
  // The refinement raised the held-out objective, so the start was kept (the mapper is then
  // the closed-form ridge or the MSE-trained MLP, as if not refined).
  bool kept_start = false;
};

// The summary of one refinement that ran with `budget` (for the MLP, options.ForMlp()).
RefinementSummary SummaryOf(const RefineOptions& budget, const RefineLog& log);

// Refines `fits` (one per target layer, sigma from `parsed`) in place on the training sequences
// of `options` whose target dumps carry queries, as `options.refine` says. Deterministic for
// options.refine.seed and the OpenBLAS thread count. FAILED_PRECONDITION when no training dump
// has queries. `per_head`: head-local maps (RidgeOptions::per_head) whose weights outside each
// head's rows and columns stay exactly 0 (the gradient there is dropped).
absl::StatusOr<RefineLog> RefineRidge(const FitOptions& options, const ParsedFinal& parsed,
                                      std::vector<LayerFit>* fits, bool per_head = false);

// The same for MLP chains (one MlpMaps per target layer, float32 as trained, before rounding to
// the weight dtype): the same sequences, query sampling, seeded order and Adam, on the MLP's
// budget (options.refine.ForMlp(): mlp_steps, mlp_batch, mlp_queries, step mlp_learning_rate x
// each tensor's RMS at the start).
absl::StatusOr<RefineLog> RefineMlp(const FitOptions& options, const ParsedFinal& parsed,
                                    std::vector<MlpMaps>* layers);

// The report facts of a refinement: settings, loss curve, wall time and the held-out cosine of
// the start (`before`; the refined mapper's is the report's usual fact). `start` names it: "the
// closed-form ridge", "the MSE-trained MLP".
std::vector<std::pair<std::string, std::string>> RefineFacts(const RefineOptions& options,
                                                             const RefineLog& log,
                                                             const HeldoutQuality* before,
                                                             const std::string& start);

}  // namespace fit
}  // namespace kvt
