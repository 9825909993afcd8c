#include "kernels/finite.h"

#include <chrono>
#include <cstdio>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/dtype.h"

namespace kvt {
namespace {

TEST(FirstNonFinite, FindsNanAndInfInEveryDtype) {
  for (const DType dtype : {DType::kFP32, DType::kBF16, DType::kFP16}) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()}) {
      std::vector<float> values(1000, 1.5f);
      values[700] = bad;
      values[900] = bad;
      std::vector<char> bytes(values.size() * DTypeSize(dtype));
      FromFloat(dtype, values.data(), bytes.data(), static_cast<int64_t>(values.size()));
      EXPECT_EQ(FirstNonFinite(dtype, bytes.data(), 1000), 700) << DTypeName(dtype);
      EXPECT_EQ(FirstNonFinite(dtype, bytes.data(), 700), std::nullopt) << DTypeName(dtype);
    }
  }
}

TEST(CheckFinite, NamesLayerKindAndElement) {
  // 2 layers, 2 heads, 3 tokens, dim 4, NHD.
  std::vector<float> k0(24, 0.f), v0(24, 0.f), k1(24, 0.f), v1(24, 0.f);
  v1[2 * 8 + 1 * 4 + 3] = std::numeric_limits<float>::quiet_NaN();  // token 2, head 1, dim 3
  CacheView view{DType::kFP32, Layout::kNHD, 2, 4, 3, {k0.data(), k1.data()}, {v0.data(), v1.data()}};
  const absl::Status s = CheckFinite(view, "header.input");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "header.input: layer 1 V element 23 (token 2, head 1, dim 3) is NaN; non-finite "
            "values are refused (limits.allow_non_finite)");
  v1[23] = 0;
  k0[1 * 12 + 0 * 4 + 2] = -std::numeric_limits<float>::infinity();  // HND: head 1, token 0
  view.layout = Layout::kHND;
  EXPECT_NE(CheckFinite(view, "f").message().find("layer 0 K element 14 (token 0, head 1, dim 2) is -Inf"),
            std::string::npos);
  k0[14] = 0;
  EXPECT_TRUE(CheckFinite(view, "f").ok());
}

// The policy's cost: GB/s of the scan over a finite cache (printed).
TEST(CheckFinite, Throughput) {
  for (const DType dtype : {DType::kFP32, DType::kBF16}) {
    const int64_t count = int64_t{32} << 20;
    std::vector<char> bytes(static_cast<size_t>(count) * DTypeSize(dtype), 0);
    const auto start = std::chrono::steady_clock::now();
    int rounds = 0;
    for (; rounds < 5; ++rounds) ASSERT_EQ(FirstNonFinite(dtype, bytes.data(), count), std::nullopt);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("FirstNonFinite %s: %.2f GB/s\n", DTypeName(dtype),
                static_cast<double>(bytes.size()) * rounds / s / 1e9);
  }
}

}  // namespace
}  // namespace kvt
