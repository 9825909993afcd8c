#include "host_cache/host_cache.h"

namespace kvt {

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
