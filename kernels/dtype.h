// Conversion between the wire element types (bf16, fp16, fp32) and float: the one home of this
// logic for the CPU backend, the mapper store and the tools. The CUDA backend uses the
// hardware's conversions and is tested against these.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/types.h"

namespace kvt {

// bf16 <-> float. Rounds to nearest even; NaN stays NaN (quiet).
inline float BF16ToFloat(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t FloatToBF16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>((word + rounding_bias) >> 16);
}

// IEEE half <-> float. Rounds to nearest even; handles subnormals, infinities and NaN.
float FP16ToFloat(uint16_t bits);
uint16_t FloatToFP16(float value);

// Converts `count` elements of `dtype` at `src` to float.
void ToFloat(DType dtype, const void* src, float* dst, int64_t count);
// Converts `count` floats to `dtype` at `dst`.
void FromFloat(DType dtype, const float* src, void* dst, int64_t count);

// The bf16 bulk conversions ToFloat / FromFloat dispatch to, by the CPU this runs on (AVX-512
// BW where present, else AVX2), exposed so that tests can hold each to the scalar functions
// bit for bit on any machine that has it.
namespace bulk_internal {
bool CpuHasAvx512Bw();
void BF16ToFloatAvx2(const uint16_t* in, float* dst, int64_t count);
void BF16FromFloatAvx2(const float* src, uint16_t* out, int64_t count);
void BF16ToFloatAvx512(const uint16_t* in, float* dst, int64_t count);  // CpuHasAvx512Bw() only
void BF16FromFloatAvx512(const float* src, uint16_t* out, int64_t count);
}  // namespace bulk_internal

// Reads element `index` of a `dtype` array as double (tests, reference code, reports).
double LoadAsDouble(DType dtype, const void* base, int64_t index);
// Writes `value` (rounded through float) as element `index` of a `dtype` array.
void StoreFromDouble(DType dtype, void* base, int64_t index, double value);

}  // namespace kvt
