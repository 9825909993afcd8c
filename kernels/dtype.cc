#include "kernels/dtype.h"

#include <cmath>

#include <immintrin.h>

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

namespace bulk_internal {

bool CpuHasAvx512Bw() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
}

void BF16ToFloatAvx2(const uint16_t* in, float* dst, int64_t count) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= count; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    const __m256i word = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(word));
  }
#endif
  for (; i < count; ++i) dst[i] = BF16ToFloat(in[i]);
}

void BF16FromFloatAvx2(const float* src, uint16_t* out, int64_t count) {
  int64_t i = 0;
#if defined(__AVX2__)
  // FloatToBF16 eight at a time.
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
    const __m256i result = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), is_nan);
    // Every lane is < 2^16, so the saturating pack is exact; it packs within 128-bit lanes,
    // hence the permute to bring elements 4..7 next to 0..3.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(result, result), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < count; ++i) out[i] = FloatToBF16(src[i]);
}

// The same arithmetic sixteen lanes wide. Not vcvtneps2bf16 (AVX512-BF16): that instruction
// flushes subnormals to zero, and every path here must agree with FloatToBF16 bit for bit.
// The zero-masking forms with every lane selected (kAll) are the same instructions as the plain
// ones; gcc 12's plain forms pass _mm512_undefined_*() as the merge source, a self-initialised
// variable it then reports under -Wmaybe-uninitialized.
constexpr __mmask16 kAll = 0xffff;

__attribute__((target("avx512f,avx512bw"))) void BF16ToFloatAvx512(const uint16_t* in,
                                                                     float* dst, int64_t count) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m512i word =
        _mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, half), 16);
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(word));
  }
  for (; i < count; ++i) dst[i] = BF16ToFloat(in[i]);
}

__attribute__((target("avx512f,avx512bw"))) void BF16FromFloatAvx512(const float* src,
                                                                       uint16_t* out,
                                                                       int64_t count) {
  int64_t i = 0;
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i bias = _mm512_set1_epi32(0x7fff);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  for (; i + 16 <= count; i += 16) {
    const __m512i word = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    const __m512i high = _mm512_maskz_srli_epi32(kAll, word, 16);
    const __m512i lsb = _mm512_and_si512(high, one);
    const __m512i rounded =
        _mm512_maskz_srli_epi32(kAll, _mm512_add_epi32(word, _mm512_add_epi32(bias, lsb)), 16);
    const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(word, abs_mask), inf);
    const __m512i result = _mm512_mask_or_epi32(rounded, is_nan, high, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_maskz_cvtepi32_epi16(kAll, result));
  }
  for (; i < count; ++i) out[i] = FloatToBF16(src[i]);
}

}  // namespace bulk_internal

void ToFloat(DType dtype, const void* src, float* dst, int64_t count) {
  if (count <= 0) return;  // empty buffers may be null, which memcpy must not see
  switch (dtype) {
    case DType::kFP32:
      std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::kBF16: {
      const uint16_t* in = static_cast<const uint16_t*>(src);
      if (bulk_internal::CpuHasAvx512Bw()) {
        bulk_internal::BF16ToFloatAvx512(in, dst, count);
      } else {
        bulk_internal::BF16ToFloatAvx2(in, dst, count);
      }
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
      if (bulk_internal::CpuHasAvx512Bw()) {
        bulk_internal::BF16FromFloatAvx512(src, out, count);
      } else {
        bulk_internal::BF16FromFloatAvx2(src, out, count);
      }
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
