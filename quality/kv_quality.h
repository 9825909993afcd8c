// SPEC section 5 quality metrics of a translated cache against the target's true cache, per
// layer and over layers: R^2 (content-space K, V), K/V cosine, attention-output cosine and the
// error concentrations c_K, c_V (the last three need the target's queries). Used by ValidateKV.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/rope.h"
#include "kernels/types.h"

namespace kvt {

// One target layer, float32, token-major: [token][head][dim]. Keys post-RoPE, as caches hold
// them. Queries are the target's post-RoPE queries, [token][query_head][dim]; query head q reads
// KV head q / (num_query_heads / num_kv_heads) (grouped-query attention, Hugging Face order).
struct LayerQualityInputs {
  int64_t num_tokens = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int num_query_heads = 0;  // 0: no queries
  const float* k_mapped = nullptr;
  const float* v_mapped = nullptr;
  const float* k_true = nullptr;
  const float* v_true = nullptr;
  const float* queries = nullptr;  // set iff num_query_heads > 0
  // Only cosine_k and cosine_v (R^2 left 0, queries ignored): what live verification needs,
  // without the RoPE strip and covariances R^2 costs.
  bool cosines_only = false;
};

struct LayerQuality {
  // Pooled per head, 1 - sum (y - y^)^2 / sum (y - mean_t y)^2 (per-dimension token mean),
  // averaged over heads. K in content space (target RoPE stripped from both).
  double r2_k = 0;
  double r2_v = 0;
  // cos(x^, x) per (token, head), averaged (two zero vectors count 1, one zero vector 0).
  double cosine_k = 0;
  double cosine_v = 0;
  // Causal attention o = softmax(q K^T / sqrt(d)) V, a query at position p seeing keys at
  // positions <= p; cos(o^, o) averaged over query tokens and query heads. Needs queries.
  std::optional<double> attention_cosine;
  // Per KV head, averaged over heads whose error is not exactly zero; absent when none is or
  // without queries. c_K = [mean_t ||Q e_t||^2 / ||Q||_F^2] / [mean_t ||e_t||^2 / d], Q the
  // head's query set (every token of its query heads), e_t = K^_t - K_t post-RoPE.
  // c_V = [sum_t a_t^2 ||e_t||^2 / sum_t a_t^2] / [mean_t ||e_t||^2], a_t the true attention
  // weight of token t averaged over the query set, e_t = V^_t - V_t.
  std::optional<double> c_k;
  std::optional<double> c_v;
};

// Every metric of one layer. `target_rope` strips keys for R^2; `positions` gives the causal
// order. INVALID_ARGUMENT for inconsistent shapes (num_query_heads not a multiple of
// num_kv_heads, missing pointers).
absl::StatusOr<LayerQuality> ComputeLayerQuality(const LayerQualityInputs& inputs,
                                                 const Rope& target_rope,
                                                 const Positions& positions);

// Means over layers (an optional field over the layers that have it, else absent): over all
// layers, and over layers 1.. (layer 0 maps unusually well and inflates the mean; with a single
// layer that second summary is empty: every field 0, optionals absent).
struct QualitySummary {
  LayerQuality all;
  LayerQuality without_layer0;
};
QualitySummary SummarizeQuality(const std::vector<LayerQuality>& layers);

// The K/V cosine of a translation: (cosine_k + cosine_v) / 2 of the mean over target layers
// past 0 (every layer when there is one), i.e. cos(translated, true) per token and head averaged
// over tokens, heads, layers, K and V. Needs no queries. Keys: a rotation preserves dot products,
// so the post-RoPE cosine at shared positions equals the content-space one. What `kvt fit`
// records as quality.kv_cosine_heldout and what kvtd's live verification measures per sample.
double KvCosineOverLayers(const std::vector<LayerQuality>& layers);

// One layer's K or V in any dtype and layout into float [token][head][dim] (`dst` holds
// tokens * heads * head_dim floats).
void ToTokenMajorFloat(DType dtype, Layout layout, int num_heads, int64_t num_tokens, int head_dim,
                       const void* src, float* dst);

}  // namespace kvt
