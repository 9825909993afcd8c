#include "fit/mlp.h"

#include <lapacke.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/testing/reference.h"

namespace kvt {
namespace fit {
namespace {

using kvt::testing::FreshSeed;

// Float64 reference of the chain and its loss, plain loops (SPEC 3). `pattern` (optional)
// receives the ReLU on/off pattern, to skip finite differences that straddle a kink.
double RefLoss(const std::vector<double>& p, int64_t in, int64_t H, int64_t out,
               const std::vector<double>& x, const std::vector<double>& y, int64_t rows,
               std::vector<bool>* pattern = nullptr) {
  const double* a1 = p.data();
  const double* c1 = a1 + in * H;
  const double* a2 = c1 + H;
  const double* c2 = a2 + H * H;
  const double* a3 = c2 + H;
  const double* c3 = a3 + H * out;
  double loss = 0;
  if (pattern) pattern->clear();
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> h1(H), h2(H);
    for (int64_t h = 0; h < H; ++h) {
      double z = c1[h];
      for (int64_t j = 0; j < in; ++j) z += x[r * in + j] * a1[j * H + h];
      h1[h] = z > 0 ? z : 0;
      if (pattern) pattern->push_back(z > 0);
    }
    for (int64_t h = 0; h < H; ++h) {
      double z = c2[h];
      for (int64_t j = 0; j < H; ++j) z += h1[j] * a2[j * H + h];
      h2[h] = z > 0 ? z : 0;
      if (pattern) pattern->push_back(z > 0);
    }
    for (int64_t o = 0; o < out; ++o) {
      double z = c3[o];
      for (int64_t j = 0; j < H; ++j) z += h2[j] * a3[j * out + o];
      loss += (z - y[r * out + o]) * (z - y[r * out + o]);
    }
  }
  return loss / (rows * out);
}

std::vector<double> Flatten(const MlpWeights& w) {
  std::vector<double> p;
  for (const std::vector<float>* v : {&w.a1, &w.c1, &w.a2, &w.c2, &w.a3, &w.c3}) {
    p.insert(p.end(), v->begin(), v->end());
  }
  return p;
}

std::vector<float> Normal(std::mt19937_64* rng, int64_t count, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<float> v(count);
  for (float& x : v) x = static_cast<float>(normal(*rng));
  return v;
}

// A random "teacher" chain with biases, so every unit is sometimes on and sometimes off.
MlpWeights RandomChain(std::mt19937_64* rng, int64_t in, int64_t H, int64_t out) {
  MlpWeights w = InitMlp(in, H, out, (*rng)());
  w.c1 = Normal(rng, H, 0.3);
  w.c2 = Normal(rng, H, 0.3);
  w.c3 = Normal(rng, out, 0.3);
  return w;
}

// Pooled R^2 of `pred` against `y` [rows, out]: 1 - SSE / SST around each column's mean.
double R2(const std::vector<float>& pred, const std::vector<float>& y, int64_t rows, int64_t out) {
  double sse = 0, sst = 0;
  for (int64_t o = 0; o < out; ++o) {
    double mean = 0;
    for (int64_t r = 0; r < rows; ++r) mean += y[r * out + o] / rows;
    for (int64_t r = 0; r < rows; ++r) {
      const double e = pred[r * out + o] - y[r * out + o], d = y[r * out + o] - mean;
      sse += e * e;
      sst += d * d;
    }
  }
  return 1 - sse / sst;
}

// Float64 least squares with intercept (LAPACKE_dgels): the linear map a ridge fit converges to
// with enough data. Returns held-out predictions.
std::vector<float> LeastSquaresPredict(const std::vector<float>& x, const std::vector<float>& y,
                                       int64_t rows, int64_t in, int64_t out,
                                       const std::vector<float>& x_test, int64_t test_rows) {
  const int64_t cols = in + 1;
  std::vector<double> a(rows * cols), b(rows * out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < in; ++j) a[r * cols + j] = x[r * in + j];
    a[r * cols + in] = 1.0;
    for (int64_t o = 0; o < out; ++o) b[r * out + o] = y[r * out + o];
  }
  EXPECT_EQ(LAPACKE_dgels(LAPACK_ROW_MAJOR, 'N', rows, cols, out, a.data(), cols, b.data(), out),
            0);
  std::vector<float> pred(test_rows * out);
  for (int64_t r = 0; r < test_rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double z = b[in * out + o];
      for (int64_t j = 0; j < in; ++j) z += x_test[r * in + j] * b[j * out + o];
      pred[r * out + o] = static_cast<float>(z);
    }
  }
  return pred;
}

TEST(MlpTest, BackpropMatchesFloat64FiniteDifferences) {
  std::mt19937_64 rng(FreshSeed("MlpTest.BackpropMatchesFloat64FiniteDifferences"));
  const int64_t in = 5, H = 7, out = 3, rows = 11;
  MlpWeights w = RandomChain(&rng, in, H, out);
  const std::vector<float> x = Normal(&rng, rows * in), y = Normal(&rng, rows * out);
  MlpWeights grad;
  const double loss = MlpLossAndGradient(w, x.data(), y.data(), rows, &grad);
  const std::vector<double> p = Flatten(w), g = Flatten(grad);
  const std::vector<double> xd(x.begin(), x.end()), yd(y.begin(), y.end());
  std::vector<bool> base_pattern, plus_pattern, minus_pattern;
  EXPECT_NEAR(loss, RefLoss(p, in, H, out, xd, yd, rows, &base_pattern), 1e-5 * (1 + loss));
  int checked = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const double h = 1e-6;
    std::vector<double> plus = p, minus = p;
    plus[i] += h;
    minus[i] -= h;
    const double lp = RefLoss(plus, in, H, out, xd, yd, rows, &plus_pattern);
    const double lm = RefLoss(minus, in, H, out, xd, yd, rows, &minus_pattern);
    if (plus_pattern != base_pattern || minus_pattern != base_pattern) continue;  // a kink
    const double fd = (lp - lm) / (2 * h);
    EXPECT_NEAR(g[i], fd, 1e-4 + 1e-3 * std::fabs(fd)) << "parameter " << i;
    ++checked;
  }
  EXPECT_GT(checked, static_cast<int>(p.size() * 9 / 10));
}

TEST(MlpTest, ForwardMatchesFloat64Reference) {
  std::mt19937_64 rng(FreshSeed("MlpTest.ForwardMatchesFloat64Reference"));
  const int64_t in = 9, H = 17, out = 4, rows = 5000;  // > one forward slice
  MlpWeights w = RandomChain(&rng, in, H, out);
  const std::vector<float> x = Normal(&rng, rows * in);
  std::vector<float> y(rows * out);
  MlpForward(w, x.data(), rows, y.data());
  // Loss of the forward's own output against itself is 0 in float64 up to rounding.
  const std::vector<double> xd(x.begin(), x.end()), yd(y.begin(), y.end());
  EXPECT_LT(RefLoss(Flatten(w), in, H, out, xd, yd, rows), 1e-9);
}

TEST(MlpTest, RecoversAKnownRandomMlpMapping) {
  std::mt19937_64 rng(FreshSeed("MlpTest.RecoversAKnownRandomMlpMapping"));
  const int64_t in = 12, out = 6, train = 6000, test = 2000;
  const MlpWeights teacher = RandomChain(&rng, in, 24, out);
  const std::vector<float> x = Normal(&rng, train * in), xt = Normal(&rng, test * in);
  std::vector<float> y(train * out), yt(test * out);
  MlpForward(teacher, x.data(), train, y.data());
  MlpForward(teacher, xt.data(), test, yt.data());
  MlpOptions options;
  options.hidden = 64;
  options.epochs = 90;  // at 60, 1 fresh seed in 40 ended at R^2 0.8996
  options.batch = 128;
  options.seed = rng();
  MlpTrainLog log;
  absl::StatusOr<MlpWeights> student = TrainMlp(x, y, train, in, out, options, &log);
  ASSERT_TRUE(student.ok()) << student.status();
  EXPECT_LT(log.epoch_loss.back(), log.epoch_loss.front());
  std::vector<float> pred(test * out);
  MlpForward(*student, xt.data(), test, pred.data());
  EXPECT_GT(R2(pred, yt, test, out), 0.9);
}

// Nonlinear target: an MLP clearly beats the best linear map. Linear target: it matches it.
TEST(MlpTest, BeatsLeastSquaresOnNonlinearAndMatchesItOnLinear) {
  std::mt19937_64 rng(FreshSeed("MlpTest.BeatsLeastSquaresOnNonlinearAndMatchesItOnLinear"));
  const int64_t in = 8, out = 4, train = 8000, test = 2000;
  const std::vector<float> x = Normal(&rng, train * in), xt = Normal(&rng, test * in);
  const std::vector<float> w = Normal(&rng, in * out, 1.0 / std::sqrt(in));
  const std::vector<float> noise = Normal(&rng, train * out, 0.05);
  MlpOptions options;
  options.hidden = 64;
  options.epochs = 30;
  options.batch = 128;
  options.seed = rng();
  for (bool linear : {false, true}) {
    auto target = [&](const std::vector<float>& xs, int64_t rows, bool with_noise) {
      std::vector<float> y(rows * out);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = 0; o < out; ++o) {
          double z = 0.5;
          for (int64_t j = 0; j < in; ++j) z += xs[r * in + j] * w[j * out + o];
          y[r * out + o] = static_cast<float>((linear ? z : std::fabs(z)) +
                                              (with_noise ? noise[r * out + o] : 0.0f));
        }
      }
      return y;
    };
    const std::vector<float> y = target(x, train, true), yt = target(xt, test, false);
    absl::StatusOr<MlpWeights> mlp = TrainMlp(x, y, train, in, out, options);
    ASSERT_TRUE(mlp.ok()) << mlp.status();
    std::vector<float> pred(test * out);
    MlpForward(*mlp, xt.data(), test, pred.data());
    const double r2_mlp = R2(pred, yt, test, out);
    const double r2_linear =
        R2(LeastSquaresPredict(x, y, train, in, out, xt, test), yt, test, out);
    if (linear) {
      EXPECT_GT(r2_linear, 0.99);
      EXPECT_GT(r2_mlp, r2_linear - 0.02) << "linear target";
    } else {
      EXPECT_LT(r2_linear, 0.5);
      EXPECT_GT(r2_mlp, 0.9) << "nonlinear target";
      EXPECT_GT(r2_mlp, r2_linear + 0.3);
    }
  }
}

// Raw-scale validation MSE in float64, independent of the trainer's standardisation.
double RawMse(const MlpWeights& w, const std::vector<float>& x, const std::vector<float>& y,
              int64_t rows) {
  std::vector<float> pred(rows * w.out);
  MlpForward(w, x.data(), rows, pred.data());
  double sum = 0;
  for (size_t i = 0; i < pred.size(); ++i) {
    const double d = static_cast<double>(pred[i]) - y[i];
    sum += d * d;
  }
  return sum / pred.size();
}

// Validation rows that the training makes worse by construction: the training rows with their
// targets negated (the better the fit to y, the worse the fit to -y). keep_best_epoch returns the
// epoch with the lowest validation loss (its weights score that loss), the last epoch's weights
// are exactly the run without validation, and both runs take the same steps.
TEST(MlpTest, KeepsTheBestValidationEpoch) {
  std::mt19937_64 rng(FreshSeed("MlpTest.KeepsTheBestValidationEpoch"));
  const int64_t in = 8, out = 4, train = 256, held = train;
  const std::vector<float> w = Normal(&rng, in * out, 1.0 / std::sqrt(in));
  const std::vector<float> x = Normal(&rng, train * in);
  const std::vector<float> noise = Normal(&rng, train * out, 0.1);
  std::vector<float> y(train * out), yv(train * out);
  for (int64_t r = 0; r < train; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double z = 0;
      for (int64_t j = 0; j < in; ++j) z += x[r * in + j] * w[j * out + o];
      y[r * out + o] = static_cast<float>(z + noise[r * out + o]);
      yv[r * out + o] = -y[r * out + o];
    }
  }
  const std::vector<float>& xv = x;
  MlpOptions options;
  options.hidden = 32;
  options.epochs = 20;
  options.batch = 32;
  options.seed = rng();
  options.keep_best_epoch = true;
  const MlpValidation validation{&xv, &yv, held};

  MlpTrainLog best_log, last_log;
  absl::StatusOr<MlpWeights> best = TrainMlp(x, y, train, in, out, options, &best_log,
                                             &validation);
  options.keep_best_epoch = false;
  absl::StatusOr<MlpWeights> last = TrainMlp(x, y, train, in, out, options, &last_log,
                                             &validation);
  absl::StatusOr<MlpWeights> plain = TrainMlp(x, y, train, in, out, options);
  ASSERT_TRUE(best.ok() && last.ok() && plain.ok());

  ASSERT_EQ(best_log.validation_loss.size(), 20u);
  EXPECT_EQ(best_log.validation_loss, last_log.validation_loss);  // same steps
  EXPECT_EQ(best_log.epoch_loss, last_log.epoch_loss);
  const auto lowest =
      std::min_element(best_log.validation_loss.begin(), best_log.validation_loss.end());
  EXPECT_EQ(best_log.returned_epoch, lowest - best_log.validation_loss.begin() + 1);
  EXPECT_LT(best_log.returned_epoch, 10);
  EXPECT_GT(best_log.validation_loss.back(), 1.2 * *lowest);
  EXPECT_EQ(last_log.returned_epoch, 20);
  EXPECT_EQ(Flatten(*last), Flatten(*plain));

  // The returned weights are that epoch's: their raw validation MSE is the logged loss times
  // the output scale^2 (the trainer's common output scale, over the kept training rows).
  double var_y = 0;
  for (int64_t o = 0; o < out; ++o) {
    double mean = 0, sq = 0;
    for (int64_t r = 0; r < train; ++r) mean += y[r * out + o] / train;
    for (int64_t r = 0; r < train; ++r) sq += (y[r * out + o] - mean) * (y[r * out + o] - mean);
    var_y += sq / train / out;
  }
  EXPECT_NEAR(RawMse(*best, xv, yv, held), *lowest * var_y, 1e-3 * *lowest * var_y);
  EXPECT_LT(RawMse(*best, xv, yv, held), RawMse(*last, xv, yv, held));
}

TEST(MlpTest, BadValidationShapesAreNamed) {
  const std::vector<float> x(10), y(5), xv(7), yv(3);
  const MlpValidation validation{&xv, &yv, 3};
  absl::StatusOr<MlpWeights> bad = TrainMlp(x, y, 5, 2, 1, MlpOptions(), nullptr, &validation);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("MLP validation data"), std::string::npos);
}

TEST(MlpTest, SameSeedSameBytesOtherSeedOtherWeights) {
  std::mt19937_64 rng(FreshSeed("MlpTest.SameSeedSameBytesOtherSeedOtherWeights"));
  const int64_t in = 6, out = 3, rows = 700;
  const std::vector<float> x = Normal(&rng, rows * in), y = Normal(&rng, rows * out);
  MlpOptions options;
  options.hidden = 16;
  options.epochs = 3;
  options.batch = 64;
  options.max_observations = 500;  // the subsample is seeded too
  options.seed = 42;
  absl::StatusOr<MlpWeights> a = TrainMlp(x, y, rows, in, out, options);
  absl::StatusOr<MlpWeights> b = TrainMlp(x, y, rows, in, out, options);
  options.seed = 43;
  absl::StatusOr<MlpWeights> c = TrainMlp(x, y, rows, in, out, options);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const std::vector<double> pa = Flatten(*a), pb = Flatten(*b), pc = Flatten(*c);
  ASSERT_EQ(pa.size(), pb.size());
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(double)), 0);
  EXPECT_NE(pa, pc);
}

TEST(MlpTest, BadOptionsAndShapesAreNamed) {
  MlpOptions options;
  options.hidden = 0;
  EXPECT_NE(ValidateMlpOptions(options).message().find("--mlp_hidden"), std::string::npos);
  options = MlpOptions();
  options.epochs = 0;
  EXPECT_NE(ValidateMlpOptions(options).message().find("--mlp_epochs"), std::string::npos);
  options = MlpOptions();
  options.batch = -1;
  EXPECT_NE(ValidateMlpOptions(options).message().find("--mlp_batch"), std::string::npos);
  options = MlpOptions();
  options.learning_rate = std::nan("");
  EXPECT_NE(ValidateMlpOptions(options).message().find("--mlp_lr"), std::string::npos);
  absl::StatusOr<MlpWeights> bad =
      TrainMlp(std::vector<float>(10), std::vector<float>(4), 5, 2, 1, MlpOptions());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("and y 4 values"), std::string::npos);
}

}  // namespace
}  // namespace fit
}  // namespace kvt
