#include "host_cache/cache_file.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "safetensors/safetensors.h"

namespace kvt {

absl::StatusOr<HostCache> ReadCacheFile(const std::string& path,
                                        std::map<std::string, std::string>* metadata) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  if (metadata != nullptr) *metadata = (*file)->metadata();
  HostCache cache;
  cache.layout = Layout::kHND;
  const TensorInfo* first = (*file)->Find("layers.0.k");
  if (first == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no tensor 'layers.0.k' (expected a KV dump: layers.{j}.k/.v)"));
  }
  if (first->spec.shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": layers.0.k has shape ", FormatShape(first->spec.shape),
        ", expected [num_kv_heads, tokens, head_dim]"));
  }
  cache.dtype = first->spec.dtype;
  cache.num_kv_heads = static_cast<int>(first->spec.shape[0]);
  cache.num_tokens = first->spec.shape[1];
  cache.head_dim = static_cast<int>(first->spec.shape[2]);
  while ((*file)->Find(absl::StrCat("layers.", cache.num_layers, ".k")) != nullptr) {
    ++cache.num_layers;
  }
  size_t expected_tensors = 2 * static_cast<size_t>(cache.num_layers);
  for (const TensorInfo& tensor : (*file)->tensors()) {
    if (tensor.spec.name.rfind("layers.", 0) != 0) ++expected_tensors;  // tolerated extras
  }
  for (int layer = 0; layer < cache.num_layers; ++layer) {
    for (const char* kind : {"k", "v"}) {
      const std::string name = absl::StrCat("layers.", layer, ".", kind);
      const TensorInfo* tensor = (*file)->Find(name);
      if (tensor == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": missing tensor '", name, "'"));
      }
      if (tensor->spec.dtype != cache.dtype || tensor->spec.shape != first->spec.shape) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": tensor '", name, "' is ", SafetensorsDTypeName(tensor->spec.dtype), " ",
            FormatShape(tensor->spec.shape), ", expected ", SafetensorsDTypeName(cache.dtype),
            " ", FormatShape(first->spec.shape), " like layers.0.k"));
      }
      absl::Span<const uint8_t> bytes = (*file)->data(*tensor);
      (kind[0] == 'k' ? cache.k : cache.v)
          .emplace_back(reinterpret_cast<const char*>(bytes.data()),
                        reinterpret_cast<const char*>(bytes.data()) + bytes.size());
    }
  }
  if ((*file)->tensors().size() != expected_tensors) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": layer tensors are not numbered 0..", cache.num_layers - 1,
                     " without gaps"));
  }
  return cache;
}

HostCache ToLayout(const HostCache& cache, Layout layout) {
  HostCache out = cache;
  out.layout = layout;
  if (layout == cache.layout) return out;
  const int64_t element = static_cast<int64_t>(DTypeSize(cache.dtype));
  for (int layer = 0; layer < cache.num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<char>& in = (kind == 0 ? cache.k : cache.v)[layer];
      std::vector<char>& dst = (kind == 0 ? out.k : out.v)[layer];
      for (int64_t h = 0; h < cache.num_kv_heads; ++h) {
        for (int64_t t = 0; t < cache.num_tokens; ++t) {
          const int64_t from = CacheOffset(cache.layout, cache.num_kv_heads, cache.num_tokens,
                                           cache.head_dim, h, t, 0);
          const int64_t to =
              CacheOffset(layout, cache.num_kv_heads, cache.num_tokens, cache.head_dim, h, t, 0);
          std::memcpy(dst.data() + to * element, in.data() + from * element,
                      cache.head_dim * element);
        }
      }
    }
  }
  return out;
}

absl::Status WriteCacheFile(const std::string& path, const HostCache& cache,
                            const std::map<std::string, std::string>& metadata) {
  const HostCache hnd = ToLayout(cache, Layout::kHND);
  std::vector<TensorRef> tensors;
  for (int layer = 0; layer < hnd.num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<char>& buffer = (kind == 0 ? hnd.k : hnd.v)[layer];
      TensorRef tensor;
      tensor.spec.name = absl::StrCat("layers.", layer, kind == 0 ? ".k" : ".v");
      tensor.spec.dtype = hnd.dtype;
      tensor.spec.shape = {hnd.num_kv_heads, hnd.num_tokens, hnd.head_dim};
      tensor.bytes = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(buffer.data()),
                                               buffer.size());
      tensors.push_back(tensor);
    }
  }
  std::map<std::string, std::string> all_metadata = metadata;
  all_metadata.emplace("rope", "post");
  absl::StatusOr<SafetensorsWriteResult> written = WriteSafetensors(path, tensors, all_metadata);
  return written.status();
}

}  // namespace kvt
