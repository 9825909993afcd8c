// Element types, cache layouts and model shapes shared by every backend, the mapper store and
// the server: the vocabulary of the translation engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvt {

enum class DType { kBF16, kFP16, kFP32 };

// Bytes per element.
size_t DTypeSize(DType dtype);
// "bf16", "fp16", "fp32".
const char* DTypeName(DType dtype);
// Accepts "bf16"/"bfloat16", "fp16"/"float16"/"f16", "fp32"/"float32"/"f32" and the safetensors
// names "BF16", "F16", "F32".
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Memory order of one layer's K or V.
enum class Layout {
  kHND,  // [num_kv_heads, tokens, head_dim]
  kNHD,  // [tokens, num_kv_heads, head_dim]
};

const char* LayoutName(Layout layout);
absl::StatusOr<Layout> ParseLayout(absl::string_view name);

// Element offset of (head, token, dim) in one layer's K or V of `num_tokens` tokens.
inline int64_t CacheOffset(Layout layout, int64_t num_heads, int64_t num_tokens, int64_t head_dim,
                           int64_t head, int64_t token, int64_t dim) {
  return layout == Layout::kHND ? (head * num_tokens + token) * head_dim + dim
                                : (token * num_heads + head) * head_dim + dim;
}

}  // namespace kvt
