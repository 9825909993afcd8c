#include "host_cache/host_cache_testing.h"

#include <algorithm>
#include <random>

#include "kernels/dtype.h"
#include "kernels/testing/reference.h"

namespace kvt {
namespace testing {

HostCache RandomHostCache(const ModelSpec& model, int64_t tokens, DType dtype, Layout layout,
                          uint64_t seed) {
  HostCache cache = HostCache::Zeros(dtype, layout, model.num_layers, model.num_kv_heads,
                                     model.head_dim, tokens);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  const int64_t elements = cache.layer_bytes() / static_cast<int64_t>(DTypeSize(dtype));
  for (int layer = 0; layer < cache.num_layers; ++layer) {
    for (int64_t i = 0; i < elements; ++i) {
      StoreFromDouble(dtype, cache.k[layer].data(), i, normal(rng));
      StoreFromDouble(dtype, cache.v[layer].data(), i, normal(rng));
    }
  }
  return cache;
}

double MaxErrorAgainstReference(const MapperView& mapper, const CacheView& source,
                                const CacheView& target, const Positions& positions) {
  double worst = 0;
  for (int layer = 0; layer < mapper.target.num_layers; ++layer) {
    for (Kind kind : {Kind::kK, Kind::kV}) {
      worst = std::max(worst, MaxRelError(ReadLayer(target, layer, kind),
                                          ReferenceTranslate(mapper, layer, kind, source,
                                                             positions)));
    }
  }
  return worst;
}

HostCache ToHostCache(const OwnedCache& owned) {
  HostCache cache;
  cache.dtype = owned.view.dtype;
  cache.layout = owned.view.layout;
  cache.num_layers = static_cast<int>(owned.k.size());
  cache.num_kv_heads = owned.view.num_kv_heads;
  cache.head_dim = owned.view.head_dim;
  cache.num_tokens = owned.view.num_tokens;
  for (int l = 0; l < cache.num_layers; ++l) {
    cache.k.emplace_back(owned.k[l].begin(), owned.k[l].end());
    cache.v.emplace_back(owned.v[l].begin(), owned.v[l].end());
  }
  return cache;
}

}  // namespace testing
}  // namespace kvt
