#include "transport/paged.h"

#include <cstring>

namespace kvt {
namespace {

template <bool kToPaged>
void Copy(const PagedLayout& paged, const uint32_t* block_table, int kind, const LayerGeometry& g,
          char* paged_layer, char* contiguous) {
  const size_t vector_bytes = static_cast<size_t>(g.head_dim * g.element_size);
  for (int64_t token = 0; token < g.num_tokens; ++token) {
    const int64_t block = block_table[token / paged.block_size];
    const int64_t slot = token % paged.block_size;
    for (int64_t head = 0; head < g.num_heads; ++head) {
      char* p = paged_layer + paged.HeadOffset(kind, block, slot, head);
      char* c = contiguous +
                CacheOffset(g.layout, g.num_heads, g.num_tokens, g.head_dim, head, token, 0) *
                    g.element_size;
      if (kToPaged) {
        std::memcpy(p, c, vector_bytes);
      } else {
        std::memcpy(c, p, vector_bytes);
      }
    }
  }
}

}  // namespace

void GatherPaged(const PagedLayout& paged, const uint32_t* block_table, int kind,
                 const void* paged_layer, const LayerGeometry& layer, void* dst) {
  Copy<false>(paged, block_table, kind, layer,
              const_cast<char*>(static_cast<const char*>(paged_layer)), static_cast<char*>(dst));
}

void ScatterPaged(const PagedLayout& paged, const uint32_t* block_table, int kind,
                  const void* src, const LayerGeometry& layer, void* paged_layer) {
  Copy<true>(paged, block_table, kind, layer, static_cast<char*>(paged_layer),
             const_cast<char*>(static_cast<const char*>(src)));
}

}  // namespace kvt
