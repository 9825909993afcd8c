// Head-local ridge (`kvt fit --granularity per_head`): the per-head closed form from the
// sub-blocks of the layer's statistics against a float64 reference on fresh random rows; on
// synthetic families a head-local truth is recovered and written compact, a dense truth makes
// per_head lose, and `--granularity both` recommends accordingly.
#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/testing/test_seed.h"
#include "fit/fit.h"
#include "fit/fit_internal.h"
#include "fit/refine.h"
#include "fit/solve.h"
#include "fit/stats.h"
#include "fit/synthetic_family.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/mapper_view.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"

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
// `weights` (optional, [L_t][n_t][rows]): the attention-weighted objective, each row's squared
// residual weighted (weighted means, lambda on the weighted sums' scale: lambda sum(w)).
Reference ReferenceHead(const FitShape& shape, const FeatureRows& rows, int kind, int l,
                        const std::vector<int>& sigma, int h, double lambda,
                        const std::vector<double>* weights = nullptr) {
  const int64_t n = rows.rows, ds = shape.ds(), dt = shape.dt(), d_t = shape.target.head_dim;
  // The pairing written out here, independent of the fit's: g = max(1, n_s / n_t) source heads
  // from h n_s / n_t on.
  const int ns = shape.source.num_kv_heads, nt = shape.target.num_kv_heads;
  const int first = h * ns / nt, count = std::max(1, ns / nt);
  const int64_t d_s = shape.source.head_dim, in = sigma.size() * count * d_s;
  const std::vector<double>& xs = kind == 0 ? rows.source_k : rows.source_v;
  const std::vector<double>& ys = kind == 0 ? rows.target_k : rows.target_v;
  std::vector<double> x(n * in), y(n * d_t), mx(in, 0.0), my(d_t, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    int64_t c = 0;
    for (int j : sigma) {
      for (int64_t i = first * d_s; i < (first + count) * d_s; ++i) {
        x[t * in + c++] = xs[t * rows.source_cols + j * ds + i];
      }
    }
    for (int64_t e = 0; e < d_t; ++e) y[t * d_t + e] = ys[t * rows.target_cols + l * dt + h * d_t + e];
  }
  std::vector<double> r(n, 1.0);  // each row's weight
  if (weights != nullptr) {
    for (int64_t t = 0; t < n; ++t) r[t] = (*weights)[(int64_t{l} * nt + h) * n + t];
  }
  double total = 0;
  for (double v : r) total += v;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < in; ++i) mx[i] += r[t] * x[t * in + i] / total;
    for (int64_t e = 0; e < d_t; ++e) my[e] += r[t] * y[t * d_t + e] / total;
  }
  std::vector<double> a(in * in, 0.0), w(in * d_t, 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < in; ++i) {
      const double xi = r[t] * (x[t * in + i] - mx[i]);
      for (int64_t k = 0; k < in; ++k) a[i * in + k] += xi * (x[t * in + k] - mx[k]);
      for (int64_t e = 0; e < d_t; ++e) w[i * d_t + e] += xi * (y[t * d_t + e] - my[e]);
    }
  }
  for (int64_t i = 0; i < in; ++i) a[i * in + i] += lambda * total;
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
  const FeatureRows train = RandomRows(shape, 300, ::kvt::testing::FreshSeed("train rows"));
  const FeatureRows held = RandomRows(shape, 60, ::kvt::testing::FreshSeed("held-out rows"));
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

// The attention-weighted objective: HeadWeightedAccumulator's sums and the weighted solve against
// the weighted float64 reference, on fresh random rows and random positive weights.
TEST_P(PerHeadSolveTest, AttentionWeightedEqualsFloat64Reference) {
  const HeadCase c = GetParam();
  const FitShape shape{NeoxModelSpec("test/src", 3, c.source_heads, c.source_dim, 10000),
                       NeoxModelSpec("test/dst", 2, c.target_heads, c.target_dim, 10000)};
  const std::vector<std::vector<int>> sigma = {{2, 0}, {1}};
  const FeatureRows train = RandomRows(shape, 300, ::kvt::testing::FreshSeed("train rows"));
  std::mt19937_64 rng(::kvt::testing::FreshSeed("weights"));
  std::normal_distribution<double> normal;
  std::vector<double> weights(2 * c.target_heads * train.rows);
  for (double& w : weights) w = std::exp(normal(rng));
  FinalAccumulator plain(shape, BlockPlan::FromSigma(sigma));
  plain.Add(train, false);
  HeadWeightedAccumulator weighted(shape, sigma);
  weighted.Add(train, weights);
  StatSet stats = plain.stats();
  for (auto& [name, values] : weighted.stats().arrays) stats.arrays[name] = values;
  RidgeOptions options;
  options.per_head = true;
  options.attention_weighted = true;
  options.lambda = 0.05;
  const int64_t dt = shape.dt(), d_t = c.target_dim;
  for (int l = 0; l < 2; ++l) {
    absl::StatusOr<LayerFit> fit = SolveLayer(shape, stats, l, sigma[l], options);
    ASSERT_TRUE(fit.ok()) << fit.status();
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<double>& w = kind == 0 ? fit->w_k : fit->w_v;
      const std::vector<double>& b = kind == 0 ? fit->b_k : fit->b_v;
      for (int h = 0; h < c.target_heads; ++h) {
        const Reference ref = ReferenceHead(shape, train, kind, l, sigma[l], h, 0.05, &weights);
        const std::vector<int64_t> rows = HeadSourceRows(shape, sigma[l].size(), h);
        for (size_t r = 0; r < rows.size(); ++r) {
          for (int64_t e = 0; e < d_t; ++e) {
            EXPECT_NEAR(w[rows[r] * dt + h * d_t + e], ref.w[r * d_t + e], 1e-10);
          }
        }
        for (int64_t e = 0; e < d_t; ++e) EXPECT_NEAR(b[h * d_t + e], ref.b[e], 1e-10);
      }
    }
    ASSERT_TRUE(fit->r2_k.has_value());  // R^2 of the weighted map on the plain statistics
  }
}

// The head-local probe: R^2 of target head h of layer l on its matching source heads of layer
// j, averaged over heads, against the reference's least squares (the probe's ridge is 1e-6 of
// the mean variance: R^2 agrees to 1e-5), for shapes the plain probe does not match.
TEST_P(PerHeadSolveTest, HeadLocalProbeEqualsFloat64Reference) {
  const HeadCase c = GetParam();
  const FitShape shape{NeoxModelSpec("test/src", 3, c.source_heads, c.source_dim, 10000),
                       NeoxModelSpec("test/dst", 2, c.target_heads, c.target_dim, 10000)};
  if (shape.matched()) GTEST_SKIP() << "matched shapes: the usual probe is head-local";
  const FeatureRows rows = RandomRows(shape, 300, ::kvt::testing::FreshSeed("rows"));
  ProbeAccumulator accumulator(shape);
  accumulator.Add(rows);
  std::vector<std::string> warnings;
  absl::StatusOr<ProbeTables> tables =
      SolveProbe(shape, accumulator.stats(), &warnings, /*head_local=*/true);
  ASSERT_TRUE(tables.ok()) << tables.status();
  const int64_t n = rows.rows, dt = shape.dt(), ds = shape.ds(), d_t = c.target_dim;
  const int ns = c.source_heads, nt = c.target_heads, d_s = c.source_dim;
  for (int kind = 0; kind < 2; ++kind) {
    const std::vector<double>& xs = kind == 0 ? rows.source_k : rows.source_v;
    const std::vector<double>& ys = kind == 0 ? rows.target_k : rows.target_v;
    for (int j = 0; j < 3; ++j) {
      for (int l = 0; l < 2; ++l) {
        double r2 = 0;
        for (int h = 0; h < nt; ++h) {
          const Reference ref = ReferenceHead(shape, rows, kind, l, {j}, h, 0.0);
          const int first = h * ns / nt, count = std::max(1, ns / nt);
          double sse = 0, sst = 0;
          for (int64_t e = 0; e < d_t; ++e) {
            const int64_t col = l * dt + h * d_t + e;
            double mean = 0;
            for (int64_t t = 0; t < n; ++t) mean += ys[t * rows.target_cols + col] / n;
            for (int64_t t = 0; t < n; ++t) {
              const double y = ys[t * rows.target_cols + col];
              double fit = ref.b[e];
              for (int64_t i = 0; i < count * d_s; ++i) {
                fit += xs[t * rows.source_cols + j * ds + first * d_s + i] * ref.w[i * d_t + e];
              }
              sse += (y - fit) * (y - fit);
              sst += (y - mean) * (y - mean);
            }
          }
          r2 += (1 - sse / sst) / nt;
        }
        const std::vector<double>& table = kind == 0 ? tables->r2_k : tables->r2_v;
        EXPECT_NEAR(table[j * 2 + l], r2, 1e-5) << "kind " << kind << " j " << j << " l " << l;
      }
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
  const FeatureRows rows = RandomRows(shape, 50, ::kvt::testing::FreshSeed("rows"));
  FinalAccumulator accumulator(shape, BlockPlan::FromSigma({{0}, {1}}));
  accumulator.Add(rows, false);
  RidgeOptions options;
  options.per_head = true;
  absl::StatusOr<LayerFit> fit = SolveLayer(shape, accumulator.stats(), 0, {0}, options);
  ASSERT_FALSE(fit.ok());
  EXPECT_EQ(fit.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(fit.status().message().find("--granularity=per_head"), std::string::npos);
  EXPECT_NE(fit.status().message().find("source.num_kv_heads=3 and target.num_kv_heads=2"),
            std::string::npos);
}

// 2 KV heads x 8 dims on both sides, every target layer fed by two source layers; the target
// dumps carry queries. `head_local`: the truth maps head h from source head h only.
testing::FamilyOptions HeadFamily(bool head_local, uint64_t seed) {
  testing::FamilyOptions o;
  o.source = NeoxModelSpec("test/src-4l", 4, 2, 8, 10000);
  o.target = NeoxModelSpec("test/dst-3l", 3, 2, 8, 500000);
  o.true_sigma = {{3, 0}, {1, 2}, {2, 3}};
  o.noise_share = 0.05;
  o.query_group = 2;
  o.head_local = head_local;
  o.seed = seed;
  return o;
}

FitOptions HeadOptions(const testing::Family& family, const std::string& dir) {
  FitOptions options;
  for (auto [model, spec] : {std::pair{&options.source, &family.options.source},
                             std::pair{&options.target, &family.options.target}}) {
    absl::StatusOr<FitModel> m = FitModelFromJson(testing::HfConfigJson(*spec), "", "config");
    EXPECT_TRUE(m.ok()) << m.status();
    *model = *m;
  }
  absl::StatusOr<std::vector<SequencePair>> pairs =
      PairsFromDirs(JoinPath(dir, "source"), JoinPath(dir, "target"));
  EXPECT_TRUE(pairs.ok()) << pairs.status();
  options.sequences = *pairs;
  options.heldout_fraction = 0.25;
  options.heldout_split = HeldoutSplit::kTail;
  AssignHeldout(options.heldout_fraction, options.seed, &options.sequences, HeldoutSplit::kTail);
  options.stride = 1;
  options.k = 2;
  options.solve.ridge.lambda = 1e-4;
  options.solve.weight_dtype = DType::kFP32;
  options.solve.show_progress = false;
  options.num_threads = 1;
  return options;
}

class PerHeadFamilyTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    for (int i = 0; i < 2; ++i) {
      families_[i] = new testing::Family(testing::MakeFamily(HeadFamily(i == 0, 31 + i)));
      dirs_[i] = new std::string(::kvt::testing::MakeTempDir(i == 0 ? "head_local" : "dense"));
      ASSERT_TRUE(
          testing::WriteSequences(*families_[i], *dirs_[i], 0, 16, 64, DType::kFP32).ok());
    }
  }
  static testing::Family* families_[2];  // head-local truth, dense truth
  static std::string* dirs_[2];
};
testing::Family* PerHeadFamilyTest::families_[2] = {nullptr, nullptr};
std::string* PerHeadFamilyTest::dirs_[2] = {nullptr, nullptr};

// The stored per_head weights of layer l, K or V, [n_t, in_h, d_t], against the truth's head
// blocks (rows of the dense truth at HeadSourceRows x the head's columns).
double HeadWeightError(const LoadedMapper& mapper, const testing::Family& family, int l,
                       char kv) {
  const TensorInfo* info = mapper.weights().Find(absl::StrCat("layers.", l, ".", std::string(1, kv), ".weight"));
  EXPECT_NE(info, nullptr);
  if (info == nullptr) return 1e9;
  const FitShape shape{family.options.source, family.options.target};
  const std::vector<double>& truth = kv == 'k' ? family.w_k[l] : family.w_v[l];
  const int64_t dt = shape.dt(), d_t = shape.target.head_dim;
  double diff = 0, norm = 0;
  int64_t i = 0;
  for (int h = 0; h < shape.target.num_kv_heads; ++h) {
    for (int64_t row : HeadSourceRows(shape, 2, h)) {
      for (int64_t e = 0; e < d_t; ++e, ++i) {
        const double want = truth[row * dt + h * d_t + e];
        const double got = LoadAsDouble(info->spec.dtype, mapper.weights().data(*info).data(), i);
        diff += (got - want) * (got - want);
        norm += want * want;
      }
    }
  }
  EXPECT_EQ(i, info->spec.num_elements());
  return std::sqrt(diff / norm);
}

TEST_F(PerHeadFamilyTest, HeadLocalTruthIsRecoveredWrittenCompactAndRecommended) {
  const testing::Family& family = *families_[0];
  const FitOptions options = HeadOptions(family, *dirs_[0]);
  const std::string out = ::kvt::testing::MakeTempDir("granularity_head_local");
  absl::StatusOr<GranularityResult> both = RunFitGranularityBoth(options, out);
  ASSERT_TRUE(both.ok()) << both.status();
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper =
      LoadMapperDir(both->per_head.mapper_dir);
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  const Manifest& m = (*mapper)->manifest();
  EXPECT_EQ(m.ridge_granularity, RidgeGranularity::kPerHead);
  for (int l = 0; l < family.options.target.num_layers; ++l) {
    ASSERT_EQ(m.layers[l].sigma_k, family.options.true_sigma[l]);
    EXPECT_LT(HeadWeightError(**mapper, family, l, 'k'), 0.05) << "layer " << l;
    EXPECT_LT(HeadWeightError(**mapper, family, l, 'v'), 0.05) << "layer " << l;
  }
  // n_t = 2 times fewer weight-matrix bytes than the per_layer mapper of the same sigma.
  const int64_t head_bytes = MapperWeightBytes(m);
  absl::StatusOr<std::unique_ptr<LoadedMapper>> dense =
      LoadMapperDir(both->per_layer.mapper_dir);
  ASSERT_TRUE(dense.ok()) << dense.status();
  const int64_t bias_bytes = 3 * 2 * 16 * sizeof(float);  // the same [n_t d_t] per layer, K|V
  EXPECT_EQ(MapperWeightBytes((*dense)->manifest()) - bias_bytes, 2 * (head_bytes - bias_bytes));
  std::printf("head-local truth: per_layer %.6f, per_head %.6f, difference %.6f [%.6f, %.6f]\n",
              both->per_layer.heldout->attention_cosine_without_layer0,
              both->per_head.heldout->attention_cosine_without_layer0, both->difference,
              both->difference_lower95.value_or(-1), both->difference_upper95.value_or(-1));
  // Both fit the same truth; per_head has fewer parameters to overfit: not worse beyond noise.
  EXPECT_EQ(both->recommended, "per_head");
  EXPECT_GT(both->per_head.heldout->attention_cosine_without_layer0, 0.99);
  absl::StatusOr<std::string> report = ReadFileToString(both->report_json_path);
  ASSERT_TRUE(report.ok());
  EXPECT_NE(report->find("\"recommended\": \"per_head\""), std::string::npos) << *report;
  EXPECT_NE(report->find("per_head_minus_per_layer"), std::string::npos);
}

TEST_F(PerHeadFamilyTest, DenseTruthMakesPerHeadLoseAndPerLayerRecommended) {
  const FitOptions options = HeadOptions(*families_[1], *dirs_[1]);
  const std::string out = ::kvt::testing::MakeTempDir("granularity_dense");
  absl::StatusOr<GranularityResult> both = RunFitGranularityBoth(options, out);
  ASSERT_TRUE(both.ok()) << both.status();
  std::printf("dense truth: per_layer %.6f, per_head %.6f, difference %.6f [%.6f, %.6f]\n",
              both->per_layer.heldout->attention_cosine_without_layer0,
              both->per_head.heldout->attention_cosine_without_layer0, both->difference,
              both->difference_lower95.value_or(-1), both->difference_upper95.value_or(-1));
  ASSERT_TRUE(both->difference_upper95.has_value());
  EXPECT_LT(*both->difference_upper95, 0);
  EXPECT_EQ(both->recommended, "per_layer");
  EXPECT_EQ(both->per_layer.manifest.ridge_granularity, RidgeGranularity::kPerLayer);
}

// The token weights: per (layer, head) non-negative with mean 1 over the kept tokens, token 0
// (which every query sees, and which its own query gives everything) above the mean, and the
// strided weights the stride-1 ones rescaled.
TEST_F(PerHeadFamilyTest, AttentionMassIsNormalisedPerLayerAndHead) {
  const FitOptions options = HeadOptions(*families_[1], *dirs_[1]);
  const SequencePair& pair = options.sequences.front();
  const ModelSpec& target = options.target.spec;
  absl::StatusOr<std::vector<double>> all =
      AttentionMass(pair, options.source.spec, target, 1);
  absl::StatusOr<std::vector<double>> strided =
      AttentionMass(pair, options.source.spec, target, 4);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_TRUE(strided.ok()) << strided.status();
  const int64_t T = 64, kept = 16;
  ASSERT_EQ(all->size(), static_cast<size_t>(target.num_layers * target.num_kv_heads * T));
  ASSERT_EQ(strided->size(), static_cast<size_t>(target.num_layers * target.num_kv_heads * kept));
  for (int lh = 0; lh < target.num_layers * target.num_kv_heads; ++lh) {
    double mean = 0, strided_mean = 0;
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_GE((*all)[lh * T + t], 0.0);
      mean += (*all)[lh * T + t] / T;
    }
    for (int64_t t = 0; t < T; t += 4) strided_mean += (*all)[lh * T + t] / kept;
    EXPECT_NEAR(mean, 1.0, 1e-12);
    EXPECT_GT((*all)[lh * T], 1.0);
    for (int64_t i = 0; i < kept; ++i) {
      EXPECT_NEAR((*strided)[lh * kept + i], (*all)[lh * T + 4 * i] / strided_mean, 1e-9);
    }
  }
}

// --per_head_objective=attention_weighted end to end: the fit passes and writes a head-local
// mapper whose report names the objective.
TEST_F(PerHeadFamilyTest, AttentionWeightedFitWritesAHeadLocalMapper) {
  FitOptions options = HeadOptions(*families_[0], *dirs_[0]);
  options.solve.ridge.per_head = true;
  options.solve.ridge.attention_weighted = true;
  absl::StatusOr<FitResult> fit =
      RunFit(options, JoinPath(::kvt::testing::MakeTempDir("aw_head"), "m"));
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_EQ(fit->manifest.ridge_granularity, RidgeGranularity::kPerHead);
  ASSERT_TRUE(fit->heldout.has_value());
  EXPECT_GT(fit->heldout->attention_cosine_without_layer0, 0.99);  // head-local truth
  absl::StatusOr<std::string> report = ReadFileToString(fit->report_path);
  ASSERT_TRUE(report.ok());
  EXPECT_NE(report->find("objective attention-weighted"), std::string::npos);
}

// A window fit (the chosen layers at p and p - 1), head-local with either objective: the
// compact tensors hold window k g d_s rows per head, load, and serve the head-local truth.
TEST_F(PerHeadFamilyTest, WindowFitsAreHeadLocalToo) {
  for (bool weighted : {false, true}) {
    SCOPED_TRACE(weighted ? "attention_weighted" : "mse");
    FitOptions options = HeadOptions(*families_[0], *dirs_[0]);
    options.window = 2;
    options.solve.ridge.per_head = true;
    options.solve.ridge.attention_weighted = weighted;
    absl::StatusOr<FitResult> fit =
        RunFit(options, JoinPath(::kvt::testing::MakeTempDir("window_head"), "m"));
    ASSERT_TRUE(fit.ok()) << fit.status();
    absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(fit->mapper_dir);
    ASSERT_TRUE(mapper.ok()) << mapper.status();
    const TensorInfo* w = (*mapper)->weights().Find("layers.0.k.weight");
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(w->spec.shape, (std::vector<int64_t>{2, 2 * 2 * 8, 8}));  // [n_t, window k g d_s, d_t]
    ASSERT_TRUE(fit->heldout.has_value());
    EXPECT_GT(fit->heldout->attention_cosine_without_layer0, 0.99);
  }
}

// Sharded: final shards with the attention-weighted sums, merged and solved per head, give the
// single run's mapper (up to the order of float64 additions).
TEST_F(PerHeadFamilyTest, AttentionWeightedShardsMergeToTheSingleRun) {
  FitOptions options = HeadOptions(*families_[1], *dirs_[1]);
  options.solve.ridge.per_head = true;
  options.solve.ridge.attention_weighted = true;
  const std::string dir = ::kvt::testing::MakeTempDir("aw_shards");
  absl::StatusOr<FitResult> single = RunFit(options, JoinPath(dir, "single"));
  ASSERT_TRUE(single.ok()) << single.status();
  std::vector<std::string> warnings;
  absl::StatusOr<StatSet> probe = AccumulateProbe(options);
  ASSERT_TRUE(probe.ok()) << probe.status();
  absl::StatusOr<StatSet> plan = MakePlan(*probe, &warnings);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::string> files;
  for (int i = 0; i < 2; ++i) {
    FitOptions shard = options;
    shard.sequences = SelectShard(options.sequences, i, 2);
    absl::StatusOr<StatSet> final_stats = AccumulateFinal(shard, *plan);
    ASSERT_TRUE(final_stats.ok()) << final_stats.status();
    files.push_back(JoinPath(dir, absl::StrCat("final", i, ".kvtstats")));
    ASSERT_TRUE(WriteStatSet(files.back(), *final_stats).ok());
  }
  absl::StatusOr<StatSet> merged = MergeStatFiles(files);
  ASSERT_TRUE(merged.ok()) << merged.status();
  absl::StatusOr<FitResult> from_shards =
      SolveAndWrite(*merged, options.solve, JoinPath(dir, "merged"));
  ASSERT_TRUE(from_shards.ok()) << from_shards.status();
  auto a = LoadMapperDir(single->mapper_dir), b = LoadMapperDir(from_shards->mapper_dir);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*b)->manifest().ridge_granularity, RidgeGranularity::kPerHead);
  for (const TensorInfo& t : (*a)->weights().tensors()) {
    const TensorInfo* other = (*b)->weights().Find(t.spec.name);
    ASSERT_NE(other, nullptr) << t.spec.name;
    if (t.spec.name.rfind("layers.", 0) != 0) continue;
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < t.spec.num_elements(); ++i) {
      const double x = LoadAsDouble(t.spec.dtype, (*a)->weights().data(t).data(), i);
      const double y = LoadAsDouble(t.spec.dtype, (*b)->weights().data(*other).data(), i);
      diff += (x - y) * (x - y);
      norm += x * x;
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-6) << t.spec.name;
  }
}

// --refine=attention on head-local fits moves the weights inside each head's block and leaves
// every weight outside it exactly 0 (the compact tensors then hold the whole refined map).
TEST_F(PerHeadFamilyTest, RefinementKeepsTheMapHeadLocal) {
  FitOptions options = HeadOptions(*families_[1], *dirs_[1]);
  options.solve.ridge.per_head = true;
  options.refine.attention = true;
  options.refine.steps = 20;
  options.refine.keep_start_unless_better = false;
  std::vector<std::string> warnings;
  absl::StatusOr<StatSet> probe = AccumulateProbe(options);
  ASSERT_TRUE(probe.ok()) << probe.status();
  absl::StatusOr<StatSet> plan = MakePlan(*probe, &warnings);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<StatSet> final_stats = AccumulateFinal(options, *plan);
  ASSERT_TRUE(final_stats.ok()) << final_stats.status();
  absl::StatusOr<ParsedFinal> parsed = ParseFinal(*final_stats);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  std::vector<LayerFit> fits;
  for (int l = 0; l < parsed->shape.target.num_layers; ++l) {
    absl::StatusOr<LayerFit> fit =
        SolveLayer(parsed->shape, *final_stats, l, parsed->sigma[l], options.solve.ridge);
    ASSERT_TRUE(fit.ok()) << fit.status();
    fits.push_back(*fit);
  }
  std::vector<LayerFit> refined = fits;
  absl::StatusOr<RefineLog> log = RefineRidge(options, *parsed, &refined, /*per_head=*/true);
  ASSERT_TRUE(log.ok()) << log.status();
  for (size_t l = 0; l < fits.size(); ++l) {
    int moved = 0;
    for (size_t i = 0; i < fits[l].w_k.size(); ++i) {
      if (fits[l].w_k[i] == 0) {
        ASSERT_EQ(refined[l].w_k[i], 0.0) << "layer " << l << " weight " << i;
      } else {
        moved += refined[l].w_k[i] != fits[l].w_k[i];
      }
    }
    EXPECT_GT(moved, 0) << "layer " << l;
  }
  absl::StatusOr<FitResult> written =
      RunFit(options, JoinPath(::kvt::testing::MakeTempDir("refined_head"), "m"));
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->manifest.ridge_granularity, RidgeGranularity::kPerHead);
  EXPECT_TRUE(LoadMapperDir(written->mapper_dir).ok());
}

}  // namespace
}  // namespace fit
}  // namespace kvt
