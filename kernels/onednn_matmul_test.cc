#include "kernels/onednn_matmul.h"

#include <cmath>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

// x w + bias, ReLU optional, in float64.
std::vector<double> Reference(const std::vector<float>& x, const std::vector<float>& w,
                              const std::vector<float>& bias, int64_t m, int64_t k, int64_t n,
                              bool relu) {
  std::vector<double> y(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = bias.empty() ? 0.0 : bias[j];
      for (int64_t p = 0; p < k; ++p) sum += double{x[i * k + p]} * w[p * n + j];
      y[i * n + j] = relu && sum < 0 ? 0.0 : sum;
    }
  }
  return y;
}

std::vector<float> Random(size_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> v(count);
  for (float& e : v) e = normal(rng);
  return v;
}

// fp32 weights packed as fp32 give sgemm's accuracy: relative error at fp32 rounding of a
// k-term sum, far below SPEC 3's 1e-5, with bias and ReLU fused, from every weight dtype.
TEST(OnednnMatmulTest, F32MatmulMatchesFloat64) {
  std::mt19937 rng(7);
  for (const auto& [m, k, n] : {std::tuple<int64_t, int64_t, int64_t>{1, 64, 32},
                                {37, 96, 80},
                                {512, 256, 128}}) {
    const std::vector<float> x = Random(m * k, rng), w = Random(k * n, rng),
                             bias = Random(n, rng);
    for (bool relu : {false, true}) {
      absl::StatusOr<std::unique_ptr<PackedWeights>> packed =
          PackWeights(DType::kFP32, DType::kFP32, w.data(), k, n);
      ASSERT_TRUE(packed.ok()) << packed.status();
      EXPECT_EQ((*packed)->dtype(), DType::kFP32);
      EXPECT_EQ((*packed)->bytes(), *PackedWeightBytes(DType::kFP32, k, n));
      std::vector<float> y(m * n);
      ASSERT_TRUE(F32Matmul(m, x.data(), k, **packed, bias.data(), relu, y.data(), n).ok());
      const std::vector<double> want = Reference(x, w, bias, m, k, n, relu);
      double scale = 0, worst = 0;
      for (size_t i = 0; i < y.size(); ++i) scale = std::max(scale, std::abs(want[i]));
      for (size_t i = 0; i < y.size(); ++i) worst = std::max(worst, std::abs(y[i] - want[i]));
      EXPECT_LT(worst / scale, 1e-6) << m << "x" << k << "x" << n << " relu " << relu;
    }
  }
}

// bf16 weights packed as fp32 are exact (bf16 -> fp32 loses nothing); the matmul then equals
// the fp32 one on the same values.
TEST(OnednnMatmulTest, Bf16WeightsPackedAsF32AreExact) {
  std::mt19937 rng(11);
  const int64_t m = 16, k = 64, n = 48;
  std::vector<float> w = Random(k * n, rng);
  std::vector<uint16_t> w16(w.size());
  FromFloat(DType::kBF16, w.data(), w16.data(), static_cast<int64_t>(w.size()));
  ToFloat(DType::kBF16, w16.data(), w.data(), static_cast<int64_t>(w.size()));
  const std::vector<float> x = Random(m * k, rng);
  auto from16 = PackWeights(DType::kFP32, DType::kBF16, w16.data(), k, n);
  auto from32 = PackWeights(DType::kFP32, DType::kFP32, w.data(), k, n);
  ASSERT_TRUE(from16.ok() && from32.ok());
  std::vector<float> a(m * n), b(m * n);
  ASSERT_TRUE(F32Matmul(m, x.data(), k, **from16, nullptr, false, a.data(), n).ok());
  ASSERT_TRUE(F32Matmul(m, x.data(), k, **from32, nullptr, false, b.data(), n).ok());
  EXPECT_EQ(a, b);
}

TEST(OnednnMatmulTest, WeightsOfTheWrongTypeAreRefused) {
  const std::vector<float> w(32 * 16, 0.5f), x(4 * 32, 1.0f);
  std::vector<float> y(4 * 16);
  auto f32 = PackWeights(DType::kFP32, DType::kFP32, w.data(), 32, 16);
  ASSERT_TRUE(f32.ok());
  std::vector<uint16_t> x16(x.size());
  FromFloat(DType::kBF16, x.data(), x16.data(), static_cast<int64_t>(x.size()));
  const absl::Status status =
      Bf16Matmul(4, x16.data(), 32, **f32, nullptr, false, false, y.data(), 16);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("packed as fp32"));
  EXPECT_EQ(PackWeights(DType::kFP16, DType::kFP32, w.data(), 32, 16).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(F32MatmulImplementation(512, 256, 128).value_or(""), ::testing::Not(""));
}

}  // namespace
}  // namespace kvt
