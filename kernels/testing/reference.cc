#include "kernels/testing/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "kernels/dtype.h"

namespace kvt {
namespace testing {
namespace {

void StoreNormal(DType dtype, double stddev, std::mt19937_64* rng, std::vector<uint8_t>* bytes,
                 int64_t count) {
  bytes->assign(count * DTypeSize(dtype), 0);
  std::normal_distribution<double> normal(0.0, stddev);
  for (int64_t i = 0; i < count; ++i) StoreFromDouble(dtype, bytes->data(), i, normal(*rng));
}

OwnedCache AllocateCache(int layers, int heads, int head_dim, int64_t tokens, DType dtype,
                         Layout layout, uint8_t fill) {
  OwnedCache cache;
  const size_t bytes = static_cast<size_t>(tokens) * heads * head_dim * DTypeSize(dtype);
  cache.k.assign(layers, std::vector<uint8_t>(bytes, fill));
  cache.v.assign(layers, std::vector<uint8_t>(bytes, fill));
  for (MutableCacheView* view : {&cache.mutable_view}) {
    view->dtype = dtype;
    view->layout = layout;
    view->num_kv_heads = heads;
    view->head_dim = head_dim;
    view->num_tokens = tokens;
  }
  cache.view.dtype = dtype;
  cache.view.layout = layout;
  cache.view.num_kv_heads = heads;
  cache.view.head_dim = head_dim;
  cache.view.num_tokens = tokens;
  for (int l = 0; l < layers; ++l) {
    cache.view.k.push_back(cache.k[l].data());
    cache.view.v.push_back(cache.v[l].data());
    cache.mutable_view.k.push_back(cache.k[l].data());
    cache.mutable_view.v.push_back(cache.v[l].data());
  }
  return cache;
}

}  // namespace

RandomMapper MakeRandomMapper(const RandomMapperSpec& spec, uint64_t seed) {
  std::mt19937_64 rng(seed);
  RandomMapper mapper;
  const auto model = [](const char* name, int layers, int heads, int head_dim, RopeConfig rope) {
    ModelSpec m;
    m.name = name;
    m.num_layers = layers;
    m.num_kv_heads = heads;
    m.head_dim = head_dim;
    if (rope.rotary_dim == 0) rope.rotary_dim = head_dim;
    m.rope = rope;
    return m;
  };
  mapper.view.source = model("random-source", spec.source_layers, spec.source_heads,
                             spec.source_head_dim, spec.source_rope);
  mapper.view.target = model("random-target", spec.target_layers, spec.target_heads,
                             spec.target_head_dim, spec.target_rope);
  mapper.view.window = spec.window;
  const int k_v = spec.k_v > 0 ? spec.k_v : spec.k;
  const int64_t rows_k =
      static_cast<int64_t>(spec.window) * spec.k * spec.source_heads * spec.source_head_dim;
  const int64_t rows_v =
      static_cast<int64_t>(spec.window) * k_v * spec.source_heads * spec.source_head_dim;
  const int64_t cols = static_cast<int64_t>(spec.target_heads) * spec.target_head_dim;
  // Every buffer exists before any view takes a pointer into `storage`.
  mapper.storage.resize(4 * spec.target_layers);
  const auto weight = [&](size_t slot, int64_t r, int64_t c, double stddev) {
    StoreNormal(spec.weight_dtype, stddev, &rng, &mapper.storage[slot], r * c);
    WeightView w;
    w.data = mapper.storage[slot].data();
    w.dtype = spec.weight_dtype;
    w.rows = r;
    w.cols = c;
    return w;
  };
  const auto sigma = [&](int k) {
    std::vector<int> layers(spec.source_layers);
    for (int j = 0; j < spec.source_layers; ++j) layers[j] = j;
    std::shuffle(layers.begin(), layers.end(), rng);
    layers.resize(k);
    return layers;
  };
  if (spec.kind == MapKind::kMlp) {
    mapper.view.kind = MapKind::kMlp;
    const int64_t heads = spec.mlp_per_head ? spec.target_heads : 1;
    const int64_t hidden = spec.mlp_hidden;
    const int64_t out = cols / heads;
    mapper.storage.assign(12 * spec.target_layers, {});
    // He-style scales: x has unit-variance entries, each ReLU halves the second moment and the
    // sqrt(2 / fan_in) of the next layer restores it, so every stage stays O(1); biases
    // N(0, 0.25) shift enough units across the ReLU kink to exercise both sides.
    const auto chain = [&](size_t slot, int64_t in) {
      MlpView m;
      m.heads = static_cast<int>(heads);
      m.hidden = hidden;
      m.a1 = weight(slot, heads * in, hidden, 1.0 / std::sqrt(static_cast<double>(in)));
      m.c1 = weight(slot + 1, heads, hidden, 0.5);
      m.a2 = weight(slot + 2, heads * hidden, hidden, std::sqrt(2.0 / hidden));
      m.c2 = weight(slot + 3, heads, hidden, 0.5);
      m.a3 = weight(slot + 4, heads * hidden, out, std::sqrt(2.0 / hidden));
      m.c3 = weight(slot + 5, heads, out, 0.5);
      return m;
    };
    for (int l = 0; l < spec.target_layers; ++l) {
      LayerMapView layer;
      layer.sigma_k = sigma(spec.k);
      layer.sigma_v = sigma(k_v);
      layer.mlp_k = chain(12 * l, rows_k);
      layer.mlp_v = chain(12 * l + 6, rows_v);
      mapper.view.layers.push_back(layer);
    }
    return mapper;
  }
  if (spec.ridge_per_head) {
    // Head-local: n_t stacked [|x_h|, d_t] matrices and n_t x d_t biases.
    mapper.view.head_local = true;
    const int64_t heads = spec.target_heads, dt = spec.target_head_dim;
    const ModelSpec& source = mapper.view.source;
    const ModelSpec& target = mapper.view.target;
    const int64_t in_k = HeadLocalInputWidth(source, target, spec.window, spec.k);
    const int64_t in_v = HeadLocalInputWidth(source, target, spec.window, k_v);
    for (int l = 0; l < spec.target_layers; ++l) {
      LayerMapView layer;
      layer.sigma_k = sigma(spec.k);
      layer.sigma_v = sigma(k_v);
      layer.w_k = weight(4 * l, heads * in_k, dt, 1.0 / std::sqrt(static_cast<double>(in_k)));
      layer.w_v = weight(4 * l + 1, heads * in_v, dt, 1.0 / std::sqrt(static_cast<double>(in_v)));
      if (spec.with_bias) {
        layer.b_k = weight(4 * l + 2, heads, dt, 0.5);
        layer.b_v = weight(4 * l + 3, heads, dt, 0.5);
      }
      mapper.view.layers.push_back(layer);
    }
    return mapper;
  }
  for (int l = 0; l < spec.target_layers; ++l) {
    LayerMapView layer;
    layer.sigma_k = sigma(spec.k);
    layer.sigma_v = sigma(k_v);
    layer.w_k = weight(4 * l, rows_k, cols, 1.0 / std::sqrt(static_cast<double>(rows_k)));
    layer.w_v = weight(4 * l + 1, rows_v, cols, 1.0 / std::sqrt(static_cast<double>(rows_v)));
    if (spec.with_bias) {
      layer.b_k = weight(4 * l + 2, 1, cols, 0.5);
      layer.b_v = weight(4 * l + 3, 1, cols, 0.5);
    }
    mapper.view.layers.push_back(layer);
  }
  return mapper;
}

OwnedCache MakeRandomCache(int layers, int heads, int head_dim, int64_t tokens, DType dtype,
                           Layout layout, uint64_t seed) {
  OwnedCache cache = AllocateCache(layers, heads, head_dim, tokens, dtype, layout, 0);
  std::mt19937_64 rng(seed);
  const int64_t count = tokens * heads * head_dim;
  for (int l = 0; l < layers; ++l) {
    StoreNormal(dtype, 1.0, &rng, &cache.k[l], count);
    StoreNormal(dtype, 1.0, &rng, &cache.v[l], count);
  }
  return cache;
}

OwnedCache MakeOutputCache(int layers, int heads, int head_dim, int64_t tokens, DType dtype,
                           Layout layout) {
  return AllocateCache(layers, heads, head_dim, tokens, dtype, layout, 0xff);
}

RopeConfig MakeTestRope(RopeScalingType type, RopeStyle style, int rotary_dim, double theta) {
  RopeConfig config;
  config.theta = theta;
  config.rotary_dim = rotary_dim;
  config.style = style;
  config.scaling.type = type;
  switch (type) {
    case RopeScalingType::kNone:
      break;
    case RopeScalingType::kLinear:
      config.scaling.factor = 2.5;
      break;
    case RopeScalingType::kLlama3:
      config.scaling.factor = 8;
      config.scaling.low_freq_factor = 1;
      config.scaling.high_freq_factor = 4;
      config.scaling.original_max_position_embeddings = 64;  // small, so every band is hit
      break;
    case RopeScalingType::kYarn:
      config.scaling.factor = 4;
      config.scaling.original_max_position_embeddings = 256;
      break;
  }
  return config;
}

OwnedCache SliceTokens(const CacheView& cache, int64_t begin, int64_t end) {
  const int layers = static_cast<int>(cache.k.size());
  OwnedCache slice = AllocateCache(layers, cache.num_kv_heads, cache.head_dim, end - begin,
                                   cache.dtype, cache.layout, 0);
  const size_t element = DTypeSize(cache.dtype);
  const int64_t n = cache.num_kv_heads, d = cache.head_dim;
  for (int l = 0; l < layers; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      const uint8_t* from = static_cast<const uint8_t*>(kind == 0 ? cache.k[l] : cache.v[l]);
      uint8_t* to = kind == 0 ? slice.k[l].data() : slice.v[l].data();
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < n; ++h) {
          std::memcpy(to + CacheOffset(cache.layout, n, end - begin, d, h, t - begin, 0) * element,
                      from + CacheOffset(cache.layout, n, cache.num_tokens, d, h, t, 0) * element,
                      d * element);
        }
      }
    }
  }
  return slice;
}

}  // namespace testing
}  // namespace kvt
