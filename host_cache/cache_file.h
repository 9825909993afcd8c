// KV caches as safetensors files, in the dump format kvt uses everywhere (docs/MAPPER_FORMAT.md
// "KV dumps"): tensors `layers.{j}.k` and `layers.{j}.v`, shape [num_kv_heads, tokens, head_dim]
// (HND), one dtype; metadata `rope: post` (keys as a cache holds them) unless written otherwise.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "host_cache/host_cache.h"

namespace kvt {

// Reads a dump into an HND HostCache. Errors name the file and the missing or malformed tensor
// (layers must be 0..L-1 without gaps, every tensor one shape and dtype). `metadata`, when
// given, receives the file's __metadata__ (e.g. `rope: post|pre` for `kvt fit`).
absl::StatusOr<HostCache> ReadCacheFile(const std::string& path,
                                        std::map<std::string, std::string>* metadata = nullptr);

// Writes an HND or NHD cache as an HND dump (NHD is transposed on the way).
absl::Status WriteCacheFile(const std::string& path, const HostCache& cache,
                            const std::map<std::string, std::string>& metadata = {});

// The same cache in another layout (a copy).
HostCache ToLayout(const HostCache& cache, Layout layout);

}  // namespace kvt
