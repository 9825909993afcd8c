// Head-local ridge (`kvt fit --granularity per_head`): the per-head closed form from the
// sub-blocks of the layer's statistics against a float64 reference on fresh random rows.
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/testing/test_seed.h"
#include "fit/solve.h"
#include "fit/stats.h"
#include "gtest/gtest.h"
#include "kernels/mapper_view.h"

namespace kvt {
namespace fit {
namespace {

// Solves a x = b in place (b [n, e] becomes x) by Gaussian elimination with partial pivoting:
// the reference, independent of the fit's Cholesky.
void GaussSolve(int64_t n, int64_t e, std::vector<double> a, std::vector<double>* b) {
  for (int64_t c = 0; c < n; ++c) {
    int64_t p = c;
    for (int64_t r = c + 1; r < n; ++r) {
      if (std::abs(a[r * n + c]) > std::abs(a[p * n + c])) p = r;
    }
    for (int64_t k = 0; k < n; ++k) std::swap(a[c * n + k], a[p * n + k]);
    for (int64_t k = 0; k < e; ++k) std::swap((*b)[c * e + k], (*b)[p * e + k]);
    for (int64_t r = 0; r < n; ++r) {
      if (r == c) continue;
      const double f = a[r * n + c] / a[c * n + c];
      for (int64_t k = 0; k < n; ++k) a[r * n + k] -= f * a[c * n + k];
      for (int64_t k = 0; k < e; ++k) (*b)[r * e + k] -= f * (*b)[c * e + k];
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < e; ++k) (*b)[r * e + k] /= a[r * n + r];
  }
}

struct Reference {
  std::vector<double> w, b;  // one head: [in_h, d_t], [d_t]
};

// Head h of target layer l's map of `kind` from the rows themselves: gather head h's source
// columns of the sigma blocks (HeadSourceRows order), centre, (X^T X + lambda n I) W = X^T Y.
Reference ReferenceHead(const FitShape& shape, const FeatureRows& rows, int kind, int l,
                        const std::vector<int>& sigma, int h, double lambda) {
  const int64_t n = rows.rows, ds = shape.ds(), dt = shape.dt(), d_t = shape.target.head_dim;
  const HeadSources src = SourceHeadsOf(shape.source.num_kv_heads, shape.target.num_kv_heads, h);
  const int64_t d_s = shape.source.head_dim, in = sigma.size() * src.count * d_s;
  const std::vector<double>& xs = kind == 0 ? rows.source_k : rows.source_v;
  const std::vector<double>& ys = kind == 0 ? rows.target_k : rows.target_v;
  std::vector<double> x(n * in), y(n * d_t), mx(in, 0.0), my(d_t, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    int64_t c = 0;
    for (int j : sigma) {
      for (int64_t i = src.first * d_s; i < (src.first + src.count) * d_s; ++i) {
        x[t * in + c++] = xs[t * rows.source_cols + j * ds + i];
      }
    }
    for (int64_t e = 0; e < d_t; ++e) y[t * d_t + e] = ys[t * rows.target_cols + l * dt + h * d_t + e];
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < in; ++i) mx[i] += x[t * in + i] / n;
    for (int64_t e = 0; e < d_t; ++e) my[e] += y[t * d_t + e] / n;
  }
  std::vector<double> a(in * in, 0.0), w(in * d_t, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < in; ++i) {
      const double xi = x[t * in + i] - mx[i];
      for (int64_t k = 0; k < in; ++k) a[i * in + k] += xi * (x[t * in + k] - mx[k]);
      for (int64_t e = 0; e < d_t; ++e) w[i * d_t + e] += xi * (y[t * d_t + e] - my[e]);
    }
  }
  for (int64_t i = 0; i < in; ++i) a[i * in + i] += lambda * n;
  GaussSolve(in, d_t, a, &w);
  Reference ref{w, my};
  for (int64_t e = 0; e < d_t; ++e) {
    for (int64_t i = 0; i < in; ++i) ref.b[e] -= mx[i] * w[i * d_t + e];
  }
  return ref;
}

FeatureRows RandomRows(const FitShape& shape, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  FeatureRows rows;
  rows.Reset(shape.source_blocks() * shape.ds(), shape.target.num_layers * shape.dt());
  rows.Resize(n);
  for (auto* m : {&rows.source_k, &rows.source_v}) {
    for (int64_t i = 0; i < n * rows.source_cols; ++i) (*m)[i] = 0.3 + normal(rng);
  }
  // Targets: a dense linear map of the sources plus noise (per_head fits the head-local part).
  for (int kind = 0; kind < 2; ++kind) {
    const std::vector<double>& x = kind == 0 ? rows.source_k : rows.source_v;
    std::vector<double>& y = kind == 0 ? rows.target_k : rows.target_v;
    std::vector<double> w(rows.source_cols * rows.target_cols);
    for (double& v : w) v = normal(rng) / std::sqrt(static_cast<double>(rows.source_cols));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < rows.target_cols; ++c) {
        double v = 0.5 * normal(rng) - 0.2;
        for (int64_t i = 0; i < rows.source_cols; ++i) {
          v += x[t * rows.source_cols + i] * w[i * rows.target_cols + c];
        }
        y[t * rows.target_cols + c] = v;
      }
    }
  }
  return rows;
}

struct HeadCase {
  int source_heads, source_dim, target_heads, target_dim;
};

class PerHeadSolveTest : public ::testing::TestWithParam<HeadCase> {};

TEST_P(PerHeadSolveTest, EqualsFloat64ReferenceOnFreshRandomRows) {
  const HeadCase c = GetParam();
  const FitShape shape{NeoxModelSpec("test/src", 3, c.source_heads, c.source_dim, 10000),
                       NeoxModelSpec("test/dst", 2, c.target_heads, c.target_dim, 10000)};
  const std::vector<std::vector<int>> sigma = {{2, 0}, {1}};
  const FeatureRows train = RandomRows(shape, 300, testing::FreshSeed("train rows"));
  const FeatureRows held = RandomRows(shape, 60, testing::FreshSeed("held-out rows"));
  FinalAccumulator accumulator(shape, BlockPlan::FromSigma(sigma));
  accumulator.Add(train, false);
  accumulator.Add(held, true);
  const StatSet& stats = accumulator.stats();
  for (LambdaScale scale : {LambdaScale::kCovariance, LambdaScale::kSum}) {
    RidgeOptions options;
    options.per_head = true;
    options.scale = scale;
    options.lambda = scale == LambdaScale::kCovariance ? 0.05 : 0.05 * train.rows;
    for (int l = 0; l < 2; ++l) {
      SCOPED_TRACE(::testing::Message() << "layer " << l << " scale " << LambdaScaleName(scale));
      absl::StatusOr<LayerFit> fit = SolveLayer(shape, stats, l, sigma[l], options);
      ASSERT_TRUE(fit.ok()) << fit.status();
      const int64_t dt = shape.dt(), d_t = c.target_dim;
      for (int kind = 0; kind < 2; ++kind) {
        const std::vector<double>& w = kind == 0 ? fit->w_k : fit->w_v;
        const std::vector<double>& b = kind == 0 ? fit->b_k : fit->b_v;
        ASSERT_EQ(w.size(), sigma[l].size() * shape.ds() * dt);
        std::vector<char> in_head(w.size(), 0);
        for (int h = 0; h < c.target_heads; ++h) {
          const Reference ref = ReferenceHead(shape, train, kind, l, sigma[l], h, 0.05);
          const std::vector<int64_t> rows = HeadSourceRows(shape, sigma[l].size(), h);
          ASSERT_EQ(rows.size() * d_t, ref.w.size());
          for (size_t r = 0; r < rows.size(); ++r) {
            for (int64_t e = 0; e < d_t; ++e) {
              const int64_t at = rows[r] * dt + h * d_t + e;
              EXPECT_NEAR(w[at], ref.w[r * d_t + e], 1e-10) << "head " << h << " row " << r;
              in_head[at] = 1;
            }
          }
          for (int64_t e = 0; e < d_t; ++e) EXPECT_NEAR(b[h * d_t + e], ref.b[e], 1e-10);
        }
        for (size_t i = 0; i < w.size(); ++i) {
          if (!in_head[i]) {
            ASSERT_EQ(w[i], 0.0) << "outside the heads at " << i;
          }
        }
      }
      // R^2 of the head-local map is its own (EvaluateLayerR2 recomputes the same).
      LayerFit again = *fit;
      EvaluateLayerR2(shape, stats, l, sigma[l], &again);
      EXPECT_NEAR(*again.r2_k, *fit->r2_k, 1e-9);
      EXPECT_NEAR(*again.r2_v_heldout, *fit->r2_v_heldout, 1e-9);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HeadCounts, PerHeadSolveTest,
                         ::testing::Values(HeadCase{2, 4, 2, 3},   // one source head each
                                           HeadCase{4, 3, 2, 4},   // g = 2 source heads each
                                           HeadCase{2, 4, 4, 2}),  // two target heads share one
                         [](const ::testing::TestParamInfo<HeadCase>& info) {
                           return absl::StrCat("s", info.param.source_heads, "t",
                                               info.param.target_heads);
                         });

TEST(PerHeadMatchingTest, RefusesHeadCountsThatDoNotDivide) {
  const FitShape shape{NeoxModelSpec("test/src", 2, 3, 4, 10000),
                       NeoxModelSpec("test/dst", 2, 2, 4, 10000)};
  const FeatureRows rows = RandomRows(shape, 50, testing::FreshSeed("rows"));
  FinalAccumulator accumulator(shape, BlockPlan::FromSigma({{0}, {1}}));
  accumulator.Add(rows, false);
  RidgeOptions options;
  options.per_head = true;
  absl::StatusOr<LayerFit> fit = SolveLayer(shape, accumulator.stats(), 0, {0}, options);
  ASSERT_FALSE(fit.ok());
  EXPECT_EQ(fit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(fit.status().message().find("--granularity=per_head"), std::string::npos);
  EXPECT_NE(fit.status().message().find("source has 3 and the target 2"), std::string::npos);
}

}  // namespace
}  // namespace fit
}  // namespace kvt
