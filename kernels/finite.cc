#include "kernels/finite.h"

#include <cmath>
#include <cstring>

#include <immintrin.h>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace kvt {
namespace {

// Exponent all ones <=> NaN or Inf. 32 bytes at a time (AVX2, which every kernel here already
// requires): the common case, all finite, runs at memory speed; the element is searched only in
// a 32-byte group that has one.
template <typename Bits, Bits kExponent>
std::optional<int64_t> FirstWithExponentSet(const void* data, int64_t count) {
  constexpr int64_t kPerVector = 32 / sizeof(Bits);
  const char* bytes = static_cast<const char*>(data);
  const __m256i mask = sizeof(Bits) == 2 ? _mm256_set1_epi16(static_cast<int16_t>(kExponent))
                                         : _mm256_set1_epi32(static_cast<int32_t>(kExponent));
  int64_t i = 0;
  for (; i + kPerVector <= count; i += kPerVector) {
    const __m256i v = _mm256_and_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i * sizeof(Bits))), mask);
    const __m256i hit = sizeof(Bits) == 2 ? _mm256_cmpeq_epi16(v, mask) : _mm256_cmpeq_epi32(v, mask);
    if (_mm256_movemask_epi8(hit) != 0) break;  // the scalar loop below finds which
  }
  for (; i < count; ++i) {
    Bits x;
    std::memcpy(&x, bytes + i * sizeof(Bits), sizeof(Bits));
    if ((x & kExponent) == kExponent) return i;
  }
  return std::nullopt;
}

float ElementAsFloat(DType dtype, const void* data, int64_t index) {
  float value;
  ToFloat(dtype, static_cast<const char*>(data) + index * static_cast<int64_t>(DTypeSize(dtype)),
          &value, 1);
  return value;
}

}  // namespace

std::optional<int64_t> FirstNonFinite(DType dtype, const void* data, int64_t count) {
  switch (dtype) {
    case DType::kFP32:
      return FirstWithExponentSet<uint32_t, 0x7F800000u>(data, count);
    case DType::kBF16:
      return FirstWithExponentSet<uint16_t, 0x7F80u>(data, count);
    case DType::kFP16:
      return FirstWithExponentSet<uint16_t, 0x7C00u>(data, count);
  }
  return std::nullopt;
}

absl::Status CheckFinite(const CacheView& view, const std::string& field) {
  const int64_t heads = view.num_kv_heads, dim = view.head_dim, tokens = view.num_tokens;
  const int64_t count = heads * tokens * dim;
  for (size_t layer = 0; layer < view.k.size(); ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const void* data = (kind == 0 ? view.k : view.v)[layer];
      const std::optional<int64_t> bad = FirstNonFinite(view.dtype, data, count);
      if (!bad) continue;
      const int64_t i = *bad;
      const int64_t d = i % dim;
      const int64_t token = view.layout == Layout::kNHD ? i / (heads * dim) : (i / dim) % tokens;
      const int64_t head = view.layout == Layout::kNHD ? (i / dim) % heads : i / (tokens * dim);
      const float value = ElementAsFloat(view.dtype, data, i);
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": layer ", layer, " ", kind == 0 ? "K" : "V", " element ", i, " (token ",
          token, ", head ", head, ", dim ", d, ") is ",
          std::isnan(value) ? "NaN" : (value > 0 ? "+Inf" : "-Inf"),
          "; non-finite values are refused (limits.allow_non_finite)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvt
