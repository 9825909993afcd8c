#include "kernels/dtype.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvt {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Independent bf16 rounding: the two bf16 neighbours of a finite float, nearest by double
// distance, ties to the even mantissa.
uint16_t OracleBF16(float f) {
  const uint32_t u = Bits(f);
  const uint16_t down = static_cast<uint16_t>(u >> 16);  // toward zero
  if ((u & 0xffffu) == 0) return down;
  const uint16_t up = static_cast<uint16_t>(down + 1);  // away from zero (may reach inf)
  double up_value = BF16ToFloat(up);
  // Past the largest finite bf16 the next step is 2^128, as if the exponent were unbounded.
  if (std::isinf(up_value)) up_value = std::copysign(std::ldexp(1.0, 128), up_value);
  const double to_down = std::abs(static_cast<double>(f) - BF16ToFloat(down));
  const double to_up = std::abs(up_value - f);
  if (to_down < to_up) return down;
  if (to_up < to_down) return up;
  return (down & 1) ? up : down;
}

TEST(BF16Test, EveryPatternRoundTrips) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = BF16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(f)))) << b;
    } else {
      EXPECT_EQ(FloatToBF16(f), b) << b;
    }
  }
}

TEST(BF16Test, RoundsToNearestEven) {
  // ulp(1) = 2^-7 in bf16.
  EXPECT_EQ(FloatToBF16(1.0f + std::ldexp(1.0f, -8)), FloatToBF16(1.0f));  // tie -> even
  EXPECT_EQ(FloatToBF16(1.0f + 3 * std::ldexp(1.0f, -8)),
            FloatToBF16(1.0f + std::ldexp(1.0f, -6)));  // tie -> even (up)
  EXPECT_EQ(FloatToBF16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
            FloatToBF16(1.0f + std::ldexp(1.0f, -7)));  // above the tie
  EXPECT_EQ(FloatToBF16(-1.0f - std::ldexp(1.0f, -8)), 0xbf80);
  std::mt19937 rng(12345);
  for (int i = 0; i < 1000000; ++i) {
    const float f = FromBits(rng());
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBF16(f), OracleBF16(f)) << std::hexfloat << f;
  }
}

TEST(BF16Test, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToBF16(inf), 0x7f80);
  EXPECT_EQ(FloatToBF16(-inf), 0xff80);
  EXPECT_EQ(BF16ToFloat(0x7f80), inf);
  EXPECT_EQ(FloatToBF16(std::numeric_limits<float>::max()), 0x7f80);  // rounds past the top
  EXPECT_EQ(FloatToBF16(-0.0f), 0x8000);
  const uint16_t nan = FloatToBF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_TRUE(std::isnan(BF16ToFloat(nan)));
  // A signalling NaN whose payload sits only in the low bits must not truncate to infinity.
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(FromBits(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(BF16ToFloat(FloatToBF16(FromBits(0xff800001u)))));
  // Subnormals survive (bf16 shares float's exponent range).
  const float tiny = FromBits(0x00010000u);
  EXPECT_EQ(BF16ToFloat(FloatToBF16(tiny)), tiny);
  EXPECT_EQ(FloatToBF16(FromBits(0x00008000u)), 0x0000);  // tie -> even (zero)
  EXPECT_EQ(FloatToBF16(FromBits(0x00018000u)), 0x0002);  // tie -> even (up)
}

TEST(FP16Test, EveryPatternRoundTripsAndMatchesHardware) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = FP16ToFloat(static_cast<uint16_t>(h));
    const float hardware = _cvtsh_ss(static_cast<unsigned short>(h));
    if (std::isnan(hardware)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(std::isnan(FP16ToFloat(FloatToFP16(f)))) << h;
    } else {
      EXPECT_EQ(Bits(f), Bits(hardware)) << h;
      EXPECT_EQ(FloatToFP16(f), h) << h;
    }
  }
}

TEST(FP16Test, RoundingMatchesHardware) {
  std::mt19937 rng(777);
  std::uniform_int_distribution<int> exponent(100, 150);  // around the fp16 range
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng();
    // Half the samples near fp16's range (subnormals, normals, overflow), half anywhere.
    if (i % 2) u = (u & 0x807fffffu) | (static_cast<uint32_t>(exponent(rng)) << 23);
    const float f = FromBits(u);
    const uint16_t hardware = static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(FP16ToFloat(FloatToFP16(f))));
      continue;
    }
    ASSERT_EQ(FloatToFP16(f), hardware) << std::hexfloat << f;
  }
}

TEST(FP16Test, KnownValues) {
  EXPECT_EQ(FloatToFP16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFP16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);        // tie -> even
  EXPECT_EQ(FloatToFP16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);    // tie -> even (up)
  EXPECT_EQ(FloatToFP16(65504.0f), 0x7bff);                            // largest finite
  EXPECT_EQ(FloatToFP16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFP16(65520.0f), 0x7c00);                            // rounds to inf
  EXPECT_EQ(FloatToFP16(std::ldexp(1.0f, -24)), 0x0001);               // smallest subnormal
  EXPECT_EQ(FloatToFP16(std::ldexp(1.0f, -25)), 0x0000);               // tie -> even (zero)
  EXPECT_EQ(FloatToFP16(3 * std::ldexp(1.0f, -25)), 0x0002);           // tie -> even (up)
  EXPECT_EQ(FloatToFP16(std::ldexp(1.0f, -14)), 0x0400);               // smallest normal
  EXPECT_EQ(FloatToFP16(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)), 0x0400);  // carries
  EXPECT_EQ(FP16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(FP16ToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(FloatToFP16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToFP16(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(FP16ToFloat(FloatToFP16(std::numeric_limits<float>::quiet_NaN()))));
}

// The bulk converters (vectorised where the CPU allows) agree bit for bit with the scalar ones,
// including tails that are not a multiple of the vector width.
TEST(BulkConversionTest, MatchesScalar) {
  std::mt19937 rng(99);
  for (int64_t count : {0, 1, 7, 8, 9, 1003}) {
    std::vector<float> values(count);
    for (float& v : values) {
      uint32_t u = rng();
      if (rng() % 4) u = (u & 0x807fffffu) | ((112u + rng() % 32) << 23);
      if (rng() % 16 == 0) u |= 0x7f800000u;  // infinities and NaNs of every payload
      v = FromBits(u);
    }
    for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
      std::vector<uint8_t> stored(count * DTypeSize(dtype) + 1);
      FromFloat(dtype, values.data(), stored.data(), count);
      std::vector<float> back(count);
      ToFloat(dtype, stored.data(), back.data(), count);
      for (int64_t i = 0; i < count; ++i) {
        uint16_t scalar_bits = 0;
        float scalar_back = values[i];
        if (dtype == DType::kBF16) {
          scalar_bits = FloatToBF16(values[i]);
          scalar_back = BF16ToFloat(scalar_bits);
        } else if (dtype == DType::kFP16) {
          scalar_bits = FloatToFP16(values[i]);
          scalar_back = FP16ToFloat(scalar_bits);
        }
        if (dtype != DType::kFP32) {
          uint16_t bulk_bits;
          std::memcpy(&bulk_bits, stored.data() + 2 * i, 2);
          if (std::isnan(values[i]) && dtype == DType::kFP16) {
            EXPECT_TRUE(std::isnan(back[i]));  // F16C keeps NaN payload bits the scalar drops
          } else {
            ASSERT_EQ(bulk_bits, scalar_bits) << DTypeName(dtype) << " " << i;
          }
        }
        if (!std::isnan(values[i])) {
          ASSERT_EQ(Bits(back[i]), Bits(scalar_back)) << DTypeName(dtype) << " " << i;
        }
        if (!std::isnan(back[i])) {
          EXPECT_EQ(LoadAsDouble(dtype, stored.data(), i), static_cast<double>(back[i]))
              << DTypeName(dtype);
        }
      }
    }
  }
}

// Each bf16 bulk variant this CPU can run (AVX2 always, AVX-512 BW where present) agrees with
// the scalar conversions bit for bit, at every tail length around both vector widths;
// subnormals included (the hardware's vcvtneps2bf16 would flush them).
TEST(BulkConversionTest, EveryBf16VariantMatchesScalar) {
  using Variant = std::pair<void (*)(const float*, uint16_t*, int64_t),
                            void (*)(const uint16_t*, float*, int64_t)>;
  std::vector<Variant> variants = {
      {bulk_internal::BF16FromFloatAvx2, bulk_internal::BF16ToFloatAvx2}};
  if (bulk_internal::CpuHasAvx512Bw()) {
    variants.push_back({bulk_internal::BF16FromFloatAvx512, bulk_internal::BF16ToFloatAvx512});
  }
  std::mt19937 rng(7);
  for (const Variant& variant : variants) {
    for (int64_t count : {0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 1003}) {
      std::vector<float> values(count);
      for (float& v : values) {
        uint32_t u = rng();
        if (rng() % 4) u = (u & 0x807fffffu) | ((112u + rng() % 32) << 23);
        if (rng() % 8 == 0) u &= 0x807fffffu;   // subnormals and zeros
        if (rng() % 16 == 0) u |= 0x7f800000u;  // infinities and NaNs of every payload
        v = FromBits(u);
      }
      std::vector<uint16_t> bits(count);
      variant.first(values.data(), bits.data(), count);
      std::vector<float> back(count);
      variant.second(bits.data(), back.data(), count);
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(bits[i], FloatToBF16(values[i])) << "count " << count << " element " << i;
        ASSERT_EQ(Bits(back[i]), Bits(BF16ToFloat(bits[i]))) << "count " << count;
      }
    }
  }
}

TEST(BulkConversionTest, StoreFromDoubleRoundsThroughFloat) {
  std::vector<uint16_t> bf16(2);
  StoreFromDouble(DType::kBF16, bf16.data(), 1, 1.0 + std::ldexp(1.0, -7));
  EXPECT_EQ(bf16[1], 0x3f81);
  std::vector<float> fp32(1);
  StoreFromDouble(DType::kFP32, fp32.data(), 0, 0.1);
  EXPECT_EQ(fp32[0], 0.1f);
  std::vector<uint16_t> fp16(1);
  StoreFromDouble(DType::kFP16, fp16.data(), 0, -2.0);
  EXPECT_EQ(fp16[0], 0xc000);
}

TEST(DTypeNamesTest, ParseAndName) {
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("float16"), DType::kFP16);
  EXPECT_EQ(*ParseDType("F32"), DType::kFP32);
  EXPECT_FALSE(ParseDType("int8").ok());
  EXPECT_EQ(DTypeSize(DType::kFP32), 4u);
  EXPECT_STREQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_EQ(*ParseLayout("nhd"), Layout::kNHD);
  EXPECT_FALSE(ParseLayout("THD").ok());
  // [heads, tokens, dim] vs [tokens, heads, dim].
  EXPECT_EQ(CacheOffset(Layout::kHND, 4, 10, 8, 2, 3, 5), (2 * 10 + 3) * 8 + 5);
  EXPECT_EQ(CacheOffset(Layout::kNHD, 4, 10, 8, 2, 3, 5), (3 * 4 + 2) * 8 + 5);
}

}  // namespace
}  // namespace kvt
