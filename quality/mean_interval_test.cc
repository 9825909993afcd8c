#include "quality/mean_interval.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(StudentT95, MatchesPublishedQuantiles) {
  // t(0.95, dof) from standard tables (to 3 decimals).
  for (const auto& [dof, t] : std::vector<std::pair<int, double>>{
           {1, 6.314}, {2, 2.920}, {5, 2.015}, {10, 1.812}, {30, 1.697}, {40, 1.684},
           {60, 1.671}, {120, 1.658}, {1000, 1.646}}) {
    EXPECT_NEAR(StudentT95(dof), t, 1.5e-3) << dof;
  }
  EXPECT_TRUE(std::isnan(StudentT95(0)));
}

TEST(StudentT95, FallsTowardsTheNormalQuantile) {
  for (int dof = 2; dof < 500; ++dof) EXPECT_LT(StudentT95(dof), StudentT95(dof - 1)) << dof;
  EXPECT_NEAR(StudentT95(1000000), 1.6448536, 1e-5);
}

TEST(MeanWithLowerBound, KnownSample) {
  // mean 0.9, sd sqrt(((-0.02)^2 * 2 + 0.02^2 * 2) / 3) = 0.023094; t(0.95, 3) = 2.353.
  const MeanInterval m = MeanWithLowerBound({0.88, 0.88, 0.92, 0.92});
  EXPECT_EQ(m.n, 4);
  EXPECT_NEAR(m.mean, 0.9, 1e-12);
  EXPECT_NEAR(m.sd, 0.0230940, 1e-6);
  ASSERT_TRUE(m.lower95.has_value());
  EXPECT_NEAR(*m.lower95, 0.9 - 2.353 * 0.0230940 / 2, 1e-6);
}

TEST(MeanWithLowerBound, OneSequenceHasNoBoundAndNoneIsEmpty) {
  const MeanInterval one = MeanWithLowerBound({0.877});
  EXPECT_EQ(one.n, 1);
  EXPECT_DOUBLE_EQ(one.mean, 0.877);
  EXPECT_FALSE(one.lower95.has_value());
  EXPECT_EQ(MeanWithLowerBound({}).n, 0);
}

TEST(MeanWithLowerBound, MoreSequencesOfTheSameSpreadTightenTheBound) {
  std::vector<double> few = {0.85, 0.95}, many;
  for (int i = 0; i < 32; ++i) many.push_back(i % 2 ? 0.95 : 0.85);
  EXPECT_LT(*MeanWithLowerBound(few).lower95, *MeanWithLowerBound(many).lower95);
  EXPECT_LT(*MeanWithLowerBound(many).lower95, 0.9);
}

}  // namespace
}  // namespace kvt
