#include "fit/solve.h"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace kvt {
namespace fit {
namespace {

// Below this reciprocal condition number S_xx + lambda I is treated as singular: the solution
// would be dominated by rounding (float64 carries ~16 digits).
constexpr double kMinRcond = 1e-13;
// A feature whose variance is below this share of its scale is constant: what is left is the
// rounding of E[x^2] - E[x]^2, not signal.
constexpr double kConstantShare = 1e-10;

// Full symmetric matrix from the upper triangle dsyrk filled.
void Symmetrize(int64_t n, double* a) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < i; ++j) a[i * n + j] = a[j * n + i];
  }
}

// Second moments about (mu_r, mu_c) from raw sums over n tokens, in place on m [rows x cols]:
//   sum (x - mu_r)(y - mu_c)^T = M - s_r mu_c^T - mu_r s_c^T + n mu_r mu_c^T.
// With mu = s / n this is the usual centring; the held-out statistics are centred on the
// training means instead, which is what the fitted bias predicts from.
void Centre(int64_t rows, int64_t cols, const double* s_r, const double* s_c, double n,
            const double* mu_r, const double* mu_c, double* m) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      m[i * cols + j] += -s_r[i] * mu_c[j] - mu_r[i] * s_c[j] + n * mu_r[i] * mu_c[j];
    }
  }
}

// Residual sum of squares per output column of Y ~ X W for centred moments:
//   sse_e = Syy_ee - 2 W_e . Sxy_e + W_e^T Sxx W_e.
std::vector<double> ResidualPerColumn(int64_t d, int64_t e, const std::vector<double>& sxx,
                                      const std::vector<double>& sxy,
                                      const std::vector<double>& syy,
                                      const std::vector<double>& w) {
  std::vector<double> sxx_w(d * e);
  cblas_dsymm(CblasRowMajor, CblasLeft, CblasUpper, d, e, 1.0, sxx.data(), d, w.data(), e, 0.0,
              sxx_w.data(), e);
  std::vector<double> sse(syy);
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t c = 0; c < e; ++c) {
      sse[c] += -2.0 * w[i * e + c] * sxy[i * e + c] + w[i * e + c] * sxx_w[i * e + c];
    }
  }
  return sse;
}

}  // namespace

// Head-averaged R^2 (SPEC 4.3) of one target layer: columns [h d, (h+1) d) are head h. Heads
// whose total sum of squares is zero (a constant head) have no R^2 and are left out.
std::optional<double> HeadAveragedR2(const std::vector<double>& sse, const std::vector<double>& sst,
                                     int64_t offset, int heads, int d) {
  double total = 0;
  int counted = 0;
  for (int h = 0; h < heads; ++h) {
    double e = 0, t = 0;
    for (int i = 0; i < d; ++i) {
      e += sse[offset + h * d + i];
      t += sst[offset + h * d + i];
    }
    if (!(t > 0)) continue;
    total += 1.0 - std::max(e, 0.0) / t;
    ++counted;
  }
  if (counted == 0) return std::nullopt;
  return std::min(1.0, total / counted);
}

namespace {

// Solves (A + lambda I) W = B in place (B becomes W) by Cholesky. `a` [d x d] is consumed.
// Returns false with `why` when A + lambda I is not numerically positive definite.
bool CholeskySolve(int64_t d, int64_t e, double lambda, std::vector<double> a,
                   std::vector<double>* b, std::string* why) {
  for (int64_t i = 0; i < d; ++i) a[i * d + i] += lambda;
  const double norm = LAPACKE_dlansy(LAPACK_ROW_MAJOR, '1', 'U', d, a.data(), d);
  lapack_int info = LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'U', d, a.data(), d);
  if (info != 0) {
    *why = info > 0 ? absl::StrCat("not positive definite (Cholesky pivot ", info, " of ", d, ")")
                    : absl::StrCat("dpotrf argument ", -info, " invalid");
    return false;
  }
  double rcond = 0;
  info = LAPACKE_dpocon(LAPACK_ROW_MAJOR, 'U', d, a.data(), d, norm, &rcond);
  if (info != 0 || !(rcond >= kMinRcond)) {
    *why = absl::StrCat("numerically singular (reciprocal condition number ", rcond, ")");
    return false;
  }
  info = LAPACKE_dpotrs(LAPACK_ROW_MAJOR, 'U', d, e, a.data(), d, b->data(), e);
  if (info != 0) {
    *why = absl::StrCat("dpotrs failed (", info, ")");
    return false;
  }
  return true;
}

// Features whose variance is rounding noise next to their scale (mean^2, or the mean variance).
std::vector<bool> ConstantFeatures(const std::vector<double>& var, const std::vector<double>& mu) {
  double mean_var = 0;
  for (double v : var) mean_var += v / var.size();
  std::vector<bool> constant(var.size());
  for (size_t i = 0; i < var.size(); ++i) {
    constant[i] = var[i] <= kConstantShare * std::max(mu[i] * mu[i], mean_var);
  }
  return constant;
}

bool AllFinite(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

// The moments of one (design, response) problem gathered from a StatSet.
struct Moments {
  double n = 0;
  std::vector<double> gram;     // d x d raw X^T X (full)
  std::vector<double> cross;    // d x e raw X^T Y
  std::vector<double> sum_x;    // d
  std::vector<double> sum_y;    // e
  std::vector<double> sumsq_y;  // e
};

// Moments of target layer l's K or V on the sigma design, from the final statistics of `split`.
Moments GatherFinal(const FitShape& shape, const StatSet& stats, bool heldout, int kind, int l,
                    const std::vector<int>& sigma) {
  const int64_t ds = shape.ds(), dt = shape.dt(), k = sigma.size(), d = k * ds;
  Moments m;
  m.n = stats.at(heldout ? "heldout.n" : "train.n")[0];
  m.gram.assign(d * d, 0.0);
  m.cross.assign(d * dt, 0.0);
  const std::vector<double>& sum_x = stats.at(FinalName(heldout, kind, "sum_x"));
  for (int64_t a = 0; a < k; ++a) {
    m.sum_x.insert(m.sum_x.end(), sum_x.begin() + sigma[a] * ds,
                   sum_x.begin() + (sigma[a] + 1) * ds);
    const std::vector<double>& cross = stats.at(CrossName(heldout, kind, sigma[a], l));
    std::copy(cross.begin(), cross.end(), m.cross.begin() + a * ds * dt);
    for (int64_t b = 0; b < k; ++b) {
      const int ja = sigma[a], jb = sigma[b];
      if (ja > jb) continue;  // filled as the transpose of (b, a) below
      const std::vector<double>& block = stats.at(GramName(heldout, kind, ja, jb));
      for (int64_t r = 0; r < ds; ++r) {
        for (int64_t c = 0; c < ds; ++c) {
          // Diagonal blocks come from dsyrk: only their upper triangle is valid.
          const double value =
              (ja == jb && c < r) ? block[c * ds + r] : block[r * ds + c];
          m.gram[(a * ds + r) * d + b * ds + c] = value;
          m.gram[(b * ds + c) * d + a * ds + r] = value;
        }
      }
    }
  }
  const std::vector<double>& sum_y = stats.at(FinalName(heldout, kind, "sum_y"));
  const std::vector<double>& sumsq_y = stats.at(FinalName(heldout, kind, "sumsq_y"));
  m.sum_y.assign(sum_y.begin() + l * dt, sum_y.begin() + (l + 1) * dt);
  m.sumsq_y.assign(sumsq_y.begin() + l * dt, sumsq_y.begin() + (l + 1) * dt);
  return m;
}

// Centred (about mu_x, mu_y) versions of the moments: Sxx, Sxy and the diagonal of Syy, all
// un-normalised sums over the tokens.
struct Centred {
  std::vector<double> sxx, sxy, syy;
};
Centred CentreAbout(const Moments& m, const std::vector<double>& mu_x,
                    const std::vector<double>& mu_y) {
  const int64_t d = m.sum_x.size(), e = m.sum_y.size();
  Centred c{m.gram, m.cross, m.sumsq_y};
  Centre(d, d, m.sum_x.data(), m.sum_x.data(), m.n, mu_x.data(), mu_x.data(), c.sxx.data());
  Centre(d, e, m.sum_x.data(), m.sum_y.data(), m.n, mu_x.data(), mu_y.data(), c.sxy.data());
  for (int64_t i = 0; i < e; ++i) {
    c.syy[i] += -2.0 * m.sum_y[i] * mu_y[i] + m.n * mu_y[i] * mu_y[i];
  }
  return c;
}

std::vector<double> Means(const std::vector<double>& sums, double n) {
  std::vector<double> mu(sums);
  for (double& x : mu) x /= n;
  return mu;
}

// rows x cols sub-block of row-major m [.. x ld] at the given rows and columns.
std::vector<double> SubBlock(const std::vector<double>& m, int64_t ld,
                             const std::vector<int64_t>& rows, int64_t col0, int64_t cols) {
  std::vector<double> sub(rows.size() * cols);
  for (size_t r = 0; r < rows.size(); ++r) {
    std::copy(m.begin() + rows[r] * ld + col0, m.begin() + rows[r] * ld + col0 + cols,
              sub.begin() + r * cols);
  }
  return sub;
}

// The ridge weights from centred sums with `ridge` (lambda, sum scale) on the diagonal: one
// solve of the whole design, or per target head on the sub-blocks of its own rows (S_xx) and
// its rows x its d_t columns (S_xy), scattered into the dense layout with zeros elsewhere.
bool SolveWeights(const FitShape& shape, int64_t blocks, bool per_head, double ridge,
                  const Centred& centred, std::vector<double>* w, std::string* why) {
  const int64_t d = blocks * shape.ds(), dt = shape.dt();
  if (!per_head) {
    *w = centred.sxy;
    return CholeskySolve(d, dt, ridge, centred.sxx, w, why);
  }
  const int64_t d_t = shape.target.head_dim;
  w->assign(d * dt, 0.0);
  for (int h = 0; h < shape.target.num_kv_heads; ++h) {
    const std::vector<int64_t> rows = HeadSourceRows(shape, blocks, h);
    const int64_t in = rows.size();
    std::vector<double> sxx(in * in);
    for (int64_t r = 0; r < in; ++r) {
      for (int64_t c = 0; c < in; ++c) sxx[r * in + c] = centred.sxx[rows[r] * d + rows[c]];
    }
    std::vector<double> wh = SubBlock(centred.sxy, dt, rows, h * d_t, d_t);
    if (!CholeskySolve(in, d_t, ridge, std::move(sxx), &wh, why)) {
      *why = absl::StrCat(*why, " for target head ", h);
      return false;
    }
    for (int64_t r = 0; r < in; ++r) {
      std::copy(wh.begin() + r * d_t, wh.begin() + (r + 1) * d_t,
                w->begin() + rows[r] * dt + h * d_t);
    }
  }
  return true;
}

}  // namespace

absl::Status CheckHeadMatching(const FitShape& shape) {
  absl::Status heads = CheckHeadLocalHeads(shape.source, shape.target);
  if (heads.ok()) return heads;
  return absl::InvalidArgumentError(absl::StrCat(
      "--granularity=per_head: ", heads.message(), " (use --granularity=per_layer)"));
}


absl::StatusOr<ProbeTables> SolveProbe(const FitShape& shape, const StatSet& probe,
                                       std::vector<std::string>* warnings, bool head_local) {
  const int ls = shape.source.num_layers, lt = shape.target.num_layers;
  const int64_t ds = shape.ds(), dt = shape.dt();
  const double n = probe.at("probe.n")[0];
  if (!(n >= 2)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the probe saw ", n, " training tokens; at least 2 are needed"));
  }
  ProbeTables tables;
  tables.source_layers = ls;
  tables.target_layers = lt;
  const bool matched = shape.matched();
  // Matched: one problem per (source layer, head) predicting that head of every target layer.
  // Head-local (unmatched, for a per_head fit): one per (source layer, target head h) from h's
  // matching source heads (HeadLocalSources) predicting head h of every target layer.
  // Otherwise one per source layer (all its heads) predicting every target column.
  const bool local = head_local && !matched;
  const int groups = matched ? shape.source.num_kv_heads : local ? shape.target.num_kv_heads : 1;
  const int64_t dx = matched ? shape.source.head_dim
                     : local ? HeadSourceRows(shape, 1, 0).size()
                             : ds;
  const int64_t dy = matched || local ? shape.target.head_dim : dt;  // columns per target layer
  const int heads_per_group = matched || local ? 1 : shape.target.num_kv_heads;
  for (int c = 0; c < 2; ++c) {
    std::vector<double>& table = c == 0 ? tables.r2_k : tables.r2_v;
    table.assign(ls * lt, 0.0);
    const std::vector<double>& sum_x = probe.at(ProbeName(c, "sum_x"));
    const std::vector<double>& sum_y = probe.at(ProbeName(c, "sum_y"));
    const std::vector<double>& sumsq_y = probe.at(ProbeName(c, "sumsq_y"));
    std::vector<int> counted(ls * lt, 0);
    int constant_heads = 0;
    for (int j = 0; j < ls; ++j) {
      std::vector<double> layer_gram = probe.at(ProbeName(c, absl::StrCat("gram.", j)));
      Symmetrize(ds, layer_gram.data());
      for (int g = 0; g < groups; ++g) {
        // First column of this design within the layer, and in sum_x.
        const int64_t in_layer = local ? HeadSourceRows(shape, 1, g)[0] : g * dx;
        const int64_t x0 = j * ds + in_layer;
        Moments m;
        m.n = n;
        m.sum_x.assign(sum_x.begin() + x0, sum_x.begin() + x0 + dx);
        m.gram.resize(dx * dx);
        for (int64_t r = 0; r < dx; ++r) {
          std::copy(layer_gram.begin() + (in_layer + r) * ds + in_layer,
                    layer_gram.begin() + (in_layer + r) * ds + in_layer + dx,
                    m.gram.begin() + r * dx);
        }
        const std::vector<double>& cross =
            probe.at(matched ? ProbeName(c, absl::StrCat("cross.h", g)) : ProbeName(c, "cross"));
        const int64_t e = lt * dy;
        // Matched cross.h{g} rows are [source layer][dim], columns [target layer][dim]; the
        // unmatched cross rows are the full source columns, columns every target column (the
        // head-local problem takes head g's of each target layer).
        const int64_t row0 = matched ? j * dx : x0;
        if (local) {
          m.cross.reserve(dx * e);
          for (int64_t r = 0; r < dx; ++r) {
            for (int l = 0; l < lt; ++l) {
              const auto from = cross.begin() + (row0 + r) * lt * dt + l * dt + g * dy;
              m.cross.insert(m.cross.end(), from, from + dy);
            }
          }
        } else {
          m.cross.assign(cross.begin() + row0 * e, cross.begin() + (row0 + dx) * e);
        }
        for (int l = 0; l < lt; ++l) {
          const int64_t y0 = l * dt + (matched || local ? g * dy : 0);
          m.sum_y.insert(m.sum_y.end(), sum_y.begin() + y0, sum_y.begin() + y0 + dy);
          m.sumsq_y.insert(m.sumsq_y.end(), sumsq_y.begin() + y0, sumsq_y.begin() + y0 + dy);
        }
        const std::vector<double> mu_x = Means(m.sum_x, n), mu_y = Means(m.sum_y, n);
        Centred centred = CentreAbout(m, mu_x, mu_y);
        double mean_diag = 0;
        for (int64_t i = 0; i < dx; ++i) mean_diag += centred.sxx[i * dx + i] / dx;
        std::vector<double> w = centred.sxy;
        std::string why;
        const bool solved = mean_diag > 0 &&
                            CholeskySolve(dx, e, kProbeRidge * mean_diag, centred.sxx, &w, &why);
        if (!solved) std::fill(w.begin(), w.end(), 0.0);  // constant source: predicts nothing
        const std::vector<double> sse = ResidualPerColumn(dx, e, centred.sxx, centred.sxy,
                                                          centred.syy, w);
        for (int l = 0; l < lt; ++l) {
          for (int h = 0; h < heads_per_group; ++h) {
            std::vector<double> one_sse(sse.begin() + l * dy + h * shape.target.head_dim,
                                        sse.begin() + l * dy + (h + 1) * shape.target.head_dim);
            std::vector<double> one_sst(centred.syy.begin() + l * dy + h * shape.target.head_dim,
                                        centred.syy.begin() + l * dy +
                                            (h + 1) * shape.target.head_dim);
            std::optional<double> r2 =
                HeadAveragedR2(one_sse, one_sst, 0, 1, shape.target.head_dim);
            if (!r2.has_value()) {
              if (j == 0) ++constant_heads;
              continue;
            }
            table[j * lt + l] += *r2;
            ++counted[j * lt + l];
          }
        }
      }
    }
    for (int i = 0; i < ls * lt; ++i) {
      table[i] = counted[i] > 0 ? table[i] / counted[i] : 0.0;
    }
    if (constant_heads > 0) {
      warnings->push_back(absl::StrCat(
          "probe ", KindName(c), ": ", constant_heads,
          " target (layer, head) pairs are constant over the calibration tokens; they have no "
          "R^2 and are left out of the head average"));
    }
  }
  return tables;
}

std::vector<std::vector<int>> SelectLayers(const ProbeTables& tables, int k) {
  const int ls = tables.source_layers;
  if (k <= 0 || k > ls) k = ls;
  std::vector<std::vector<int>> sigma(tables.target_layers);
  for (int l = 0; l < tables.target_layers; ++l) {
    std::vector<int> order(ls);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return tables.score(a, l) > tables.score(b, l);  // stable: ties keep the lower index first
    });
    sigma[l].assign(order.begin(), order.begin() + k);
  }
  return sigma;
}

namespace {

// Head h's attention-weighted moments of target layer l (stats.h: "aw.*"); n is the weights' sum.
Moments GatherWeighted(const StatSet& stats, int kind, int l, int h) {
  Moments m;
  m.n = stats.at(WeightedName(kind, l, h, "n"))[0];
  m.gram = stats.at(WeightedName(kind, l, h, "gram"));
  m.cross = stats.at(WeightedName(kind, l, h, "cross"));
  m.sum_x = stats.at(WeightedName(kind, l, h, "sum_x"));
  m.sum_y = stats.at(WeightedName(kind, l, h, "sum_y"));
  m.sumsq_y = stats.at(WeightedName(kind, l, h, "sumsq_y"));
  return m;
}

// The attention-weighted head-local fit of target layer l: per head and kind, the weighted ridge
// (weighted means, lambda on the head's weighted S_xx as SolveLayer scales it) scattered into
// the dense layout; R^2 of the result on the plain statistics (EvaluateLayerR2).
absl::StatusOr<LayerFit> SolveLayerWeighted(const FitShape& shape, const StatSet& stats, int l,
                                            const std::vector<int>& sigma,
                                            const RidgeOptions& options) {
  if (stats.arrays.count(WeightedName(0, l, 0, "n")) == 0) {
    return absl::FailedPreconditionError(
        "the statistics have no attention-weighted arrays: accumulate them with "
        "--per_head_objective=attention_weighted");
  }
  const int64_t dt = shape.dt(), d_t = shape.target.head_dim;
  const int64_t d = sigma.size() * shape.ds();
  LayerFit fit;
  for (int c = 0; c < 2; ++c) {
    std::vector<double> w(d * dt, 0.0), b(dt, 0.0);
    for (int h = 0; h < shape.target.num_kv_heads; ++h) {
      const Moments m = GatherWeighted(stats, c, l, h);
      const std::string what = absl::StrCat("target layer ", l, " ", c == 0 ? "K" : "V",
                                            " head ", h, " (attention-weighted)");
      if (!(m.n > 0)) return absl::FailedPreconditionError(absl::StrCat(what, ": no weight"));
      const int64_t in = m.sum_x.size();
      const std::vector<double> mu_x = Means(m.sum_x, m.n), mu_y = Means(m.sum_y, m.n);
      Centred centred = CentreAbout(m, mu_x, mu_y);
      std::vector<double> var(in);
      for (int64_t i = 0; i < in; ++i) var[i] = centred.sxx[i * in + i] / m.n;
      const std::vector<bool> constant = ConstantFeatures(var, mu_x);
      for (int64_t i = 0; i < in; ++i) {
        if (!constant[i]) continue;
        for (int64_t t = 0; t < in; ++t) centred.sxx[i * in + t] = centred.sxx[t * in + i] = 0;
        for (int64_t t = 0; t < d_t; ++t) centred.sxy[i * d_t + t] = 0;
      }
      const double lambda = options.scale == LambdaScale::kCovariance
                                ? options.lambda * m.n
                                : options.lambda * m.n / stats.at("train.n")[0];
      std::vector<double> wh = centred.sxy;
      std::string why;
      if (!CholeskySolve(in, d_t, lambda, centred.sxx, &wh, &why)) {
        return absl::FailedPreconditionError(
            absl::StrCat(what, ": S_xx + lambda I is ", why, "; use a larger --lambda"));
      }
      const std::vector<int64_t> rows = HeadSourceRows(shape, sigma.size(), h);
      for (int64_t e = 0; e < d_t; ++e) {
        double bias = mu_y[e];
        for (int64_t r = 0; r < in; ++r) {
          w[rows[r] * dt + h * d_t + e] = wh[r * d_t + e];
          bias -= mu_x[r] * wh[r * d_t + e];
        }
        b[h * d_t + e] = bias;
      }
    }
    if (!AllFinite(w) || !AllFinite(b)) {
      return absl::InternalError(absl::StrCat("target layer ", l, ": the attention-weighted "
                                              "solution is not finite"));
    }
    (c == 0 ? fit.w_k : fit.w_v) = std::move(w);
    (c == 0 ? fit.b_k : fit.b_v) = std::move(b);
  }
  EvaluateLayerR2(shape, stats, l, sigma, &fit);
  return fit;
}

}  // namespace

absl::StatusOr<LayerFit> SolveLayer(const FitShape& shape, const StatSet& final_stats, int l,
                                    const std::vector<int>& sigma, const RidgeOptions& options) {
  const int64_t ds = shape.ds(), dt = shape.dt(), d = sigma.size() * ds;
  if (options.per_head) {
    absl::Status matched = CheckHeadMatching(shape);
    if (!matched.ok()) return matched;
    if (options.attention_weighted) {
      return SolveLayerWeighted(shape, final_stats, l, sigma, options);
    }
  }
  LayerFit fit;
  for (int c = 0; c < 2; ++c) {
    const std::string what = absl::StrCat("target layer ", l, " ", c == 0 ? "K" : "V");
    const Moments train = GatherFinal(shape, final_stats, false, c, l, sigma);
    const double n = train.n;
    if (!(n >= 1)) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": no training tokens"));
    }
    const std::vector<double> mu_x = Means(train.sum_x, n), mu_y = Means(train.sum_y, n);
    Centred centred = CentreAbout(train, mu_x, mu_y);
    // Constant features: their centred row and column are rounding noise; make them exact zeros
    // so that with lambda > 0 their weights are exactly 0 and with lambda = 0 the Gram is
    // honestly singular.
    std::vector<double> var(d);
    for (int64_t i = 0; i < d; ++i) var[i] = centred.sxx[i * d + i] / n;
    const std::vector<bool> is_constant = ConstantFeatures(var, mu_x);
    int constant = 0;
    for (int64_t i = 0; i < d; ++i) {
      if (!is_constant[i]) continue;
      ++constant;
      for (int64_t t = 0; t < d; ++t) centred.sxx[i * d + t] = centred.sxx[t * d + i] = 0;
      for (int64_t t = 0; t < dt; ++t) centred.sxy[i * dt + t] = 0;
    }
    const double lambda =
        options.scale == LambdaScale::kCovariance ? options.lambda : options.lambda / n;
    const std::string facts = absl::StrCat(n, " training tokens, ", d, " features (", sigma.size(),
                                           " source layers", options.per_head ? ", per head" : "",
                                           "), ", constant, " constant features, "
                                           "lambda ", options.lambda, " (",
                                           LambdaScaleName(options.scale), " scale)");
    const int64_t design =
        options.per_head ? static_cast<int64_t>(HeadSourceRows(shape, sigma.size(), 0).size()) : d;
    if (lambda == 0 && (constant > 0 || n <= design)) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": S_xx is singular (", facts,
          "): with lambda = 0 the ridge has no unique solution; use --lambda > 0"));
    }
    // Covariance scale: S_xx = sums / n, so solve with sums and lambda n.
    std::vector<double> w;
    std::string why;
    if (!SolveWeights(shape, sigma.size(), options.per_head, lambda * n, centred, &w, &why)) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": S_xx + lambda I is ", why, " (", facts, "); use a larger --lambda"));
    }
    std::vector<double> b(mu_y);
    cblas_dgemv(CblasRowMajor, CblasTrans, d, dt, -1.0, w.data(), dt, mu_x.data(), 1, 1.0,
                b.data(), 1);
    if (!AllFinite(w) || !AllFinite(b)) {
      return absl::InternalError(absl::StrCat(what, ": the solution is not finite (", facts, ")"));
    }
    const int heads = shape.target.num_kv_heads, hd = shape.target.head_dim;
    const std::vector<double> sse =
        ResidualPerColumn(d, dt, centred.sxx, centred.sxy, centred.syy, w);
    (c == 0 ? fit.r2_k : fit.r2_v) = HeadAveragedR2(sse, centred.syy, 0, heads, hd);
    const Moments held = GatherFinal(shape, final_stats, true, c, l, sigma);
    if (held.n >= 1) {
      // Held-out residuals y - b - x W = (y - mu_y) - (x - mu_x) W: centre on the training means.
      Centred about_train = CentreAbout(held, mu_x, mu_y);
      const std::vector<double> held_sse =
          ResidualPerColumn(d, dt, about_train.sxx, about_train.sxy, about_train.syy, w);
      std::vector<double> held_sst(dt);
      for (int64_t i = 0; i < dt; ++i) {
        held_sst[i] = held.sumsq_y[i] - held.sum_y[i] * held.sum_y[i] / held.n;
      }
      (c == 0 ? fit.r2_k_heldout : fit.r2_v_heldout) =
          HeadAveragedR2(held_sse, held_sst, 0, heads, hd);
    }
    (c == 0 ? fit.w_k : fit.w_v) = std::move(w);
    (c == 0 ? fit.b_k : fit.b_v) = std::move(b);
  }
  return fit;
}

void EvaluateLayerR2(const FitShape& shape, const StatSet& final_stats, int l,
                     const std::vector<int>& sigma, LayerFit* fit) {
  const int64_t dt = shape.dt(), d = static_cast<int64_t>(sigma.size()) * shape.ds();
  const int heads = shape.target.num_kv_heads, hd = shape.target.head_dim;
  for (int c = 0; c < 2; ++c) {
    const std::vector<double>& w = c == 0 ? fit->w_k : fit->w_v;
    const std::vector<double>& b = c == 0 ? fit->b_k : fit->b_v;
    const Moments train = GatherFinal(shape, final_stats, false, c, l, sigma);
    if (!(train.n >= 1)) continue;
    const std::vector<double> mu_x = Means(train.sum_x, train.n), mu_y = Means(train.sum_y, train.n);
    // About the training means, y - b - x W = (y~ - x~ W) + delta, delta = mu_y - mu_x W - b:
    //   sse_e = sum (y~ - x~ W)_e^2 + 2 delta_e sum (y~ - x~ W)_e + n delta_e^2.
    std::vector<double> delta(mu_y);
    cblas_dgemv(CblasRowMajor, CblasTrans, d, dt, -1.0, w.data(), dt, mu_x.data(), 1, 1.0,
                delta.data(), 1);
    for (int64_t e = 0; e < dt; ++e) delta[e] -= b[e];
    for (bool heldout : {false, true}) {
      const Moments m = heldout ? GatherFinal(shape, final_stats, true, c, l, sigma) : train;
      if (!(m.n >= 1)) continue;
      const Centred about = CentreAbout(m, mu_x, mu_y);
      std::vector<double> sse = ResidualPerColumn(d, dt, about.sxx, about.sxy, about.syy, w);
      std::vector<double> sum_r(dt), sum_x(d);
      for (int64_t e = 0; e < dt; ++e) sum_r[e] = m.sum_y[e] - m.n * mu_y[e];
      for (int64_t i = 0; i < d; ++i) sum_x[i] = m.sum_x[i] - m.n * mu_x[i];
      cblas_dgemv(CblasRowMajor, CblasTrans, d, dt, -1.0, w.data(), dt, sum_x.data(), 1, 1.0,
                  sum_r.data(), 1);
      std::vector<double> sst(dt);
      for (int64_t e = 0; e < dt; ++e) {
        sse[e] += 2.0 * delta[e] * sum_r[e] + m.n * delta[e] * delta[e];
        sst[e] = m.sumsq_y[e] - m.sum_y[e] * m.sum_y[e] / m.n;
      }
      std::optional<double> r2 = HeadAveragedR2(sse, sst, 0, heads, hd);
      if (heldout) {
        (c == 0 ? fit->r2_k_heldout : fit->r2_v_heldout) = r2;
      } else {
        (c == 0 ? fit->r2_k : fit->r2_v) = r2;
      }
    }
  }
}

std::vector<std::string> DegenerateInputWarnings(const FitShape& shape, const StatSet& final_stats,
                                                 const std::vector<std::vector<int>>& sigma) {
  std::vector<std::string> warnings;
  const double n = final_stats.at("train.n")[0];
  const int64_t ds = shape.ds();
  for (int c = 0; c < 2; ++c) {
    const std::vector<double>& sum = final_stats.at(FinalName(false, c, "sum_x"));
    const std::vector<double>& sumsq = final_stats.at(FinalName(false, c, "sumsq_x"));
    for (int j = 0; j < shape.source.num_layers; ++j) {
      std::vector<double> mu(ds), var(ds);
      for (int64_t i = 0; i < ds; ++i) {
        mu[i] = sum[j * ds + i] / n;
        var[i] = std::max(0.0, sumsq[j * ds + i] / n - mu[i] * mu[i]);
      }
      const std::vector<bool> constant = ConstantFeatures(var, mu);
      const int64_t count = std::count(constant.begin(), constant.end(), true);
      if (count == 0) continue;
      warnings.push_back(absl::StrCat(
          "source layer ", j, " ", c == 0 ? "K" : "V", ": ", count, " of ", ds,
          " features are constant over the training tokens (first: head ",
          (std::find(constant.begin(), constant.end(), true) - constant.begin()) /
              shape.source.head_dim,
          " dim ",
          (std::find(constant.begin(), constant.end(), true) - constant.begin()) %
              shape.source.head_dim,
          "); they get weight 0"));
    }
  }
  size_t widest = 0;
  for (const std::vector<int>& s : sigma) widest = std::max(widest, s.size());
  if (n <= static_cast<double>(widest * ds)) {
    warnings.push_back(absl::StrCat(
        "only ", n, " training tokens for ", widest * ds,
        " features per design: the fit is determined by lambda; expect a poor held-out R^2 "
        "(more sequences, a smaller stride or a smaller k)"));
  }
  return warnings;
}

}  // namespace fit
}  // namespace kvt
