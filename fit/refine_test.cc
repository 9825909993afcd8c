// The attention refinement's math: the float64 RoPE rows against the kernels' RoPE, and the
// analytic gradient of the attention-output error against float64 central differences, on
// fresh random problems (GQA, partial rotary, both styles, yarn's attention factor), for the
// ridge maps and for MLP chains (per layer and per head) through the shared attention part.
#include "fit/refine.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/testing/reference.h"

namespace kvt {
namespace fit {
namespace {

using kvt::testing::FreshSeed;
using kvt::testing::MakeTestRope;

std::vector<double> Normal(std::mt19937_64* rng, size_t n, double scale = 1.0) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = normal(*rng);
  return v;
}

struct RandomProblem {
  std::vector<double> x_k, x_v, k_true, v_true, queries;
  RopeRows rope;
  AttentionProblem problem;
  RidgeMaps maps;
};

// T tokens, 2 KV heads of `d` dims, 2 query heads per KV head, 5 input features.
void MakeProblem(std::mt19937_64* rng, const Rope& rope, int64_t T, int d, RandomProblem* r) {
  const int kv = 2, nq = 4;
  const int64_t in = 5, out = int64_t{kv} * d;
  r->x_k = Normal(rng, T * in);
  r->x_v = Normal(rng, T * in);
  r->k_true = Normal(rng, T * out);
  r->v_true = Normal(rng, T * out);
  r->queries = Normal(rng, T * nq * d, 1.5);
  std::vector<uint64_t> positions(T);
  for (int64_t t = 0; t < T; ++t) positions[t] = 3 + 2 * t;  // an offset and a stride
  r->rope = RopeRows::Of(rope, positions);
  r->maps.Resize(in, out);
  for (std::vector<double>* t : r->maps.Tensors()) *t = Normal(rng, t->size(), 0.5);
  AttentionProblem& p = r->problem;
  p.tokens = T;
  p.kv_heads = kv;
  p.head_dim = d;
  p.query_heads = nq;
  p.x_k = r->x_k.data();
  p.x_v = r->x_v.data();
  p.k_true = r->k_true.data();
  p.v_true = r->v_true.data();
  p.queries = r->queries.data();
  p.rope = &r->rope;
  // Not the last token: keys past the last counted query must not matter.
  p.rows = {0, 2, 3, T - 3};
}

TEST(RopeRowsTest, RotateIsTheKernelsRopeAndTransposeItsAdjoint) {
  std::mt19937_64 rng(FreshSeed("RopeRowsTest.RotateIsTheKernelsRopeAndTransposeItsAdjoint"));
  for (RopeStyle style : {RopeStyle::kNeox, RopeStyle::kGptj}) {
    RopeConfig config = MakeTestRope(RopeScalingType::kYarn, style, /*rotary_dim=*/6);
    absl::StatusOr<Rope> rope = Rope::Create(config, 8);
    ASSERT_TRUE(rope.ok()) << rope.status();
    ASSERT_NE(rope->attention_factor(), 1.0);  // yarn: the factor is part of the rotation
    const std::vector<uint64_t> positions = {0, 1, 7, 40, 1000};
    const RopeRows rows = RopeRows::Of(*rope, positions);
    const int heads = 3, d = 8;
    const std::vector<double> x = Normal(&rng, positions.size() * heads * d);
    std::vector<double> rotated = x;
    rows.Rotate(positions.size(), heads, d, false, rotated.data());
    for (size_t t = 0; t < positions.size(); ++t) {
      std::vector<float> cos(rope->rotary_dim() / 2), sin(cos.size());
      rope->CosSin(positions[t], cos.data(), sin.data());
      for (int h = 0; h < heads; ++h) {
        std::vector<float> head(x.begin() + (t * heads + h) * d,
                                x.begin() + (t * heads + h + 1) * d);
        rope->ApplyHead(cos.data(), sin.data(), head.data());
        for (int i = 0; i < d; ++i) {
          EXPECT_NEAR(rotated[(t * heads + h) * d + i], head[i], 1e-5) << t << " " << h << " " << i;
        }
      }
    }
    // <R x, y> = <x, R^T y>.
    const std::vector<double> y = Normal(&rng, x.size());
    std::vector<double> back = y;
    rows.Rotate(positions.size(), heads, d, true, back.data());
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < x.size(); ++i) lhs += rotated[i] * y[i], rhs += x[i] * back[i];
    EXPECT_NEAR(lhs, rhs, 1e-10 * (1 + std::fabs(lhs)));
  }
}

TEST(AttentionRefineTest, GradientMatchesFloat64FiniteDifferences) {
  std::mt19937_64 rng(FreshSeed("AttentionRefineTest.GradientMatchesFloat64FiniteDifferences"));
  for (RopeStyle style : {RopeStyle::kNeox, RopeStyle::kGptj}) {
    SCOPED_TRACE(style == RopeStyle::kNeox ? "neox" : "gptj");
    absl::StatusOr<Rope> rope =
        Rope::Create(MakeTestRope(RopeScalingType::kYarn, style, /*rotary_dim=*/6), 8);
    ASSERT_TRUE(rope.ok()) << rope.status();
    for (int64_t own_from : {int64_t{-1}, int64_t{5}}) {
    SCOPED_TRACE(absl::StrCat("own_from ", own_from));
    RandomProblem r;
    MakeProblem(&rng, *rope, 9, 8, &r);
    r.problem.own_from = own_from;  // 5: the last counted query (6) reads its own keys 5 and 6
    RidgeMaps grad;
    grad.Resize(r.maps.in, r.maps.out);
    const AttentionError base = AttentionErrorAndGradient(r.problem, r.maps, &grad);
    ASSERT_GT(base.error, 0);
    ASSERT_GT(base.norm, 0);
    // The error alone (no gradient) is the same number.
    EXPECT_EQ(AttentionErrorAndGradient(r.problem, r.maps, nullptr).error, base.error);
    std::vector<std::vector<double>*> params = r.maps.Tensors(), grads = grad.Tensors();
    int checked = 0;
    for (size_t t = 0; t < params.size(); ++t) {
      for (size_t i = 0; i < params[t]->size(); ++i) {
        const double h = 1e-6, keep = (*params[t])[i];
        (*params[t])[i] = keep + h;
        const double plus = AttentionErrorAndGradient(r.problem, r.maps, nullptr).error;
        (*params[t])[i] = keep - h;
        const double minus = AttentionErrorAndGradient(r.problem, r.maps, nullptr).error;
        (*params[t])[i] = keep;
        const double fd = (plus - minus) / (2 * h);
        EXPECT_NEAR((*grads[t])[i], fd, 1e-6 * (1 + std::fabs(fd)))
            << "tensor " << t << " element " << i;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 2 * (5 * 16 + 16));
    }
  }
}

TEST(AttentionRefineTest, RowsFromTheHandoffAreTheTargetsOwn) {
  std::mt19937_64 rng(FreshSeed("AttentionRefineTest.RowsFromTheHandoffAreTheTargetsOwn"));
  absl::StatusOr<Rope> rope =
      Rope::Create(MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 8), 8);
  ASSERT_TRUE(rope.ok()) << rope.status();
  RandomProblem r;
  MakeProblem(&rng, *rope, 10, 8, &r);
  RidgeMaps grad;
  grad.Resize(r.maps.in, r.maps.out);
  // Every row the target's own: nothing to get wrong, nothing to move.
  r.problem.own_from = 0;
  AttentionError e = AttentionErrorAndGradient(r.problem, r.maps, &grad);
  EXPECT_EQ(e.error, 0.0);
  EXPECT_GT(e.norm, 0.0);
  for (std::vector<double>* g : grad.Tensors()) {
    for (double v : *g) EXPECT_EQ(v, 0.0);
  }
  // From row 5 on the source's features are never read; row 4's are.
  r.problem.own_from = 5;
  const double before = AttentionErrorAndGradient(r.problem, r.maps, nullptr).error;
  EXPECT_GT(before, 0.0);
  const int64_t in = r.maps.in;
  for (int64_t i = 5 * in; i < 10 * in; ++i) r.x_k[i] += 1.0, r.x_v[i] -= 1.0;
  EXPECT_EQ(AttentionErrorAndGradient(r.problem, r.maps, nullptr).error, before);
  for (int64_t i = 4 * in; i < 5 * in; ++i) r.x_v[i] += 1.0;
  EXPECT_NE(AttentionErrorAndGradient(r.problem, r.maps, nullptr).error, before);
}

TEST(AttentionRefineTest, ExactMapsHaveZeroErrorAndGradient) {
  std::mt19937_64 rng(FreshSeed("AttentionRefineTest.ExactMapsHaveZeroErrorAndGradient"));
  absl::StatusOr<Rope> rope = Rope::Create(MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 8), 8);
  ASSERT_TRUE(rope.ok()) << rope.status();
  RandomProblem r;
  const int64_t T = 10;
  MakeProblem(&rng, *rope, T, 8, &r);
  // The truth is what the maps produce (keys rotated as a cache holds them).
  const int64_t in = r.maps.in, out = r.maps.out;
  for (int c = 0; c < 2; ++c) {
    const std::vector<double>& x = c == 0 ? r.x_k : r.x_v;
    const std::vector<double>& w = c == 0 ? r.maps.w_k : r.maps.w_v;
    const std::vector<double>& b = c == 0 ? r.maps.b_k : r.maps.b_v;
    std::vector<double>& y = c == 0 ? r.k_true : r.v_true;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t o = 0; o < out; ++o) {
        double z = b[o];
        for (int64_t i = 0; i < in; ++i) z += x[t * in + i] * w[i * out + o];
        y[t * out + o] = z;
      }
    }
  }
  r.rope.Rotate(T, 2, 8, false, r.k_true.data());
  RidgeMaps grad;
  grad.Resize(in, out);
  const AttentionError e = AttentionErrorAndGradient(r.problem, r.maps, &grad);
  EXPECT_LT(e.error, 1e-20 * e.norm);
  for (std::vector<double>* g : grad.Tensors()) {
    for (double v : *g) EXPECT_NEAR(v, 0.0, 1e-9);
  }
}

// Float64 reference of MLP chains on x [T, in] -> y [T, out] (chain h's outputs at columns
// h * width ...), plain loops; `pattern` receives every ReLU's on/off state.
void RefChains(const std::vector<std::vector<double>>& params, const std::vector<MlpWeights>& like,
               const std::vector<double>& x, int64_t T, int64_t out, std::vector<double>* y,
               std::vector<bool>* pattern) {
  y->assign(T * out, 0.0);
  const int64_t width = out / static_cast<int64_t>(like.size());
  for (size_t c = 0; c < like.size(); ++c) {
    const int64_t in = like[c].in, H = like[c].hidden;
    const double* a1 = params[c].data();
    const double* c1 = a1 + in * H;
    const double* a2 = c1 + H;
    const double* c2 = a2 + H * H;
    const double* a3 = c2 + H;
    const double* c3 = a3 + H * width;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> h1(H), h2(H);
      for (int64_t h = 0; h < H; ++h) {
        double z = c1[h];
        for (int64_t j = 0; j < in; ++j) z += x[t * in + j] * a1[j * H + h];
        h1[h] = z > 0 ? z : 0;
        pattern->push_back(z > 0);
      }
      for (int64_t h = 0; h < H; ++h) {
        double z = c2[h];
        for (int64_t j = 0; j < H; ++j) z += h1[j] * a2[j * H + h];
        h2[h] = z > 0 ? z : 0;
        pattern->push_back(z > 0);
      }
      for (int64_t o = 0; o < width; ++o) {
        double z = c3[o];
        for (int64_t j = 0; j < H; ++j) z += h2[j] * a3[j * width + o];
        (*y)[t * out + c * width + o] = z;
      }
    }
  }
}

std::vector<double> FlattenChain(MlpWeights w) {
  std::vector<double> p;
  for (std::vector<float>* v : MlpParams(&w)) p.insert(p.end(), v->begin(), v->end());
  return p;
}

// The error of float64 chains (K chains' flattened parameters, then V's) through the shared
// attention part, all in float64.
double RefMlpError(const RandomProblem& r, const MlpMaps& like,
                   const std::vector<std::vector<double>>& params, std::vector<bool>* pattern) {
  pattern->clear();
  const int64_t T = VisibleTokens(r.problem), out = r.maps.out;
  const size_t nk = like.k.size();
  std::vector<double> y[2];
  RefChains({params.begin(), params.begin() + nk}, like.k, r.x_k, T, out, &y[0], pattern);
  RefChains({params.begin() + nk, params.end()}, like.v, r.x_v, T, out, &y[1], pattern);
  return AttentionOutputErrorAndGradient(r.problem, y[0].data(), y[1].data(), nullptr, nullptr)
      .error;
}

TEST(AttentionRefineTest, MlpGradientMatchesFloat64FiniteDifferences) {
  std::mt19937_64 rng(FreshSeed("AttentionRefineTest.MlpGradientMatchesFloat64FiniteDifferences"));
  for (int heads : {1, 2}) {  // per_layer, per_head (2 KV heads)
    SCOPED_TRACE(heads == 1 ? "per_layer" : "per_head");
    absl::StatusOr<Rope> rope =
        Rope::Create(MakeTestRope(RopeScalingType::kYarn, RopeStyle::kNeox, /*rotary_dim=*/6), 8);
    ASSERT_TRUE(rope.ok()) << rope.status();
    RandomProblem r;
    MakeProblem(&rng, *rope, 9, 8, &r);
    // per_head also past a handoff boundary: the chains then run on rows 0-4 only.
    if (heads == 2) r.problem.own_from = 5;
    // Inputs float32-exact: the chains read them as float32.
    for (std::vector<double>* x : {&r.x_k, &r.x_v}) {
      for (double& v : *x) v = static_cast<float>(v);
    }
    const int64_t in = r.maps.in, out = r.maps.out, H = 6;
    std::normal_distribution<double> normal(0.0, 1.0);
    MlpMaps maps;
    for (int c = 0; c < 2; ++c) {
      for (int h = 0; h < heads; ++h) {
        MlpWeights w = InitMlp(in, H, out / heads, rng());
        // Biases, so that units are on and off across tokens.
        for (std::vector<float>* b : {&w.c1, &w.c2, &w.c3}) {
          for (float& v : *b) v = static_cast<float>(0.3 * normal(rng));
        }
        (c == 0 ? maps.k : maps.v).push_back(w);
      }
    }
    MlpMaps grad = MlpMaps::ZerosLike(maps);
    const AttentionError base = MlpAttentionErrorAndGradient(r.problem, maps, &grad);
    ASSERT_GT(base.error, 0);
    EXPECT_EQ(MlpAttentionErrorAndGradient(r.problem, maps, nullptr).error, base.error);
    std::vector<std::vector<double>> params, grads;
    for (int c = 0; c < 2; ++c) {
      for (int h = 0; h < heads; ++h) {
        params.push_back(FlattenChain((c == 0 ? maps.k : maps.v)[h]));
        grads.push_back(FlattenChain((c == 0 ? grad.k : grad.v)[h]));
      }
    }
    std::vector<bool> base_pattern, plus_pattern, minus_pattern;
    const double ref = RefMlpError(r, maps, params, &base_pattern);
    // The float32 chains' error against the float64 reference's.
    EXPECT_NEAR(base.error, ref, 1e-4 * ref);
    double max_fd = 0;
    std::vector<std::vector<double>> fds(params.size());
    int checked = 0, total = 0;
    for (size_t t = 0; t < params.size(); ++t) {
      fds[t].assign(params[t].size(), std::nan(""));
      for (size_t i = 0; i < params[t].size(); ++i, ++total) {
        const double h = 1e-6, keep = params[t][i];
        params[t][i] = keep + h;
        const double plus = RefMlpError(r, maps, params, &plus_pattern);
        params[t][i] = keep - h;
        const double minus = RefMlpError(r, maps, params, &minus_pattern);
        params[t][i] = keep;
        if (plus_pattern != base_pattern || minus_pattern != base_pattern) continue;  // a kink
        fds[t][i] = (plus - minus) / (2 * h);
        max_fd = std::max(max_fd, std::fabs(fds[t][i]));
        ++checked;
      }
    }
    // float32 backpropagation against float64 differences: a relative tolerance of float32's
    // accumulated rounding, far below the size of any dropped or mis-signed term.
    for (size_t t = 0; t < params.size(); ++t) {
      for (size_t i = 0; i < params[t].size(); ++i) {
        if (std::isnan(fds[t][i])) continue;
        EXPECT_NEAR(grads[t][i], fds[t][i], 1e-3 * std::fabs(fds[t][i]) + 1e-5 * max_fd)
            << "chain " << t << " parameter " << i;
      }
    }
    EXPECT_GT(max_fd, 0);
    EXPECT_GT(checked, total * 9 / 10);
  }
}

}  // namespace
}  // namespace fit
}  // namespace kvt
