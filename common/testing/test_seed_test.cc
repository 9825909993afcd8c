#include "common/testing/test_seed.h"

#include <cstdlib>
#include <set>

#include "gtest/gtest.h"

namespace kvt {
namespace testing {
namespace {

constexpr uint64_t kBase = 42;

TEST(TestSeedTest, BaseSeedIsTheEnvironmentVariable) { EXPECT_EQ(TestSeedBase(), kBase); }

TEST(TestSeedTest, DrawsReplayFromTheBaseTestNameWhatAndCount) {
  const uint64_t a0 = FreshSeed("a");
  const uint64_t a1 = FreshSeed("a");
  const uint64_t b0 = FreshSeed("b");
  const char* test = "TestSeedTest.DrawsReplayFromTheBaseTestNameWhatAndCount";
  EXPECT_EQ(a0, DeriveSeed(kBase, test, "a", 0));
  EXPECT_EQ(a1, DeriveSeed(kBase, test, "a", 1));
  EXPECT_EQ(b0, DeriveSeed(kBase, test, "b", 0));
}

TEST(TestSeedTest, EveryInputChangesTheSeed) {
  const uint64_t seed = DeriveSeed(kBase, "S.T", "what", 0);
  EXPECT_EQ(seed, DeriveSeed(kBase, "S.T", "what", 0));
  const std::set<uint64_t> seeds = {
      seed,
      DeriveSeed(kBase + 1, "S.T", "what", 0),
      DeriveSeed(kBase, "S.U", "what", 0),
      DeriveSeed(kBase, "S.T", "wham", 0),
      DeriveSeed(kBase, "S.T", "what", 1),
      // The boundary between the test name and `what` counts.
      DeriveSeed(kBase, "S.Tw", "hat", 0),
  };
  EXPECT_EQ(seeds.size(), 6u);
}

}  // namespace
}  // namespace testing
}  // namespace kvt

int main(int argc, char** argv) {
  // Before any draw: the base seed is read once per process.
  setenv("KVT_TEST_SEED", "42", /*overwrite=*/1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
