// Overflow-detecting int64 arithmetic for every size and offset derived from wire fields.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace kvt {

// nullopt when the exact result does not fit an int64.
inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}
inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}
// The product of `factors`; nullopt as soon as a partial product overflows (a later zero does
// not rescue it: callers reject zero sizes before multiplying).
inline std::optional<int64_t> CheckedProduct(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (const int64_t f : factors) {
    if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
  }
  return out;
}

}  // namespace kvt
