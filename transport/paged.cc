#include "transport/paged.h"

#include <algorithm>
#include <cstring>

namespace kvt {
namespace {

// Tokens [first, end) of one block (slots first % block_size on) when a head vector is not
// contiguous in the block (an engine order such as vLLM's CPU kernels, which keep K transposed:
// dim stride = block size, slot stride 1): the slot loop innermost, so that the paged side is
// walked with its smallest stride.
template <typename Element, bool kToPaged>
void CopyBlockStrided(const PagedLayout& paged, int kind, const LayerGeometry& g, int64_t block,
                      int64_t first, int64_t end, char* paged_layer, char* contiguous) {
  const BlockStrides s = paged.Strides(kind);
  // Element strides of the contiguous side (layer layout NHD or HND).
  const int64_t token_stride = g.layout == Layout::kNHD ? g.num_heads * g.head_dim : g.head_dim;
  const int64_t head_stride = g.layout == Layout::kNHD ? g.head_dim : g.num_tokens * g.head_dim;
  const int64_t count = end - first;
  Element* paged_first = reinterpret_cast<Element*>(paged_layer) + block * paged.BlockStride() +
                         s.offset + (first % paged.block_size) * s.slot_stride;
  Element* flat_first = reinterpret_cast<Element*>(contiguous) + first * token_stride;
  for (int64_t head = 0; head < g.num_heads; ++head) {
    for (int64_t dim = 0; dim < g.head_dim; ++dim) {
      Element* p = paged_first + head * s.head_stride + dim * s.dim_stride;
      Element* c = flat_first + head * head_stride + dim;
      for (int64_t i = 0; i < count; ++i) {
        // memcpy: a region's offsets need not be aligned to the element size.
        if (kToPaged) {
          std::memcpy(p + i * s.slot_stride, c + i * token_stride, sizeof(Element));
        } else {
          std::memcpy(c + i * token_stride, p + i * s.slot_stride, sizeof(Element));
        }
      }
    }
  }
}

template <bool kToPaged>
void Copy(const PagedLayout& paged, const uint32_t* block_table, int kind, const LayerGeometry& g,
          char* paged_layer, char* contiguous, int64_t first_token, int64_t end_token) {
  const size_t vector_bytes = static_cast<size_t>(g.head_dim * g.element_size);
  if (paged.Strides(kind).dim_stride != 1) {
    for (int64_t token = first_token; token < end_token;) {
      const int64_t block_end =
          std::min(end_token, (token / paged.block_size + 1) * paged.block_size);
      const int64_t block = block_table[token / paged.block_size];
      if (g.element_size == 4) {
        CopyBlockStrided<uint32_t, kToPaged>(paged, kind, g, block, token, block_end,
                                             paged_layer, contiguous);
      } else {
        CopyBlockStrided<uint16_t, kToPaged>(paged, kind, g, block, token, block_end,
                                             paged_layer, contiguous);
      }
      token = block_end;
    }
    return;
  }
  for (int64_t token = first_token; token < end_token; ++token) {
    const int64_t block = block_table[token / paged.block_size];
    const int64_t slot = token % paged.block_size;
    for (int64_t head = 0; head < g.num_heads; ++head) {
      char* p = paged_layer + paged.ElementOffset(kind, block, slot, head, 0);
      char* c = contiguous +
                CacheOffset(g.layout, g.num_heads, g.num_tokens, g.head_dim, head, token, 0) *
                    g.element_size;
      std::memcpy(kToPaged ? p : c, kToPaged ? c : p, vector_bytes);
    }
  }
}

}  // namespace

void GatherPaged(const PagedLayout& paged, const uint32_t* block_table, int kind,
                 const void* paged_layer, const LayerGeometry& layer, void* dst) {
  Copy<false>(paged, block_table, kind, layer,
              const_cast<char*>(static_cast<const char*>(paged_layer)), static_cast<char*>(dst),
              0, layer.num_tokens);
}

void ScatterPaged(const PagedLayout& paged, const uint32_t* block_table, int kind,
                  const void* src, const LayerGeometry& layer, void* paged_layer,
                  int64_t first_token, int64_t end_token) {
  Copy<true>(paged, block_table, kind, layer, static_cast<char*>(paged_layer),
             const_cast<char*>(static_cast<const char*>(src)), first_token, end_token);
}

}  // namespace kvt
