// Test-only float64 reference of SPEC 5, written as directly as the formulas read: plain loops,
// no blocking, no BLAS, no shortcuts. Arrays are [token][head][dim] doubles; keys post-RoPE.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace kvt {
namespace testing {

struct QualityReference {
  double r2_k, r2_v, cosine_k, cosine_v;
  double attention_cosine, c_k, c_v;  // only meaningful with queries
};

inline double RefCosine(const double* a, const double* b, int n) {
  double dot = 0, aa = 0, bb = 0;
  for (int i = 0; i < n; ++i) dot += a[i] * b[i], aa += a[i] * a[i], bb += b[i] * b[i];
  return dot / std::sqrt(aa * bb);
}

// R^2 per head, pooled over tokens and dims around each dim's token mean; mean over heads.
inline double RefR2(const std::vector<double>& y_hat, const std::vector<double>& y, int64_t T,
                    int H, int d) {
  double sum = 0;
  for (int h = 0; h < H; ++h) {
    double sse = 0, sst = 0;
    for (int i = 0; i < d; ++i) {
      double mean = 0;
      for (int64_t t = 0; t < T; ++t) mean += y[(t * H + h) * d + i] / T;
      for (int64_t t = 0; t < T; ++t) {
        const double v = y[(t * H + h) * d + i], p = y_hat[(t * H + h) * d + i];
        sse += (v - p) * (v - p);
        sst += (v - mean) * (v - mean);
      }
    }
    sum += 1 - sse / sst;
  }
  return sum / H;
}

inline double RefMeanCosine(const std::vector<double>& a, const std::vector<double>& b, int64_t T,
                            int H, int d) {
  double sum = 0;
  for (int64_t i = 0; i < T * H; ++i) sum += RefCosine(&a[i * d], &b[i * d], d);
  return sum / (T * H);
}

// Causal softmax attention weights of query (t, qh) over keys s: p[s], zero where pos[s] > pos[t].
inline std::vector<double> RefWeights(const std::vector<double>& q, const std::vector<double>& k,
                                      const std::vector<uint64_t>& pos, int64_t T, int H, int nq,
                                      int d, int64_t t, int qh) {
  const int h = qh / (nq / H);
  std::vector<double> p(T, 0.0);
  double max_score = -1e300, sum = 0;
  for (int64_t s = 0; s < T; ++s) {
    if (pos[s] > pos[t]) continue;
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += q[(t * nq + qh) * d + i] * k[(s * H + h) * d + i];
    p[s] = dot / std::sqrt(static_cast<double>(d));
    if (p[s] > max_score) max_score = p[s];
  }
  for (int64_t s = 0; s < T; ++s) {
    p[s] = pos[s] > pos[t] ? 0.0 : std::exp(p[s] - max_score);
    sum += p[s];
  }
  for (double& x : p) x /= sum;
  return p;
}

// k_true_content / k_mapped_content: keys with the target RoPE stripped (for R^2 K).
inline QualityReference RefQuality(const std::vector<double>& k_mapped,
                                   const std::vector<double>& v_mapped,
                                   const std::vector<double>& k_true,
                                   const std::vector<double>& v_true,
                                   const std::vector<double>& k_mapped_content,
                                   const std::vector<double>& k_true_content,
                                   const std::vector<double>& q, const std::vector<uint64_t>& pos,
                                   int64_t T, int H, int d, int nq) {
  QualityReference r{};
  r.r2_k = RefR2(k_mapped_content, k_true_content, T, H, d);
  r.r2_v = RefR2(v_mapped, v_true, T, H, d);
  r.cosine_k = RefMeanCosine(k_mapped, k_true, T, H, d);
  r.cosine_v = RefMeanCosine(v_mapped, v_true, T, H, d);
  if (nq == 0) return r;
  const int g = nq / H;
  double att = 0;
  for (int qh = 0; qh < nq; ++qh) {
    const int h = qh / g;
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<double> p = RefWeights(q, k_true, pos, T, H, nq, d, t, qh);
      const std::vector<double> p_hat = RefWeights(q, k_mapped, pos, T, H, nq, d, t, qh);
      std::vector<double> o(d, 0.0), o_hat(d, 0.0);
      for (int64_t s = 0; s < T; ++s) {
        for (int i = 0; i < d; ++i) {
          o[i] += p[s] * v_true[(s * H + h) * d + i];
          o_hat[i] += p_hat[s] * v_mapped[(s * H + h) * d + i];
        }
      }
      att += RefCosine(o_hat.data(), o.data(), d);
    }
  }
  r.attention_cosine = att / (T * nq);
  double ck = 0, cv = 0;
  for (int h = 0; h < H; ++h) {
    // ||Q||_F^2 and mean_t ||Q e_t||^2 over the query set of KV head h.
    double q_frob = 0, q_e = 0, e_k = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int gi = 0; gi < g; ++gi) {
        for (int i = 0; i < d; ++i) {
          const double x = q[(t * nq + h * g + gi) * d + i];
          q_frob += x * x;
        }
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> e(d);
      for (int i = 0; i < d; ++i) e[i] = k_mapped[(t * H + h) * d + i] - k_true[(t * H + h) * d + i];
      for (int64_t u = 0; u < T; ++u) {
        for (int gi = 0; gi < g; ++gi) {
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += q[(u * nq + h * g + gi) * d + i] * e[i];
          q_e += dot * dot / T;
        }
      }
      for (int i = 0; i < d; ++i) e_k += e[i] * e[i] / T;
    }
    ck += (q_e / q_frob) / (e_k / d);
    // a_s: true attention weight of token s averaged over every query of the head's group.
    std::vector<double> a(T, 0.0);
    for (int gi = 0; gi < g; ++gi) {
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<double> p = RefWeights(q, k_true, pos, T, H, nq, d, t, h * g + gi);
        for (int64_t s = 0; s < T; ++s) a[s] += p[s] / (T * g);
      }
    }
    double num = 0, den = 0, mean_e = 0;
    for (int64_t s = 0; s < T; ++s) {
      double e2 = 0;
      for (int i = 0; i < d; ++i) {
        const double e = v_mapped[(s * H + h) * d + i] - v_true[(s * H + h) * d + i];
        e2 += e * e;
      }
      num += a[s] * a[s] * e2;
      den += a[s] * a[s];
      mean_e += e2 / T;
    }
    cv += (num / den) / mean_e;
  }
  r.c_k = ck / H;
  r.c_v = cv / H;
  return r;
}

}  // namespace testing
}  // namespace kvt
