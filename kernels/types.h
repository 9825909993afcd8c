// Element types, cache layouts and model shapes shared by every backend, the mapper store and
// the server: the vocabulary of the translation engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
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

// vLLM's paged KV cache: per layer one (2, num_blocks, block_size, num_kv_heads, head_dim)
// tensor, K blocks then V blocks; a request's token t sits in block block_table[t / block_size]
// at slot t % block_size. `block_layout` orders one block: NHD -> [block_size, heads, head_dim]
// (vLLM / FlashAttention), HND -> [heads, block_size, head_dim] (FlashInfer's HND).
struct PagedLayout {
  Layout block_layout = Layout::kNHD;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t element_size = 0;

  int64_t block_bytes() const { return block_size * num_kv_heads * head_dim * element_size; }
  // One layer's tensor, K and V.
  int64_t layer_bytes() const { return 2 * num_blocks * block_bytes(); }
  // Byte offset inside one layer's tensor of head `head`'s vector (head_dim elements,
  // contiguous) at `slot` of block `block`, kind 0 = K / 1 = V.
  int64_t HeadOffset(int kind, int64_t block, int64_t slot, int64_t head) const {
    return (kind * num_blocks + block) * block_bytes() +
           CacheOffset(block_layout, num_kv_heads, block_size, head_dim, head, slot, 0) *
               element_size;
  }
  // Blocks a request of `num_tokens` tokens occupies.
  int64_t BlocksFor(int64_t num_tokens) const { return (num_tokens + block_size - 1) / block_size; }
};

// A request's block table against `paged`: block_size and num_blocks > 0, at least
// BlocksFor(num_tokens) entries, each used one < num_blocks and (when `distinct`, as an output
// needs) used once. INVALID_ARGUMENT naming `field` and the entry, e.g.
// "header.output.region.paged.block_table[3]=70 is outside num_blocks=64".
absl::Status CheckBlockTable(const PagedLayout& paged, const uint32_t* table, int64_t table_size,
                             int64_t num_tokens, bool distinct, const std::string& field);

}  // namespace kvt
