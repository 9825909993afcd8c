#include "quality/kv_quality.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/rope.h"
#include "kernels/testing/reference.h"
#include "quality/quality_reference.h"

namespace kvt {
namespace {

Rope TargetRope(int head_dim) {
  RopeConfig config;
  config.theta = 10000;
  config.rotary_dim = head_dim;
  return *Rope::Create(config, head_dim);
}

std::vector<double> Normal(int64_t n, double stddev, std::mt19937_64* rng) {
  std::normal_distribution<double> normal(0.0, stddev);
  std::vector<double> out(n);
  for (double& x : out) x = normal(*rng);
  return out;
}

std::vector<float> ToFloats(const std::vector<double>& x) { return {x.begin(), x.end()}; }
// Through float, so the reference sees exactly what the code under test sees.
std::vector<double> Rounded(const std::vector<double>& x) {
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(x[i]);
  return out;
}

std::vector<double> StripAll(const Rope& rope, const std::vector<double>& keys,
                             const std::vector<uint64_t>& pos, int H, int d) {
  std::vector<double> out = keys;
  for (size_t t = 0; t < pos.size(); ++t) {
    for (int h = 0; h < H; ++h) testing::RotateDouble(rope, pos[t], true, &out[(t * H + h) * d]);
  }
  return out;
}

struct Case {
  int64_t T;
  int H, d, nq;
  double noise;
  bool explicit_positions;
};

void CheckAgainstReference(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t n = c.T * c.H * c.d;
  const std::vector<double> k_true = Rounded(Normal(n, 1.0, &rng));
  const std::vector<double> v_true = Rounded(Normal(n, 1.0, &rng));
  std::vector<double> k_mapped = k_true, v_mapped = v_true;
  const std::vector<double> k_noise = Normal(n, c.noise, &rng);
  const std::vector<double> v_noise = Normal(n, c.noise, &rng);
  for (int64_t i = 0; i < n; ++i) k_mapped[i] += k_noise[i], v_mapped[i] += v_noise[i];
  k_mapped = Rounded(k_mapped);
  v_mapped = Rounded(v_mapped);
  const std::vector<double> q = Rounded(Normal(c.T * c.nq * c.d, 1.0, &rng));
  std::vector<uint64_t> pos(c.T);
  for (int64_t t = 0; t < c.T; ++t) pos[t] = 1000 + t;
  if (c.explicit_positions) std::shuffle(pos.begin(), pos.end(), rng);
  Positions positions;
  positions.offset = 1000;
  if (c.explicit_positions) positions.explicit_positions = pos.data();

  const Rope rope = TargetRope(c.d);
  const testing::QualityReference ref = testing::RefQuality(
      k_mapped, v_mapped, k_true, v_true, StripAll(rope, k_mapped, pos, c.H, c.d),
      StripAll(rope, k_true, pos, c.H, c.d), q, pos, c.T, c.H, c.d, c.nq);

  const std::vector<float> fk_mapped = ToFloats(k_mapped), fv_mapped = ToFloats(v_mapped),
                           fk_true = ToFloats(k_true), fv_true = ToFloats(v_true),
                           fq = ToFloats(q);
  LayerQualityInputs in;
  in.num_tokens = c.T;
  in.num_kv_heads = c.H;
  in.head_dim = c.d;
  in.num_query_heads = c.nq;
  in.k_mapped = fk_mapped.data();
  in.v_mapped = fv_mapped.data();
  in.k_true = fk_true.data();
  in.v_true = fv_true.data();
  in.queries = c.nq > 0 ? fq.data() : nullptr;
  absl::StatusOr<LayerQuality> got = ComputeLayerQuality(in, rope, positions);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_NEAR(got->r2_k, ref.r2_k, 1e-5);
  EXPECT_NEAR(got->r2_v, ref.r2_v, 1e-5);
  EXPECT_NEAR(got->cosine_k, ref.cosine_k, 1e-6);
  EXPECT_NEAR(got->cosine_v, ref.cosine_v, 1e-6);
  if (c.nq == 0) {
    EXPECT_FALSE(got->attention_cosine.has_value());
    EXPECT_FALSE(got->c_k.has_value());
    return;
  }
  ASSERT_TRUE(got->attention_cosine.has_value());
  ASSERT_TRUE(got->c_k.has_value());
  ASSERT_TRUE(got->c_v.has_value());
  EXPECT_NEAR(*got->attention_cosine, ref.attention_cosine, 2e-5);
  EXPECT_NEAR(*got->c_k, ref.c_k, 1e-4 * ref.c_k);
  EXPECT_NEAR(*got->c_v, ref.c_v, 1e-4 * ref.c_v);
}

TEST(KvQualityTest, MatchesTheFloat64ReferenceOnRandomData) {
  CheckAgainstReference({37, 2, 16, 4, 0.3, false}, testing::FreshSeed("quality gqa"));
  CheckAgainstReference({29, 2, 8, 2, 0.5, true}, testing::FreshSeed("quality shuffled"));
  CheckAgainstReference({150, 1, 32, 3, 0.2, false}, testing::FreshSeed("quality blocks"));
  CheckAgainstReference({20, 2, 16, 0, 0.3, false}, testing::FreshSeed("quality no queries"));
}

TEST(KvQualityTest, CosinesOnlyGivesTheSameCosinesAndNothingElse) {
  std::mt19937_64 rng(11);
  const int64_t T = 21;
  const int H = 2, d = 16, nq = 4;
  const std::vector<float> k = ToFloats(Normal(T * H * d, 1.0, &rng));
  const std::vector<float> v = ToFloats(Normal(T * H * d, 1.0, &rng));
  const std::vector<float> k2 = ToFloats(Normal(T * H * d, 1.0, &rng));
  const std::vector<float> v2 = ToFloats(Normal(T * H * d, 1.0, &rng));
  const std::vector<float> q = ToFloats(Normal(T * nq * d, 1.0, &rng));
  LayerQualityInputs in{T, H, d, nq, k.data(), v.data(), k2.data(), v2.data(), q.data()};
  Positions positions;
  absl::StatusOr<LayerQuality> all = ComputeLayerQuality(in, TargetRope(d), positions);
  in.cosines_only = true;
  absl::StatusOr<LayerQuality> cosines = ComputeLayerQuality(in, TargetRope(d), positions);
  ASSERT_TRUE(all.ok() && cosines.ok());
  EXPECT_EQ(cosines->cosine_k, all->cosine_k);
  EXPECT_EQ(cosines->cosine_v, all->cosine_v);
  EXPECT_EQ(cosines->r2_k, 0.0);
  EXPECT_FALSE(cosines->attention_cosine.has_value());
}

TEST(KvQualityTest, IdenticalCachesGiveCosineOneAndR2One) {
  std::mt19937_64 rng(5);
  const int64_t T = 33;
  const int H = 2, d = 16, nq = 4;
  const std::vector<float> k = ToFloats(Normal(T * H * d, 1.0, &rng));
  const std::vector<float> v = ToFloats(Normal(T * H * d, 1.0, &rng));
  const std::vector<float> q = ToFloats(Normal(T * nq * d, 1.0, &rng));
  LayerQualityInputs in{T, H, d, nq, k.data(), v.data(), k.data(), v.data(), q.data()};
  Positions positions;
  absl::StatusOr<LayerQuality> got = ComputeLayerQuality(in, TargetRope(d), positions);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_DOUBLE_EQ(got->r2_k, 1.0);
  EXPECT_DOUBLE_EQ(got->r2_v, 1.0);
  EXPECT_NEAR(got->cosine_k, 1.0, 1e-12);
  EXPECT_NEAR(got->cosine_v, 1.0, 1e-12);
  EXPECT_NEAR(*got->attention_cosine, 1.0, 1e-12);
  // No error at all: its concentration is undefined, so it is not reported.
  EXPECT_FALSE(got->c_k.has_value());
  EXPECT_FALSE(got->c_v.has_value());
}

// Queries with a strongly anisotropic spectrum, so c_K = 1 is not automatic.
struct Isotropy {
  std::vector<float> k_true, v_true, k_mapped, v_mapped, q;
  LayerQualityInputs in;
};
Isotropy MakeIsotropy(int64_t T, int H, int d, int nq, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Isotropy x;
  x.k_true = ToFloats(Normal(T * H * d, 1.0, &rng));
  x.v_true = ToFloats(Normal(T * H * d, 1.0, &rng));
  x.q = ToFloats(Normal(T * nq * d, 1.0, &rng));
  for (int64_t i = 0; i < T * nq * d; ++i) x.q[i] *= static_cast<float>(1 + 3 * (i % d == 0));
  x.k_mapped = x.k_true;
  x.v_mapped = x.v_true;
  const std::vector<double> ek = Normal(T * H * d, 0.1, &rng), ev = Normal(T * H * d, 0.1, &rng);
  for (int64_t i = 0; i < T * H * d; ++i) x.k_mapped[i] += ek[i], x.v_mapped[i] += ev[i];
  x.in = {T, H, d, nq, x.k_mapped.data(), x.v_mapped.data(), x.k_true.data(), x.v_true.data(),
          x.q.data()};
  return x;
}

TEST(KvQualityTest, ConcentrationIsOneForIsotropicErrors) {
  Isotropy x = MakeIsotropy(1024, 2, 64, 4, testing::FreshSeed("isotropic errors"));
  Positions positions;
  absl::StatusOr<LayerQuality> got = ComputeLayerQuality(x.in, TargetRope(64), positions);
  ASSERT_TRUE(got.ok()) << got.status();
  // Sampling error: c_K averages ~1000 tokens x 64 dims; c_V's weights a_t^2 favour the first
  // tokens (causal attention), leaving an effective sample of a few hundred tokens.
  EXPECT_NEAR(*got->c_k, 1.0, 0.05);
  EXPECT_NEAR(*got->c_v, 1.0, 0.12);
}

TEST(KvQualityTest, ConcentrationExceedsOneWhereAttentionReads) {
  Isotropy x = MakeIsotropy(256, 1, 32, 2, 11);
  // K error along dimension 0, where the queries are 4x larger; V error on the first tokens,
  // which every causal query sees.
  for (int64_t t = 0; t < 256; ++t) {
    for (int i = 0; i < 32; ++i) {
      x.k_mapped[t * 32 + i] = x.k_true[t * 32 + i] + (i == 0 ? 0.5f : 0.0f);
      x.v_mapped[t * 32 + i] = x.v_true[t * 32 + i] + (t < 8 ? 0.5f : 0.01f);
    }
  }
  Positions positions;
  absl::StatusOr<LayerQuality> got = ComputeLayerQuality(x.in, TargetRope(32), positions);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT(*got->c_k, 5.0);
  EXPECT_GT(*got->c_v, 5.0);
}

TEST(KvQualityTest, SummaryAveragesLayersWithAndWithoutLayerZero) {
  LayerQuality a, b, c;
  a.r2_k = 0.9, b.r2_k = 0.6, c.r2_k = 0.3;
  a.attention_cosine = 0.99;
  c.attention_cosine = 0.9;
  b.c_k = 2.0;
  const QualitySummary s = SummarizeQuality({a, b, c});
  EXPECT_NEAR(s.all.r2_k, 0.6, 1e-12);
  EXPECT_NEAR(s.without_layer0.r2_k, 0.45, 1e-12);
  EXPECT_NEAR(*s.all.attention_cosine, 0.945, 1e-12);
  EXPECT_NEAR(*s.without_layer0.attention_cosine, 0.9, 1e-12);
  EXPECT_NEAR(*s.without_layer0.c_k, 2.0, 1e-12);
  EXPECT_FALSE(s.all.c_v.has_value());
  const QualitySummary one = SummarizeQuality({a});
  EXPECT_EQ(one.without_layer0.r2_k, 0.0);
  EXPECT_FALSE(one.without_layer0.attention_cosine.has_value());
}

TEST(KvQualityTest, KvCosineAveragesKAndVPastLayerZero) {
  LayerQuality a, b, c;
  a.cosine_k = 1.0, a.cosine_v = 1.0;  // layer 0: left out when there are others
  b.cosine_k = 0.8, b.cosine_v = 0.6;
  c.cosine_k = 0.4, c.cosine_v = 0.2;
  EXPECT_NEAR(KvCosineOverLayers({a, b, c}), 0.5, 1e-12);
  EXPECT_NEAR(KvCosineOverLayers({b}), 0.7, 1e-12);  // one layer: itself
}

TEST(KvQualityTest, RejectsInconsistentShapes) {
  std::vector<float> x(2 * 3 * 4, 1.0f);
  LayerQualityInputs in{2, 3, 4, 4, x.data(), x.data(), x.data(), x.data(), x.data()};
  Positions positions;
  EXPECT_EQ(ComputeLayerQuality(in, TargetRope(4), positions).status().code(),
            absl::StatusCode::kInvalidArgument);  // 4 query heads over 3 KV heads
}

TEST(KvQualityTest, TokenMajorFromEitherLayoutAndDtype) {
  const int H = 2, d = 3;
  const int64_t T = 4;
  std::vector<uint16_t> hnd(H * T * d), nhd(H * T * d);
  for (int h = 0; h < H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      for (int i = 0; i < d; ++i) {
        const float value = static_cast<float>(100 * h + 10 * t + i);
        hnd[CacheOffset(Layout::kHND, H, T, d, h, t, i)] = FloatToBF16(value);
        nhd[CacheOffset(Layout::kNHD, H, T, d, h, t, i)] = FloatToBF16(value);
      }
    }
  }
  std::vector<float> a(H * T * d), b(H * T * d);
  ToTokenMajorFloat(DType::kBF16, Layout::kHND, H, T, d, hnd.data(), a.data());
  ToTokenMajorFloat(DType::kBF16, Layout::kNHD, H, T, d, nhd.data(), b.data());
  EXPECT_EQ(a, b);
  EXPECT_EQ(a[(2 * H + 1) * d + 2], 122.0f);  // token 2, head 1, dim 2
}

}  // namespace
}  // namespace kvt
