#include "kernels/backend.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvt {

namespace {

// Shared by the source (read-only) and target (mutable) views.
template <typename Pointer>
absl::Status CheckOneCache(const char* which, const ModelSpec& model,
                           const std::vector<Pointer>& k, const std::vector<Pointer>& v,
                           int num_kv_heads, int head_dim, int64_t num_tokens,
                           const std::vector<bool>* needed_layers) {
  if (num_kv_heads != model.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(which, ".num_kv_heads=", num_kv_heads,
                                                   " but mapper ", which, " model has ",
                                                   model.num_kv_heads));
  }
  if (head_dim != model.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(which, ".head_dim=", head_dim, " but mapper ",
                                                   which, " model has ", model.head_dim));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(which, ".num_tokens=", num_tokens, " is negative"));
  }
  const auto check_layers = [&](const char* kind, const std::vector<Pointer>& pointers) {
    if (static_cast<int64_t>(pointers.size()) != model.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(which, ".", kind, " has ", pointers.size(),
                                                     " layers but mapper ", which, " model has ",
                                                     model.num_layers));
    }
    for (size_t layer = 0; layer < pointers.size(); ++layer) {
      if (needed_layers != nullptr && !(*needed_layers)[layer]) continue;
      if (pointers[layer] == nullptr && num_tokens > 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(which, ".", kind, "[", layer, "] is null"));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check_layers("k", k); !s.ok()) return s;
  return check_layers("v", v);
}

absl::Status CheckTokenCounts(const CacheView& source, const MutableCacheView& target) {
  if (target.num_tokens != source.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("target.num_tokens=", target.num_tokens,
                                                   " but source.num_tokens=",
                                                   source.num_tokens));
  }
  return absl::OkStatus();
}

absl::Status CheckModel(const char* which, const ModelSpec& model) {
  if (model.num_layers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(which, ".num_layers=", model.num_layers, " must be positive"));
  }
  if (model.num_kv_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(which, ".num_kv_heads=", model.num_kv_heads, " must be positive"));
  }
  if (model.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(which, ".head_dim=", model.head_dim, " must be positive"));
  }
  if (absl::Status s = ValidateRopeConfig(model.rope, model.head_dim); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(which, ".", s.message()));
  }
  return absl::OkStatus();
}

absl::Status CheckSigma(int layer, const char* name, const std::vector<int>& sigma,
                        int source_layers) {
  if (sigma.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("layers[", layer, "].", name, " is empty"));
  }
  for (size_t i = 0; i < sigma.size(); ++i) {
    if (sigma[i] < 0 || sigma[i] >= source_layers) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", layer, "].", name, "[", i, "]=",
                                                     sigma[i], " out of range [0, ",
                                                     source_layers, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckWeight(int layer, const char* name, const WeightView& w, int64_t rows,
                         int64_t cols, const std::string& why) {
  if (w.rows != rows || w.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat("layers[", layer, "].", name, " is ", w.rows,
                                                   "x", w.cols, " but expected ", rows, "x",
                                                   cols, " (", why, ")"));
  }
  if (w.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("layers[", layer, "].", name, " is null"));
  }
  return absl::OkStatus();
}

// A bias is optional: data null with a 0x0 shape means zero.
absl::Status CheckBias(int layer, const char* name, const WeightView& b, int64_t cols) {
  if (b.data == nullptr && b.rows == 0 && b.cols == 0) return absl::OkStatus();
  return CheckWeight(layer, name, b, 1, cols, "one row of target n_t * d_t");
}

// One MLP chain (mlp_k or mlp_v): shapes from MlpView's stacking rules, every tensor present
// (MLP biases are part of the format, not optional).
absl::Status CheckMlp(int layer, const char* name, const MlpView& mlp, int64_t in,
                      const ModelSpec& target) {
  const int64_t heads = mlp.heads;
  const int64_t hidden = mlp.hidden;
  if (heads != 1 && heads != target.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers[", layer, "].", name, ".heads=", heads, " must be 1 (per_layer) or target n=",
        target.num_kv_heads, " (per_head)"));
  }
  if (hidden < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers[", layer, "].", name, ".hidden=", hidden, " must be >= 1"));
  }
  const int64_t out = heads == 1 ? static_cast<int64_t>(target.num_kv_heads) * target.head_dim
                                 : target.head_dim;
  const std::string why = absl::StrCat(heads, " head chain(s), in=", in, ", hidden=", hidden,
                                       ", out=", out);
  const std::string prefix = std::string(name) + ".";
  const std::pair<const char*, std::tuple<const WeightView*, int64_t, int64_t>> parts[] = {
      {"a1", {&mlp.a1, heads * in, hidden}},   {"c1", {&mlp.c1, heads, hidden}},
      {"a2", {&mlp.a2, heads * hidden, hidden}}, {"c2", {&mlp.c2, heads, hidden}},
      {"a3", {&mlp.a3, heads * hidden, out}},  {"c3", {&mlp.c3, heads, out}}};
  for (const auto& [part, shape] : parts) {
    const auto& [w, rows, cols] = shape;
    if (absl::Status s = CheckWeight(layer, (prefix + part).c_str(), *w, rows, cols, why);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// A head-local ridge layer: per K|V the n_t heads' matrices stacked along rows
// (n_t * |x_h| x d_t) and an optional n_t x d_t bias.
absl::Status CheckHeadLocalLayer(const MapperView& mapper, int l) {
  const LayerMapView& layer = mapper.layers[l];
  const int64_t heads = mapper.target.num_kv_heads;
  const int64_t dt = mapper.target.head_dim;
  for (const auto& [name, w, b, sigma] :
       {std::tuple<const char*, const WeightView*, const WeightView*, const std::vector<int>*>{
            "k", &layer.w_k, &layer.b_k, &layer.sigma_k},
        {"v", &layer.w_v, &layer.b_v, &layer.sigma_v}}) {
    const int64_t in =
        HeadLocalInputWidth(mapper.source, mapper.target, mapper.window, sigma->size());
    const std::string why = absl::StrCat(
        "per_head: target n=", heads, " heads of window ", mapper.window, " x |sigma_", name,
        "|=", sigma->size(), " x ", HeadLocalSources(mapper.source, mapper.target, 0).count,
        " source head(s) x d=", mapper.source.head_dim, " rows, d=", dt, " cols");
    if (absl::Status s = CheckWeight(l, absl::StrCat("w_", name).c_str(), *w, heads * in, dt, why);
        !s.ok()) {
      return s;
    }
    if (b->data == nullptr && b->rows == 0 && b->cols == 0) continue;
    if (absl::Status s = CheckWeight(l, absl::StrCat("b_", name).c_str(), *b, heads, dt,
                                     "per_head: one row of d_t per target head");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t MlpParams(const MlpView& mlp) {
  uint64_t elements = 0;
  for (const WeightView* w : {&mlp.a1, &mlp.c1, &mlp.a2, &mlp.c2, &mlp.a3, &mlp.c3}) {
    elements += static_cast<uint64_t>(w->rows) * static_cast<uint64_t>(w->cols);
  }
  return elements;
}

absl::Status CheckMapperView(const MapperView& mapper) {
  if (absl::Status s = CheckModel("source", mapper.source); !s.ok()) return s;
  if (absl::Status s = CheckModel("target", mapper.target); !s.ok()) return s;
  if (static_cast<int64_t>(mapper.layers.size()) != mapper.target.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("mapper.layers has ", mapper.layers.size(),
                                                   " entries but target.num_layers=",
                                                   mapper.target.num_layers));
  }
  if (mapper.window < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("mapper.window=", mapper.window, " must be >= 1"));
  }
  if (mapper.head_local) {
    if (mapper.kind != MapKind::kRidge) {
      return absl::InvalidArgumentError("mapper.head_local is only valid for a ridge mapper");
    }
    if (absl::Status s = CheckHeadLocalHeads(mapper.source, mapper.target); !s.ok()) return s;
  }
  // A window mapper's input rows hold every sigma block `window` times (one per token offset).
  const int64_t source_width =
      static_cast<int64_t>(mapper.window) * mapper.source.num_kv_heads * mapper.source.head_dim;
  const int64_t target_width =
      static_cast<int64_t>(mapper.target.num_kv_heads) * mapper.target.head_dim;
  for (int l = 0; l < mapper.target.num_layers; ++l) {
    const LayerMapView& layer = mapper.layers[l];
    if (absl::Status s = CheckSigma(l, "sigma_k", layer.sigma_k, mapper.source.num_layers);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckSigma(l, "sigma_v", layer.sigma_v, mapper.source.num_layers);
        !s.ok()) {
      return s;
    }
    const auto why = [&](const char* sigma, size_t k) {
      return absl::StrCat(mapper.window == 1 ? "" : absl::StrCat("window ", mapper.window, " x "),
                          "|", sigma, "|=", k, " x source n=", mapper.source.num_kv_heads,
                          " x d=", mapper.source.head_dim, " rows, target n=",
                          mapper.target.num_kv_heads, " x d=", mapper.target.head_dim, " cols");
    };
    if (mapper.kind == MapKind::kMlp) {
      if (absl::Status s = CheckMlp(l, "mlp_k", layer.mlp_k,
                                    layer.sigma_k.size() * source_width, mapper.target);
          !s.ok()) {
        return s;
      }
      if (absl::Status s = CheckMlp(l, "mlp_v", layer.mlp_v,
                                    layer.sigma_v.size() * source_width, mapper.target);
          !s.ok()) {
        return s;
      }
      continue;
    }
    if (mapper.head_local) {
      if (absl::Status s = CheckHeadLocalLayer(mapper, l); !s.ok()) return s;
      continue;
    }
    if (absl::Status s = CheckWeight(l, "w_k", layer.w_k, layer.sigma_k.size() * source_width,
                                     target_width, why("sigma_k", layer.sigma_k.size()));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckWeight(l, "w_v", layer.w_v, layer.sigma_v.size() * source_width,
                                     target_width, why("sigma_v", layer.sigma_v.size()));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckBias(l, "b_k", layer.b_k, target_width); !s.ok()) return s;
    if (absl::Status s = CheckBias(l, "b_v", layer.b_v, target_width); !s.ok()) return s;
  }

  return absl::OkStatus();
}

absl::Status CheckCacheShapes(const MapperView& mapper, const CacheView& source,
                              const MutableCacheView& target) {
  if (absl::Status s = CheckOneCache("source", mapper.source, source.k, source.v,
                                     source.num_kv_heads, source.head_dim, source.num_tokens,
                                     nullptr);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckOneCache("target", mapper.target, target.k, target.v,
                                     target.num_kv_heads, target.head_dim, target.num_tokens,
                                     nullptr);
      !s.ok()) {
    return s;
  }
  return CheckTokenCounts(source, target);
}

absl::Status CheckLayerCacheShapes(const MapperView& mapper, int target_layer,
                                   const CacheView& source, const MutableCacheView& target) {
  if (target_layer < 0 || target_layer >= mapper.target.num_layers ||
      target_layer >= static_cast<int>(mapper.layers.size())) {
    return absl::InvalidArgumentError(absl::StrCat("target_layer=", target_layer,
                                                   " out of range [0, ",
                                                   mapper.target.num_layers, ")"));
  }
  const LayerMapView& layer = mapper.layers[target_layer];
  // Layers outside the sigma lists may not have arrived yet; only these must be set.
  std::vector<bool> source_needed(std::max(mapper.source.num_layers, 0), false);
  for (const std::vector<int>* sigma : {&layer.sigma_k, &layer.sigma_v}) {
    for (int j : *sigma) {
      if (j < 0 || j >= mapper.source.num_layers) {
        return absl::InvalidArgumentError(
            absl::StrCat("mapper layers[", target_layer, "] names source layer ", j,
                         " out of range [0, ", mapper.source.num_layers, ")"));
      }
      source_needed[j] = true;
    }
  }
  std::vector<bool> target_needed(std::max(mapper.target.num_layers, 0), false);
  target_needed[target_layer] = true;
  if (absl::Status s = CheckOneCache("source", mapper.source, source.k, source.v,
                                     source.num_kv_heads, source.head_dim, source.num_tokens,
                                     &source_needed);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckOneCache("target", mapper.target, target.k, target.v,
                                     target.num_kv_heads, target.head_dim, target.num_tokens,
                                     &target_needed);
      !s.ok()) {
    return s;
  }
  return CheckTokenCounts(source, target);
}

absl::Status Backend::Translate(const PreparedMapper& mapper, const CacheView& source,
                                const Positions& positions, const TranslateOptions& options,
                                MutableCacheView* target) {
  if (target == nullptr) return absl::InvalidArgumentError("target is null");
  const MapperView& view = mapper.view();
  if (absl::Status s = CheckCacheShapes(view, source, *target); !s.ok()) return s;
  for (int layer = 0; layer < view.target.num_layers; ++layer) {
    if (absl::Status s = TranslateLayer(mapper, layer, source, positions, options, target);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

uint64_t Backend::PreparedBytesEstimate(const MapperView& mapper) const {
  uint64_t elements = 0;
  for (const LayerMapView& layer : mapper.layers) {
    for (const WeightView* w : {&layer.w_k, &layer.b_k, &layer.w_v, &layer.b_v}) {
      elements += static_cast<uint64_t>(w->rows) * static_cast<uint64_t>(w->cols);
    }
    elements += MlpParams(layer.mlp_k) + MlpParams(layer.mlp_v);  // 0 for ridge
  }
  return elements * sizeof(float);
}

}  // namespace kvt
