#include "kernels/dtype.h"

#include <cmath>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvt {

float FP16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t word;
  if (exponent == 0) {
    if (mantissa == 0) {
      word = sign;
    } else {
      // Subnormal: normalise.
      int shift = 0;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        ++shift;
      }
      mantissa &= 0x3ffu;
      word = sign | (static_cast<uint32_t>(127 - 15 - shift + 1) << 23) | (mantissa << 13);
    }
  } else if (exponent == 0x1f) {
    word = sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u);
  } else {
    word = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

uint16_t FloatToFP16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  const uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  const uint32_t abs = word & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;          // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;         // overflow (>= 65520) -> inf
  if (abs < 0x38800000u) {                               // below the smallest normal half
    if (abs < 0x33000000u) return sign;                  // rounds to zero
    // Subnormal half: value = m * 2^-24, round to nearest even.
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14..24
    const uint32_t half_mantissa = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t result = half_mantissa;
    if (remainder > halfway || (remainder == halfway && (half_mantissa & 1u))) ++result;
    return sign | static_cast<uint16_t>(result);
  }
  // Normal: rebias exponent, round mantissa to 10 bits, nearest even (carry may bump exponent).
  const uint32_t rebased = abs - ((127u - 15u) << 23);
  const uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

void ToFloat(DType dtype, const void* src, float* dst, int64_t count) {
  if (count <= 0) return;  // empty buffers may be null, which memcpy must not see
  switch (dtype) {
    case DType::kFP32:
      std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::kBF16: {
      const uint16_t* in = static_cast<const uint16_t*>(src);
      uint32_t* out = reinterpret_cast<uint32_t*>(dst);
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
      return;
    }
    case DType::kFP16: {
      const uint16_t* in = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= count; i += 8) {
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(half));
      }
#endif
      for (; i < count; ++i) dst[i] = FP16ToFloat(in[i]);
      return;
    }
  }
}

void FromFloat(DType dtype, const float* src, void* dst, int64_t count) {
  if (count <= 0) return;  // empty buffers may be null, which memcpy must not see
  switch (dtype) {
    case DType::kFP32:
      std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::kBF16: {
      uint16_t* out = static_cast<uint16_t*>(dst);
      int64_t i = 0;
#if defined(__AVX2__)
      // FloatToBF16 eight at a time: the translate epilogue's hottest conversion.
      const __m256i one = _mm256_set1_epi32(1);
      const __m256i bias = _mm256_set1_epi32(0x7fff);
      const __m256i quiet = _mm256_set1_epi32(0x40);
      const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
      const __m256i inf = _mm256_set1_epi32(0x7f800000);
      for (; i + 8 <= count; i += 8) {
        const __m256i word = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        const __m256i high = _mm256_srli_epi32(word, 16);
        const __m256i lsb = _mm256_and_si256(high, one);
        const __m256i rounded =
            _mm256_srli_epi32(_mm256_add_epi32(word, _mm256_add_epi32(bias, lsb)), 16);
        const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(word, abs_mask), inf);
        const __m256i result =
            _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), is_nan);
        // Every lane is < 2^16, so the saturating pack is exact; it packs within 128-bit
        // lanes, hence the permute to bring elements 4..7 next to 0..3.
        const __m256i packed =
            _mm256_permute4x64_epi64(_mm256_packus_epi32(result, result), 0xd8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
      }
#endif
      for (; i < count; ++i) out[i] = FloatToBF16(src[i]);
      return;
    }
    case DType::kFP16: {
      uint16_t* out = static_cast<uint16_t*>(dst);
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= count; i += 8) {
        const __m128i half =
            _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), half);
      }
#endif
      for (; i < count; ++i) out[i] = FloatToFP16(src[i]);
      return;
    }
  }
}

double LoadAsDouble(DType dtype, const void* base, int64_t index) {
  switch (dtype) {
    case DType::kFP32:
      return static_cast<const float*>(base)[index];
    case DType::kBF16:
      return BF16ToFloat(static_cast<const uint16_t*>(base)[index]);
    case DType::kFP16:
      return FP16ToFloat(static_cast<const uint16_t*>(base)[index]);
  }
  return std::nan("");
}

void StoreFromDouble(DType dtype, void* base, int64_t index, double value) {
  const float f = static_cast<float>(value);
  switch (dtype) {
    case DType::kFP32:
      static_cast<float*>(base)[index] = f;
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[index] = FloatToBF16(f);
      return;
    case DType::kFP16:
      static_cast<uint16_t*>(base)[index] = FloatToFP16(f);
      return;
  }
}

}  // namespace kvt
