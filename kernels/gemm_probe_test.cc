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
  EXPECT_GE(result.sgemm.calls, 2 * 2);
  EXPECT_GT(result.sgemm.seconds, 0);
  EXPECT_GT(result.sgemm.gflops, 0);
  EXPECT_EQ(result.onednn_bf16.available, OnednnBf16MatmulAvailable());
  if (result.onednn_bf16.available) {
    EXPECT_EQ(result.onednn_bf16.calls, result.sgemm.calls);
    EXPECT_GT(result.onednn_bf16.gflops, 0);
    EXPECT_EQ(result.onednn_faster(), result.onednn_bf16.seconds < result.sgemm.seconds);
  } else {
    EXPECT_FALSE(result.onednn_faster());
  }
  EXPECT_THAT(result.Summary(), HasSubstr("x 16 rows (256x128, 512x64)"));
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
  const double per_round = result.sgemm.seconds + result.onednn_bf16.seconds;
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
  EXPECT_EQ(again.sgemm.seconds, first.sgemm.seconds);
  EXPECT_EQ(again.sgemm.calls, first.sgemm.calls);
  options.rows = 16;  // another measurement
  EXPECT_EQ(ProbeGemmEnginesOnce(options).rows, 16);
}

}  // namespace
}  // namespace kvt
