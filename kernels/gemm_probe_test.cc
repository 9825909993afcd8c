#include "kernels/gemm_probe.h"

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/onednn_matmul.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

TEST(GemmProbeTest, TimesBothEnginesOnTheLargestDistinctShapes) {
  GemmProbeOptions options;
  options.shapes = {{64, 32}, {256, 128}, {64, 32}, {0, 5}, {128, 128}, {512, 64}};
  options.rows = 16;
  options.budget = absl::Milliseconds(20);
  options.max_shapes = 2;
  const GemmProbeResult result = ProbeGemmEngines(options);
  // Duplicates and empty shapes dropped, the two largest by k * n kept, largest first.
  ASSERT_EQ(result.shapes.size(), 2u);
  EXPECT_EQ(result.shapes[0], (GemmShape{256, 128}));
  EXPECT_EQ(result.shapes[1], (GemmShape{512, 64}));
  EXPECT_EQ(result.rows, 16);
  const GemmEngineTiming& sgemm = result.timing(GemmEngine::kSgemm);
  EXPECT_TRUE(sgemm.available);
  EXPECT_GE(sgemm.calls, 2 * 2);
  EXPECT_GT(sgemm.seconds, 0);
  EXPECT_GT(sgemm.gflops, 0);
  EXPECT_TRUE(result.timing(GemmEngine::kOnednnF32).available);
  EXPECT_EQ(result.timing(GemmEngine::kOnednnBf16).available, OnednnBf16MatmulAvailable());
  // The engines take turns: each available one got as many calls as sgemm.
  for (const GemmEngineTiming& timing : result.engines) {
    if (timing.available) EXPECT_EQ(timing.calls, sgemm.calls);
  }
  // Fastest is the least time among the available (exact) engines, or sgemm when that engine
  // does not beat it by the margin.
  for (bool fp32_only : {false, true}) {
    const GemmEngine fastest = result.Fastest(fp32_only);
    EXPECT_TRUE(result.timing(fastest).available);
    if (fp32_only) EXPECT_TRUE(IsFp32Engine(fastest));
    if (fastest == GemmEngine::kSgemm) continue;
    EXPECT_LT(result.timing(fastest).seconds * kGemmSwitchMargin, sgemm.seconds);
    for (int e = 0; e < kNumGemmEngines; ++e) {
      const GemmEngine engine = static_cast<GemmEngine>(e);
      if (!result.engines[e].available || (fp32_only && !IsFp32Engine(engine))) continue;
      EXPECT_LE(result.timing(fastest).seconds, result.engines[e].seconds)
          << GemmEngineName(engine);
    }
  }
  EXPECT_THAT(result.Summary(), HasSubstr("x 16 rows (256x128, 512x64)"));
  EXPECT_THAT(result.Summary(), HasSubstr("x 16 rows (256x128, 512x64); sgemm on OpenBLAS core "));
}

// The rule on made-up timings: the fastest wins only by the margin over sgemm; bf16 is never an
// answer for fp32 mappers, nor when unavailable.
TEST(GemmProbeTest, FastestNeedsTheMarginOverSgemm) {
  GemmProbeResult result;
  const auto set = [&](GemmEngine engine, bool available, double seconds) {
    result.engines[static_cast<int>(engine)] = {available, seconds, 1.0 / seconds, 2};
  };
  set(GemmEngine::kSgemm, true, 1.0);
  set(GemmEngine::kOnednnF32, true, 0.9);   // 1.11x: not enough
  set(GemmEngine::kOnednnBf16, true, 0.45);  // 2.2x
  EXPECT_EQ(result.Fastest(false), GemmEngine::kOnednnBf16);
  EXPECT_EQ(result.Fastest(true), GemmEngine::kSgemm);
  set(GemmEngine::kOnednnF32, true, 0.3);  // 3.3x, as where OpenBLAS does not know the CPU
  EXPECT_EQ(result.Fastest(false), GemmEngine::kOnednnF32);
  EXPECT_EQ(result.Fastest(true), GemmEngine::kOnednnF32);
  set(GemmEngine::kOnednnF32, false, 0.0);
  set(GemmEngine::kOnednnBf16, false, 0.0);
  EXPECT_EQ(result.Fastest(false), GemmEngine::kSgemm);
}

TEST(GemmProbeTest, NoShapesMeansTheDefaultShape) {
  GemmProbeOptions options;
  options.rows = 8;
  options.budget = absl::Milliseconds(5);
  const GemmProbeResult result = ProbeGemmEngines(options);
  ASSERT_EQ(result.shapes.size(), 1u);
  EXPECT_EQ(result.shapes[0], kDefaultProbeShape);
}

// The budget bounds the timed calls: at most one call of each engine per shape past it.
TEST(GemmProbeTest, StaysWithinItsBudget) {
  GemmProbeOptions options;
  options.shapes = {{1024, 1024}};
  options.rows = 64;
  options.budget = absl::Milliseconds(50);
  const absl::Time start = absl::Now();
  const GemmProbeResult result = ProbeGemmEngines(options);
  double per_round = 0;
  for (const GemmEngineTiming& timing : result.engines) per_round += timing.seconds;
  // Packing, the untimed first calls and one round past the deadline, with a wide margin for a
  // loaded machine: the loop must stop, not run for seconds.
  EXPECT_LT(absl::ToDoubleSeconds(absl::Now() - start), 0.05 + 50 * per_round + 1.0);
}

TEST(GemmProbeTest, OnceMeasuresEachShapeSetOnce) {
  GemmProbeOptions options;
  options.shapes = {{96, 48}};
  options.rows = 8;
  options.budget = absl::Milliseconds(5);
  const GemmProbeResult first = ProbeGemmEnginesOnce(options);
  const GemmProbeResult again = ProbeGemmEnginesOnce(options);
  EXPECT_EQ(again.timing(GemmEngine::kSgemm).seconds, first.timing(GemmEngine::kSgemm).seconds);
  EXPECT_EQ(again.timing(GemmEngine::kSgemm).calls, first.timing(GemmEngine::kSgemm).calls);
  options.rows = 16;  // another measurement
  EXPECT_EQ(ProbeGemmEnginesOnce(options).rows, 16);
}

}  // namespace
}  // namespace kvt
