#include "kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "kernels/dtype.h"

namespace kvt {
namespace reference {
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

// Head-local ridge (MapperView::head_local) of one token's gathered row x: target head h maps
// x_h, for each block (offset-major, then sigma) heads [first, first + count) of it, through
// its own |x_h| x d_t matrix (w stacks the heads along rows) and bias row, into y[h d_t ...].
void HeadLocalRidge(const MapperView& mapper, size_t sigma_size, const std::vector<double>& x,
                    const std::vector<double>& w, const std::vector<double>& bias, double* y) {
  const int64_t ns = mapper.source.num_kv_heads, ds = mapper.source.head_dim;
  const int64_t dt = mapper.target.head_dim;
  const int64_t blocks = static_cast<int64_t>(mapper.window) * static_cast<int64_t>(sigma_size);
  const int64_t in = HeadLocalInputWidth(mapper.source, mapper.target, mapper.window, sigma_size);
  for (int h = 0; h < mapper.target.num_kv_heads; ++h) {
    const HeadSources src = HeadLocalSources(mapper.source, mapper.target, h);
    for (int64_t c = 0; c < dt; ++c) {
      double sum = bias.empty() ? 0.0 : bias[h * dt + c];
      int64_t row = 0;  // row of head h's matrix
      for (int64_t block = 0; block < blocks; ++block) {
        for (int64_t s = src.first; s < src.first + src.count; ++s) {
          for (int64_t d = 0; d < ds; ++d, ++row) {
            sum += x[(block * ns + s) * ds + d] * w[(h * in + row) * dt + c];
          }
        }
      }
      y[h * dt + c] = sum;
    }
  }
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
  const int64_t blocks = static_cast<int64_t>(mapper.window) * sigma.size();
  const int64_t inputs = blocks * ns * ds;
  const int64_t outputs = static_cast<int64_t>(nt) * dt;
  std::vector<double> out(tokens * outputs);
  std::vector<double> x(inputs);
  for (int64_t t = 0; t < tokens; ++t) {
    const uint64_t p = positions.at(t);
    // Block b reads sigma[b % |sigma|] at token t - b / |sigma| (zero before the first token).
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t from = t - block / static_cast<int64_t>(sigma.size());
      const int j = sigma[block % sigma.size()];
      const void* data = keys ? source.k[j] : source.v[j];
      for (int h = 0; h < ns; ++h) {
        double* head = &x[(block * ns + h) * ds];
        for (int d = 0; d < ds; ++d) {
          head[d] = from < 0 ? 0.0
                             : LoadAsDouble(source.dtype, data,
                                            CacheOffset(source.layout, ns, tokens, ds, h, from, d));
        }
        if (keys && options.strip_source_rope && from >= 0) {
          RotateDouble(source_rope, positions.at(from), true, head);
        }
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
    } else if (mapper.head_local) {
      HeadLocalRidge(mapper, sigma.size(), x, w, bias, y);
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

}  // namespace reference
}  // namespace kvt
