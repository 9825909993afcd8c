#include "quality/kv_quality.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace kvt {
namespace {

// Query rows per attention block: bounds the score matrix to kQueryBlock x T floats.
constexpr int64_t kQueryBlock = 128;

double Cosine(const float* a, const float* b, int n) {
  double dot = 0, aa = 0, bb = 0;
  for (int i = 0; i < n; ++i) {
    dot += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  if (aa == 0 && bb == 0) return 1.0;
  if (aa == 0 || bb == 0) return 0.0;
  return dot / std::sqrt(aa * bb);
}

// Mean over (token, head) of cos(mapped, truth).
double MeanCosine(const float* mapped, const float* truth, int64_t tokens, int heads, int dim) {
  double sum = 0;
  for (int64_t i = 0; i < tokens * heads; ++i) sum += Cosine(mapped + i * dim, truth + i * dim, dim);
  return sum / static_cast<double>(tokens * heads);
}

// Head-averaged pooled R^2 of `mapped` as a prediction of `truth`.
double HeadAveragedR2(const float* mapped, const float* truth, int64_t tokens, int heads,
                      int dim) {
  double total = 0;
  std::vector<double> mean(dim);
  for (int h = 0; h < heads; ++h) {
    std::fill(mean.begin(), mean.end(), 0.0);
    for (int64_t t = 0; t < tokens; ++t) {
      const float* y = truth + (t * heads + h) * dim;
      for (int d = 0; d < dim; ++d) mean[d] += y[d];
    }
    for (double& m : mean) m /= static_cast<double>(tokens);
    double sse = 0, sst = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      const float* y = truth + (t * heads + h) * dim;
      const float* y_hat = mapped + (t * heads + h) * dim;
      for (int d = 0; d < dim; ++d) {
        const double err = static_cast<double>(y[d]) - y_hat[d];
        const double dev = y[d] - mean[d];
        sse += err * err;
        sst += dev * dev;
      }
    }
    // A constant target: perfect if matched exactly, else no explained variance at all.
    total += sst > 0 ? 1.0 - sse / sst : (sse == 0 ? 1.0 : 0.0);
  }
  return total / heads;
}

// Keys [token][head][dim] back to content space (target RoPE removed), SPEC 2's strip.
std::vector<float> StripKeys(const float* keys, int64_t tokens, int heads, int dim,
                             const Rope& rope, const Positions& positions) {
  std::vector<float> out(keys, keys + tokens * heads * dim);
  const int half = rope.rotary_dim() / 2;
  std::vector<float> cos(half), sin(half);
  for (int64_t t = 0; t < tokens; ++t) {
    rope.CosSin(positions.at(t), cos.data(), sin.data());
    for (int h = 0; h < heads; ++h) rope.StripHead(cos.data(), sin.data(), &out[(t * heads + h) * dim]);
  }
  return out;
}

// Row-wise masked softmax of scores (rows x cols) in place: column s of row r is visible iff
// key_pos[s] <= query_pos[r]. Every row sees at least its own token.
void CausalSoftmax(float* scores, int64_t rows, int64_t cols, const uint64_t* query_pos,
                   const uint64_t* key_pos) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * cols;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < cols; ++s) {
      if (key_pos[s] <= query_pos[r]) max_score = std::max(max_score, row[s]);
    }
    double sum = 0;
    for (int64_t s = 0; s < cols; ++s) {
      const float p = key_pos[s] <= query_pos[r] ? std::exp(row[s] - max_score) : 0.0f;
      row[s] = p;
      sum += p;
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t s = 0; s < cols; ++s) row[s] *= inv;
  }
}

}  // namespace

void ToTokenMajorFloat(DType dtype, Layout layout, int num_heads, int64_t num_tokens, int head_dim,
                       const void* src, float* dst) {
  if (layout == Layout::kNHD) {
    ToFloat(dtype, src, dst, num_tokens * num_heads * head_dim);
    return;
  }
  const size_t element = DTypeSize(dtype);
  for (int h = 0; h < num_heads; ++h) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      const char* row = static_cast<const char*>(src) +
                        static_cast<size_t>((h * num_tokens + t) * head_dim) * element;
      ToFloat(dtype, row, dst + (t * num_heads + h) * head_dim, head_dim);
    }
  }
}

absl::StatusOr<LayerQuality> ComputeLayerQuality(const LayerQualityInputs& in,
                                                 const Rope& target_rope,
                                                 const Positions& positions) {
  if (in.num_tokens <= 0 || in.num_kv_heads <= 0 || in.head_dim <= 0) {
    return absl::InvalidArgumentError("quality: empty layer");
  }
  if (in.k_mapped == nullptr || in.v_mapped == nullptr || in.k_true == nullptr ||
      in.v_true == nullptr) {
    return absl::InvalidArgumentError("quality: K and V of both caches are required");
  }
  if (in.num_query_heads < 0 || in.num_query_heads % in.num_kv_heads != 0 ||
      (in.num_query_heads > 0) != (in.queries != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_query_heads=", in.num_query_heads, " must be a multiple of the target's ",
        in.num_kv_heads, " KV heads, with queries exactly when it is > 0"));
  }
  if (target_rope.head_dim() != in.head_dim) {
    return absl::InvalidArgumentError("quality: RoPE head_dim differs from the layer's");
  }
  const int64_t T = in.num_tokens;
  const int H = in.num_kv_heads;
  const int d = in.head_dim;
  LayerQuality q;
  q.cosine_k = MeanCosine(in.k_mapped, in.k_true, T, H, d);
  q.cosine_v = MeanCosine(in.v_mapped, in.v_true, T, H, d);
  if (in.cosines_only) return q;
  {
    const std::vector<float> k_mapped = StripKeys(in.k_mapped, T, H, d, target_rope, positions);
    const std::vector<float> k_true = StripKeys(in.k_true, T, H, d, target_rope, positions);
    q.r2_k = HeadAveragedR2(k_mapped.data(), k_true.data(), T, H, d);
  }
  q.r2_v = HeadAveragedR2(in.v_mapped, in.v_true, T, H, d);
  if (in.num_query_heads == 0) return q;

  const int nq = in.num_query_heads;
  const int group = nq / H;
  std::vector<uint64_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = positions.at(t);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  const int64_t block = std::min<int64_t>(kQueryBlock, T);
  std::vector<float> p_true(block * T), p_mapped(block * T), o_true(block * d),
      o_mapped(block * d);
  std::vector<double> attention(T);  // a_t of the current KV head (unnormalised)
  std::vector<float> gram(d * d), err(T * d), err_gram(T * d);
  double attention_cos_sum = 0;
  double c_k_sum = 0, c_v_sum = 0;
  int c_k_heads = 0, c_v_heads = 0;
  for (int h = 0; h < H; ++h) {
    std::fill(attention.begin(), attention.end(), 0.0);
    std::fill(gram.begin(), gram.end(), 0.0f);
    for (int g = 0; g < group; ++g) {
      const int qh = h * group + g;
      const float* q_head = in.queries + static_cast<int64_t>(qh) * d;
      const int q_stride = nq * d;
      const int kv_stride = H * d;
      // G += Q^T Q over this query head's tokens: the weighting of c_K.
      cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, d, static_cast<int>(T), 1.0f, q_head,
                  q_stride, 1.0f, gram.data(), d);
      for (int64_t t0 = 0; t0 < T; t0 += block) {
        const int64_t rows = std::min(block, T - t0);
        const float* q_rows = q_head + t0 * q_stride;
        for (int which = 0; which < 2; ++which) {
          const float* keys = (which == 0 ? in.k_true : in.k_mapped) + h * d;
          const float* values = (which == 0 ? in.v_true : in.v_mapped) + h * d;
          float* p = (which == 0 ? p_true : p_mapped).data();
          float* o = (which == 0 ? o_true : o_mapped).data();
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                      static_cast<int>(T), d, scale, q_rows, q_stride, keys, kv_stride, 0.0f, p,
                      static_cast<int>(T));
          CausalSoftmax(p, rows, T, pos.data() + t0, pos.data());
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), d,
                      static_cast<int>(T), 1.0f, p, static_cast<int>(T), values, kv_stride, 0.0f,
                      o, d);
        }
        for (int64_t r = 0; r < rows; ++r) {
          attention_cos_sum += Cosine(o_mapped.data() + r * d, o_true.data() + r * d, d);
          const float* row = p_true.data() + r * T;
          for (int64_t s = 0; s < T; ++s) attention[s] += row[s];
        }
      }
    }
    // c_K: mean_t e_t^T G e_t / tr(G), over mean_t ||e_t||^2 / d.
    double trace = 0;
    for (int i = 0; i < d; ++i) trace += gram[i * d + i];
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < i; ++j) gram[i * d + j] = gram[j * d + i];  // ssyrk filled the upper half
    }
    double k_err2 = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int i = 0; i < d; ++i) {
        const int64_t at = (t * H + h) * d + i;
        err[t * d + i] = in.k_mapped[at] - in.k_true[at];
        k_err2 += static_cast<double>(err[t * d + i]) * err[t * d + i];
      }
    }
    if (k_err2 > 0 && trace > 0) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(T), d, d, 1.0f,
                  err.data(), d, gram.data(), d, 0.0f, err_gram.data(), d);
      double weighted = 0;
      for (int64_t i = 0; i < T * d; ++i) weighted += static_cast<double>(err[i]) * err_gram[i];
      c_k_sum += (weighted / trace) / (k_err2 / d);
      ++c_k_heads;
    }
    // c_V: errors weighted by a_t^2 against the plain mean.
    double v_err2 = 0, weighted_v = 0, a2 = 0;
    for (int64_t t = 0; t < T; ++t) {
      double e2 = 0;
      for (int i = 0; i < d; ++i) {
        const int64_t at = (t * H + h) * d + i;
        const double e = static_cast<double>(in.v_mapped[at]) - in.v_true[at];
        e2 += e * e;
      }
      v_err2 += e2;
      weighted_v += attention[t] * attention[t] * e2;
      a2 += attention[t] * attention[t];
    }
    if (v_err2 > 0 && a2 > 0) {
      c_v_sum += (weighted_v / a2) / (v_err2 / static_cast<double>(T));
      ++c_v_heads;
    }
  }
  q.attention_cosine = attention_cos_sum / static_cast<double>(T * nq);
  if (c_k_heads > 0) q.c_k = c_k_sum / c_k_heads;
  if (c_v_heads > 0) q.c_v = c_v_sum / c_v_heads;
  return q;
}

QualitySummary SummarizeQuality(const std::vector<LayerQuality>& layers) {
  auto mean_of = [&](size_t first) {
    LayerQuality out;
    const size_t n = layers.size() > first ? layers.size() - first : 0;
    if (n == 0) return out;
    double att = 0, ck = 0, cv = 0;
    int n_att = 0, n_ck = 0, n_cv = 0;
    for (size_t i = first; i < layers.size(); ++i) {
      const LayerQuality& l = layers[i];
      out.r2_k += l.r2_k / n;
      out.r2_v += l.r2_v / n;
      out.cosine_k += l.cosine_k / n;
      out.cosine_v += l.cosine_v / n;
      if (l.attention_cosine) att += *l.attention_cosine, ++n_att;
      if (l.c_k) ck += *l.c_k, ++n_ck;
      if (l.c_v) cv += *l.c_v, ++n_cv;
    }
    if (n_att > 0) out.attention_cosine = att / n_att;
    if (n_ck > 0) out.c_k = ck / n_ck;
    if (n_cv > 0) out.c_v = cv / n_cv;
    return out;
  };
  return {mean_of(0), mean_of(1)};
}

double KvCosineOverLayers(const std::vector<LayerQuality>& layers) {
  const QualitySummary summary = SummarizeQuality(layers);
  const LayerQuality& mean = layers.size() > 1 ? summary.without_layer0 : summary.all;
  return (mean.cosine_k + mean.cosine_v) / 2;
}

}  // namespace kvt
