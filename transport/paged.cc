#include "transport/paged.h"

#include <cstring>

namespace kvt {
namespace {

// One head vector (head_dim elements) between the paged side `p` (elements `dim_stride` apart)
// and the contiguous side `c`.
template <typename Element, bool kToPaged>
void CopyStrided(char* p, char* c, int64_t head_dim, int64_t dim_stride) {
  Element* paged = reinterpret_cast<Element*>(p);
  Element* contiguous = reinterpret_cast<Element*>(c);
  for (int64_t d = 0; d < head_dim; ++d) {
    if (kToPaged) {
      std::memcpy(paged + d * dim_stride, contiguous + d, sizeof(Element));
    } else {
      std::memcpy(contiguous + d, paged + d * dim_stride, sizeof(Element));
    }
  }
}

template <bool kToPaged>
void Copy(const PagedLayout& paged, const uint32_t* block_table, int kind, const LayerGeometry& g,
          char* paged_layer, char* contiguous, int64_t first_token, int64_t end_token) {
  const size_t vector_bytes = static_cast<size_t>(g.head_dim * g.element_size);
  const int64_t dim_stride = paged.Strides(kind).dim_stride;
  for (int64_t token = first_token; token < end_token; ++token) {
    const int64_t block = block_table[token / paged.block_size];
    const int64_t slot = token % paged.block_size;
    for (int64_t head = 0; head < g.num_heads; ++head) {
      char* p = paged_layer + paged.ElementOffset(kind, block, slot, head, 0);
      char* c = contiguous +
                CacheOffset(g.layout, g.num_heads, g.num_tokens, g.head_dim, head, token, 0) *
                    g.element_size;
      if (dim_stride == 1) {
        std::memcpy(kToPaged ? p : c, kToPaged ? c : p, vector_bytes);
      } else if (g.element_size == 4) {
        CopyStrided<uint32_t, kToPaged>(p, c, g.head_dim, dim_stride);
      } else {
        CopyStrided<uint16_t, kToPaged>(p, c, g.head_dim, dim_stride);
      }
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
