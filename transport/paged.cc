#include "transport/paged.h"

#include <algorithm>
#include <cstring>

#include <emmintrin.h>

namespace kvt {
namespace {

// Elements per 16-byte row of a transposed tile: 8 x 8 of 2-byte elements, 4 x 4 of 4-byte ones.
template <typename Element>
constexpr int64_t kTile = 16 / static_cast<int64_t>(sizeof(Element));

// dst row j = src column j of one kTile x kTile tile (strides in elements; unaligned rows).
// Shuffles move bits unchanged, so NaN payloads and signed zeros survive.
template <typename Element>
void TransposeTile(const Element* src, int64_t src_stride, Element* dst, int64_t dst_stride) {
  __m128i r[kTile<Element>];
  for (int64_t i = 0; i < kTile<Element>; ++i) {
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * src_stride));
  }
  __m128i out[kTile<Element>];
  if constexpr (sizeof(Element) == 2) {
    __m128i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int half = 0; half < 2; ++half) {  // rows 0-3, then 4-7
      const __m128i* h = t + 4 * half;
      u[4 * half + 0] = _mm_unpacklo_epi32(h[0], h[2]);
      u[4 * half + 1] = _mm_unpackhi_epi32(h[0], h[2]);
      u[4 * half + 2] = _mm_unpacklo_epi32(h[1], h[3]);
      u[4 * half + 3] = _mm_unpackhi_epi32(h[1], h[3]);
    }
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = _mm_unpacklo_epi64(u[i], u[i + 4]);
      out[2 * i + 1] = _mm_unpackhi_epi64(u[i], u[i + 4]);
    }
  } else {
    const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpackhi_epi32(r[0], r[1]);
    const __m128i t2 = _mm_unpacklo_epi32(r[2], r[3]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
    out[0] = _mm_unpacklo_epi64(t0, t2);
    out[1] = _mm_unpackhi_epi64(t0, t2);
    out[2] = _mm_unpacklo_epi64(t1, t3);
    out[3] = _mm_unpackhi_epi64(t1, t3);
  }
  for (int64_t j = 0; j < kTile<Element>; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * dst_stride), out[j]);
  }
}

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
  constexpr int64_t kT = kTile<Element>;
  if (s.slot_stride == 1 && count % kT == 0 && g.head_dim % kT == 0) {
    // vLLM's CPU K order (slots contiguous per dim): whole tiles, a transpose each, about 3x
    // faster than the element loop below, which was most of kvtd's work on an in-place publish
    // (transport/paged_benchmark).
    for (int64_t head = 0; head < g.num_heads; ++head) {
      for (int64_t dim = 0; dim < g.head_dim; dim += kT) {
        for (int64_t i = 0; i < count; i += kT) {
          Element* p = paged_first + head * s.head_stride + dim * s.dim_stride + i;
          Element* c = flat_first + head * head_stride + i * token_stride + dim;
          if (kToPaged) {
            TransposeTile(c, token_stride, p, s.dim_stride);
          } else {
            TransposeTile(p, s.dim_stride, c, token_stride);
          }
        }
      }
    }
    return;
  }
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
