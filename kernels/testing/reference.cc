#include "kernels/testing/reference.h"

#include <chrono>
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

Rope MustCreateRope(const RopeConfig& config, int head_dim) {
  absl::StatusOr<Rope> rope = Rope::Create(config, head_dim);
  if (!rope.ok()) {
    std::fprintf(stderr, "reference: bad RoPE config: %s\n", rope.status().ToString().c_str());
    std::abort();
  }
  return *rope;
}

std::vector<double> LoadAll(const WeightView& w) {
  std::vector<double> out(w.rows * w.cols);
  for (int64_t i = 0; i < w.rows * w.cols; ++i) out[i] = LoadAsDouble(w.dtype, w.data, i);
  return out;
}

template <typename Pointer>
std::vector<double> ReadLayerImpl(DType dtype, Layout layout, int heads, int head_dim,
                                  int64_t tokens, Pointer data) {
  std::vector<double> out(tokens * heads * head_dim);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < head_dim; ++d) {
        out[(t * heads + h) * head_dim + d] =
            LoadAsDouble(dtype, data, CacheOffset(layout, heads, tokens, head_dim, h, t, d));
      }
    }
  }
  return out;
}

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

void RotateDouble(const Rope& rope, uint64_t position, bool inverse, double* x) {
  const int half = rope.rotary_dim() / 2;
  const double factor = rope.attention_factor();
  for (int m = 0; m < half; ++m) {
    // long double keeps the phase of positions far beyond 10^6 (64-bit mantissa).
    const long double angle = static_cast<long double>(position) * rope.inv_freq()[m];
    const double c = static_cast<double>(std::cos(angle));
    const double s = static_cast<double>(std::sin(angle));
    const int i = rope.style() == RopeStyle::kNeox ? m : 2 * m;
    const int j = rope.style() == RopeStyle::kNeox ? m + half : 2 * m + 1;
    const double a = x[i];
    const double b = x[j];
    if (inverse) {
      x[i] = (a * c + b * s) / factor;
      x[j] = (b * c - a * s) / factor;
    } else {
      x[i] = (a * c - b * s) * factor;
      x[j] = (b * c + a * s) * factor;
    }
  }
}

std::vector<double> ReferenceTranslate(const MapperView& mapper, int layer, Kind kind,
                                       const CacheView& source, const Positions& positions,
                                       const ReferenceOptions& options) {
  const LayerMapView& map = mapper.layers[layer];
  const bool keys = kind == Kind::kK;
  const bool mlp = mapper.kind == MapKind::kMlp;
  const std::vector<int>& sigma = keys ? map.sigma_k : map.sigma_v;
  const std::vector<double> w = mlp ? std::vector<double>() : LoadAll(keys ? map.w_k : map.w_v);
  const WeightView& bias_view = keys ? map.b_k : map.b_v;
  const std::vector<double> bias =
      !mlp && bias_view.data ? LoadAll(bias_view) : std::vector<double>();
  const MlpView& chain = keys ? map.mlp_k : map.mlp_v;
  std::vector<double> a1, c1, a2, c2, a3, c3;
  if (mlp) {
    a1 = LoadAll(chain.a1), c1 = LoadAll(chain.c1), a2 = LoadAll(chain.a2);
    c2 = LoadAll(chain.c2), a3 = LoadAll(chain.a3), c3 = LoadAll(chain.c3);
  }
  const Rope source_rope = MustCreateRope(mapper.source.rope, mapper.source.head_dim);
  const Rope target_rope = MustCreateRope(mapper.target.rope, mapper.target.head_dim);

  const int64_t tokens = source.num_tokens;
  const int ns = mapper.source.num_kv_heads, ds = mapper.source.head_dim;
  const int nt = mapper.target.num_kv_heads, dt = mapper.target.head_dim;
  const int64_t inputs = static_cast<int64_t>(sigma.size()) * ns * ds;
  const int64_t outputs = static_cast<int64_t>(nt) * dt;
  std::vector<double> out(tokens * outputs);
  std::vector<double> x(inputs);
  for (int64_t t = 0; t < tokens; ++t) {
    const uint64_t p = positions.at(t);
    for (size_t block = 0; block < sigma.size(); ++block) {
      const void* data = keys ? source.k[sigma[block]] : source.v[sigma[block]];
      for (int h = 0; h < ns; ++h) {
        double* head = &x[(block * ns + h) * ds];
        for (int d = 0; d < ds; ++d) {
          head[d] = LoadAsDouble(source.dtype, data,
                                 CacheOffset(source.layout, ns, tokens, ds, h, t, d));
        }
        if (keys && options.strip_source_rope) RotateDouble(source_rope, p, true, head);
      }
    }
    double* y = &out[t * outputs];
    if (mlp) {
      // SPEC 3: y = relu(relu(x A1 + c1) A2 + c2) A3 + c3, one chain per head when per_head
      // (head h sees the full x and writes columns [h d_t, (h+1) d_t)).
      const int64_t hidden = chain.hidden;
      const int64_t heads = chain.heads;
      const int64_t head_out = outputs / heads;
      std::vector<double> h1(hidden), h2(hidden);
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < hidden; ++j) {
          double sum = c1[h * hidden + j];
          for (int64_t i = 0; i < inputs; ++i) sum += x[i] * a1[(h * inputs + i) * hidden + j];
          h1[j] = std::max(sum, 0.0);
        }
        for (int64_t j = 0; j < hidden; ++j) {
          double sum = c2[h * hidden + j];
          for (int64_t i = 0; i < hidden; ++i) sum += h1[i] * a2[(h * hidden + i) * hidden + j];
          h2[j] = std::max(sum, 0.0);
        }
        for (int64_t c = 0; c < head_out; ++c) {
          double sum = c3[h * head_out + c];
          for (int64_t i = 0; i < hidden; ++i) sum += h2[i] * a3[(h * hidden + i) * head_out + c];
          y[h * head_out + c] = sum;
        }
      }
    } else {
      for (int64_t c = 0; c < outputs; ++c) {
        double sum = bias.empty() ? 0.0 : bias[c];
        for (int64_t i = 0; i < inputs; ++i) sum += x[i] * w[i * outputs + c];
        y[c] = sum;
      }
    }
    if (keys && options.apply_target_rope) {
      for (int h = 0; h < nt; ++h) RotateDouble(target_rope, p, false, y + h * dt);
    }
  }
  return out;
}

std::vector<double> ReadLayer(const CacheView& cache, int layer, Kind kind) {
  return ReadLayerImpl(cache.dtype, cache.layout, cache.num_kv_heads, cache.head_dim,
                       cache.num_tokens, kind == Kind::kK ? cache.k[layer] : cache.v[layer]);
}

std::vector<double> ReadLayer(const MutableCacheView& cache, int layer, Kind kind) {
  return ReadLayerImpl(cache.dtype, cache.layout, cache.num_kv_heads, cache.head_dim,
                       cache.num_tokens,
                       static_cast<const void*>(kind == Kind::kK ? cache.k[layer]
                                                                 : cache.v[layer]));
}

double MaxRelError(const std::vector<double>& actual, const std::vector<double>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (std::isnan(actual[i]) || std::isnan(expected[i])) {
      return std::numeric_limits<double>::infinity();
    }
    max_diff = std::max(max_diff, std::abs(actual[i] - expected[i]));
    max_ref = std::max(max_ref, std::abs(expected[i]));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

uint64_t FreshSeed(const char* what) {
  std::random_device device;
  const uint64_t seed =
      (static_cast<uint64_t>(device()) << 32) ^ device() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::fprintf(stderr, "[seed] %s: %llu\n", what, static_cast<unsigned long long>(seed));
  return seed;
}

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
  const int k_v = spec.k_v > 0 ? spec.k_v : spec.k;
  const int64_t rows_k = static_cast<int64_t>(spec.k) * spec.source_heads * spec.source_head_dim;
  const int64_t rows_v = static_cast<int64_t>(k_v) * spec.source_heads * spec.source_head_dim;
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

double TranslationTolerance(DType output) {
  switch (output) {
    case DType::kFP32:
      return 1e-5;
    case DType::kFP16:
      return 1e-3;
    case DType::kBF16:
      return 1e-2;
  }
  return 0;
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
