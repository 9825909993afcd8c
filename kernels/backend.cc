#include "kernels/backend.h"

#include <algorithm>

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

}  // namespace

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
  }
  return elements * sizeof(float);
}

}  // namespace kvt
