#include "quality/input_shift.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/testing/reference.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"
#include "mapper_store/synth.h"
#include "quality/stats_testing.h"

namespace kvt {
namespace {

constexpr int kLayers = 3, kHeads = 2, kDim = 16, kWidth = kHeads * kDim;

SynthOptions Options() {
  SynthOptions options;
  for (ModelSpec* model : {&options.source, &options.target}) {
    model->num_layers = kLayers;
    model->num_kv_heads = kHeads;
    model->head_dim = kDim;
    model->rope.theta = 10000;
    model->rope.rotary_dim = kDim;
  }
  options.source.name = "test/src";
  options.target.name = "test/dst";
  options.k = 2;
  options.dtype = DType::kFP32;
  options.seed = 3;
  return options;
}

// The calibration distribution of feature i of every layer: mean and variance.
double Mean(int layer, bool keys, int i) { return 0.5 * std::sin(i + layer + keys); }
double Var(int layer, bool keys, int i) { return 0.25 + (i % 5) * 0.5 + layer * 0.1 + keys; }

// A mapper directory: synthetic weights plus (optionally) the stats `kvt fit` stores.
std::unique_ptr<LoadedMapper> WriteMapper(const std::string& dir, bool with_stats,
                                          DType stats_dtype = DType::kFP32) {
  if (with_stats) {
    KVT_EXPECT_OK(testing::WriteSynthMapperWithStats(
        dir, Options(),
        [](int layer, bool keys, int i, bool variance) {
          return variance ? Var(layer, keys, i) : Mean(layer, keys, i);
        },
        stats_dtype));
  } else {
    KVT_EXPECT_OK(WriteSynthMapper(dir, Options()));
  }
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(dir);
  EXPECT_TRUE(mapper.ok()) << mapper.status();
  return std::move(*mapper);
}

// A source cache whose content-space features are N(mean + shift * sd, (scale * sd)^2) per
// feature; keys then get the source RoPE at their positions, as a model writes them.
testing::OwnedCache MakeSource(int64_t tokens, uint64_t first_position, double shift,
                               double scale, uint64_t seed) {
  testing::OwnedCache cache = testing::MakeRandomCache(kLayers, kHeads, kDim, tokens, DType::kBF16,
                                                       Layout::kNHD, seed);
  const Rope rope = *Rope::Create(Options().source.rope, kDim);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::vector<double> head(kDim);
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int kind = 0; kind < 2; ++kind) {
        for (int h = 0; h < kHeads; ++h) {
          for (int d = 0; d < kDim; ++d) {
            const int i = h * kDim + d;
            const double sd = std::sqrt(Var(layer, kind == 0, i));
            head[d] = Mean(layer, kind == 0, i) + sd * (shift + scale * normal(rng));
          }
          if (kind == 0) testing::RotateDouble(rope, first_position + t, false, head.data());
          uint8_t* base = (kind == 0 ? cache.k : cache.v)[layer].data();
          for (int d = 0; d < kDim; ++d) {
            StoreFromDouble(DType::kBF16, base,
                            CacheOffset(Layout::kNHD, kHeads, tokens, kDim, h, t, d), head[d]);
          }
        }
      }
    }
  }
  return cache;
}

TEST(InputShiftTest, AboutOneInDistributionAndClearlyHigherWhenShifted) {
  const std::string dir = testing::MakeTempDir("shift") + "/with-stats";
  std::unique_ptr<LoadedMapper> mapper = WriteMapper(dir, true);
  absl::StatusOr<std::optional<InputShiftStats>> stats = InputShiftStats::FromMapper(*mapper);
  ASSERT_TRUE(stats.ok()) << stats.status();
  ASSERT_TRUE(stats->has_value());
  Positions positions;
  positions.offset = 5000;
  const testing::OwnedCache same = MakeSource(700, 5000, 0.0, 1.0, 1);
  const double in_distribution = (*stats)->Score(same.view, positions);
  EXPECT_NEAR(in_distribution, 1.0, 0.1);
  // Twice the spread: E = 4. Shifted by one standard deviation: E = 2.
  const double wider = (*stats)->Score(MakeSource(700, 5000, 0.0, 2.0, 2).view, positions);
  EXPECT_NEAR(wider, 4.0, 0.5);
  const double shifted = (*stats)->Score(MakeSource(700, 5000, 1.0, 1.0, 3).view, positions);
  EXPECT_NEAR(shifted, 2.0, 0.25);
  std::fprintf(stderr, "scores: in %.3f, 2x spread %.3f, shifted 1 sd %.3f\n", in_distribution,
               wider, shifted);
}

TEST(InputShiftTest, AbsentWithoutStatsAndAnErrorForMalformedOnes) {
  const std::string root = testing::MakeTempDir("shift-none");
  std::unique_ptr<LoadedMapper> plain = WriteMapper(root + "/plain", false);
  absl::StatusOr<std::optional<InputShiftStats>> none = InputShiftStats::FromMapper(*plain);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->has_value());
  std::unique_ptr<LoadedMapper> bf16 = WriteMapper(root + "/bf16", true, DType::kBF16);
  KVT_EXPECT_ERROR(InputShiftStats::FromMapper(*bf16), absl::StatusCode::kInvalidArgument,
                   "must be F32");
}

TEST(InputShiftTest, TensorNamesAreWhatKvtFitWrites) {
  EXPECT_EQ(SourceStatsTensorName(3, 'k', false), "stats.source.3.k.mean");
  EXPECT_EQ(SourceStatsTensorName(12, 'v', true), "stats.source.12.v.var");
}

}  // namespace
}  // namespace kvt
