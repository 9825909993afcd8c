#include "host_cache/host_cache.h"

#include "transport/kv_chunks.h"

namespace kvt {
namespace {

LayerGeometry Geometry(const HostCache& cache) {
  return LayerGeometry{cache.layout, cache.num_kv_heads, cache.num_tokens, cache.head_dim,
                       static_cast<int64_t>(DTypeSize(cache.dtype))};
}

// A zeroed cache of `like`'s dtype, layout and shape with `tokens` tokens.
HostCache Shaped(const HostCache& like, int64_t tokens) {
  return HostCache::Zeros(like.dtype, like.layout, like.num_layers, like.num_kv_heads,
                          like.head_dim, tokens);
}

// Tokens [from, from + count) of `source` written to tokens [to, to + count) of `dest` (same
// dtype, layers, heads and head_dim; layouts may differ), through chunk form.
void CopyTokens(const HostCache& source, int64_t from, int64_t count, HostCache* dest,
                int64_t to) {
  if (count == 0) return;  // an empty cache's buffers may be null: nothing to copy
  const LayerGeometry source_geometry = Geometry(source);
  const LayerGeometry dest_geometry = Geometry(*dest);
  std::vector<char> chunk(static_cast<size_t>(source_geometry.chunk_bytes(count)));
  for (int layer = 0; layer < source.num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<char>& in = (kind == 0 ? source.k : source.v)[layer];
      std::vector<char>& out = (kind == 0 ? dest->k : dest->v)[layer];
      GatherChunk(source_geometry, from, count, in.data(), chunk.data());
      ScatterChunk(dest_geometry, to, count, chunk.data(), out.data());
    }
  }
}

}  // namespace

HostCache SliceTokens(const HostCache& cache, int64_t begin, int64_t end) {
  HostCache piece = Shaped(cache, end - begin);
  CopyTokens(cache, begin, end - begin, &piece, 0);
  return piece;
}

HostCache ConcatTokens(const HostCache& first, const HostCache& second) {
  HostCache joined = Shaped(first, first.num_tokens + second.num_tokens);
  CopyTokens(first, 0, first.num_tokens, &joined, 0);
  CopyTokens(second, 0, second.num_tokens, &joined, first.num_tokens);
  return joined;
}

HostCache HostCache::Zeros(DType dtype, Layout layout, int num_layers, int num_kv_heads,
                           int head_dim, int64_t num_tokens) {
  HostCache cache;
  cache.dtype = dtype;
  cache.layout = layout;
  cache.num_layers = num_layers;
  cache.num_kv_heads = num_kv_heads;
  cache.head_dim = head_dim;
  cache.num_tokens = num_tokens;
  cache.Allocate();
  return cache;
}

void HostCache::Allocate() {
  k.clear();
  v.clear();
  Resize();
}

void HostCache::Resize() {
  for (std::vector<std::vector<char>>* buffers : {&k, &v}) {
    buffers->resize(static_cast<size_t>(num_layers));
    for (std::vector<char>& buffer : *buffers) buffer.resize(static_cast<size_t>(layer_bytes()));
  }
}

CacheView HostCache::view() const {
  CacheView view;
  view.dtype = dtype;
  view.layout = layout;
  view.num_kv_heads = num_kv_heads;
  view.head_dim = head_dim;
  view.num_tokens = num_tokens;
  for (int layer = 0; layer < num_layers; ++layer) {
    view.k.push_back(k[layer].data());
    view.v.push_back(v[layer].data());
  }
  return view;
}

}  // namespace kvt
