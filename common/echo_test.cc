#include "common/echo.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(Echo, ShortValuesPassUnchanged) {
  EXPECT_EQ(Echo("test/src"), "test/src");
  EXPECT_EQ(Echo(std::string(kMaxEchoBytes, 'a')), std::string(kMaxEchoBytes, 'a'));
}

TEST(Echo, LongValuesAreCutAndSized) {
  const std::string echoed = Echo(std::string(100000, 'm'));
  EXPECT_EQ(echoed, std::string(kMaxEchoBytes, 'm') + "...(100000 bytes)");
}

TEST(Echo, NeverSplitsAUtf8Character) {
  // 'é' is 2 bytes: a cut at an odd byte would split one.
  std::string value;
  for (int i = 0; i < 100; ++i) value += "\xC3\xA9";
  EXPECT_EQ(Echo(value, 5), "\xC3\xA9\xC3\xA9...(200 bytes)");
}

// The cost of the bound on the path every error takes (printed; the test only checks it runs).
TEST(Echo, CostOfBoundingATypicalMessage) {
  const std::string typical = "header.mapper_id='test/src-to-dst': no such mapper in the store";
  const int kRounds = 1000000;
  size_t total = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kRounds; ++i) total += Echo(typical, kMaxStatusMessageBytes).size();
  const double ns = std::chrono::duration<double, std::nano>(
                        std::chrono::steady_clock::now() - start).count() / kRounds;
  std::printf("Echo of a %zu-byte message: %.1f ns\n", typical.size(), ns);
  EXPECT_EQ(total, typical.size() * kRounds);
}

}  // namespace
}  // namespace kvt
