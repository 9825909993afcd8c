// Element types, cache layouts and model shapes shared by every backend, the mapper store and
// the server: the vocabulary of the translation engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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

// Where element (slot, head, dim) of K or of V lies inside one block of a paged layer, in
// elements from the block's start: offset + slot * slot_stride + head * head_stride +
// dim * dim_stride.
struct BlockStrides {
  int64_t offset = 0;
  int64_t slot_stride = 0;
  int64_t head_stride = 0;
  int64_t dim_stride = 1;
};

// An engine-specific paged order (vLLM's CPU attention kernels pack K transposed, [head_dim,
// block_size] per head, then V): each layer's byte offset inside the range, the element stride
// from one block to the next, and each kind's order inside a block.
struct EngineBlockOrder {
  std::vector<int64_t> layer_offsets;  // bytes, one per layer
  int64_t block_stride = 0;            // elements
  BlockStrides kv[2];                  // K, V
};

// vLLM's paged KV cache. The standard order (engine_order empty): per layer one (2, num_blocks,
// block_size, num_kv_heads, head_dim) tensor, K blocks then V blocks, layers back to back;
// `block_layout` orders one block: NHD -> [block_size, heads, head_dim] (vLLM /
// FlashAttention), HND -> [heads, block_size, head_dim] (FlashInfer's HND). With
// `engine_order` set, that order instead (block_layout unused). Either way a request's token t
// sits in block block_table[t / block_size] at slot t % block_size. All offset math of paged
// caches lives here.
struct PagedLayout {
  Layout block_layout = Layout::kNHD;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t element_size = 0;
  std::optional<EngineBlockOrder> engine_order;

  // The unchecked accessors below (block_bytes, layer_bytes, LayerOffset, ElementOffset) are for
  // a layout that passed CheckPagedBounds: every value they compute then lies inside the range.
  int64_t block_bytes() const { return block_size * num_kv_heads * head_dim * element_size; }
  // One layer's tensor, K and V, in the standard order.
  int64_t layer_bytes() const { return 2 * num_blocks * block_bytes(); }
  // Byte offset of layer `layer`'s tensor inside the range.
  int64_t LayerOffset(int layer) const {
    return engine_order ? engine_order->layer_offsets[static_cast<size_t>(layer)]
                        : layer * layer_bytes();
  }
  // Elements from one block of a layer to the next, and each kind's order inside a block.
  int64_t BlockStride() const {
    return engine_order ? engine_order->block_stride : block_size * num_kv_heads * head_dim;
  }
  BlockStrides Strides(int kind) const;
  // Byte offset inside one layer's tensor of element (slot, head, dim) of block `block`,
  // kind 0 = K / 1 = V.
  int64_t ElementOffset(int kind, int64_t block, int64_t slot, int64_t head, int64_t dim) const {
    const BlockStrides s = Strides(kind);
    return (block * BlockStride() + s.offset + slot * s.slot_stride + head * s.head_stride +
            dim * s.dim_stride) *
           element_size;
  }
  // Blocks a request of `num_tokens` tokens occupies.
  int64_t BlocksFor(int64_t num_tokens) const { return (num_tokens + block_size - 1) / block_size; }
  // Bytes of one layer's tensor: 2 x num_blocks blocks in the standard order, up to the last
  // element of the last block in an engine order. Checked: nullopt when a size is not positive,
  // a stride is negative or the value overflows an int64.
  std::optional<int64_t> LayerExtent() const;
  // Bytes a range must hold for `num_layers` layers: exactly this many in the standard order,
  // at least this many in an engine order. Checked like LayerExtent.
  std::optional<int64_t> RequiredBytes(int num_layers) const;
};

// The one bounds check of a paged layout, both orders: every size positive, each layer's
// extent and offset computed with overflow-checked arithmetic, and every layer's
// [offset, offset + extent) inside [0, range_bytes); in the standard order the range must be
// exactly RequiredBytes. INVALID_ARGUMENT naming `field` (`range_field` for the range's
// byte_size). Once it passes, no element of any block of any layer lies outside the range.
absl::Status CheckPagedBounds(const PagedLayout& paged, int num_layers, int64_t range_bytes,
                              const std::string& field, const std::string& range_field);

// An engine order against its layout: one offset per layer, strides bounded, CheckPagedBounds,
// and no two elements of a block (K and V) nor two blocks on the same bytes, so that writes
// never land on each other. INVALID_ARGUMENT naming `field`.
absl::Status CheckEngineBlockOrder(const PagedLayout& paged, int num_layers, int64_t range_bytes,
                                   const std::string& field);

// A request's block table against `paged`: block_size and num_blocks > 0, at least
// BlocksFor(num_tokens) entries, each used one < num_blocks and (when `distinct`, as an output
// needs) used once. INVALID_ARGUMENT naming `field` and the entry, e.g.
// "header.output.region.paged.block_table[3]=70 is outside num_blocks=64".
absl::Status CheckBlockTable(const PagedLayout& paged, const uint32_t* table, int64_t table_size,
                             int64_t num_tokens, bool distinct, const std::string& field);

}  // namespace kvt
