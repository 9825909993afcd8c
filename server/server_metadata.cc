#include "server/server_metadata.h"

#include <algorithm>

namespace kvt {

std::vector<std::string> ServerExtensions(bool prefix_cache_enabled, bool prefix_digest) {
  // A name is added with the feature it names, never removed while the feature is served: a
  // client that finds it relies on the fields it covers.
  std::vector<std::string> names = {"paged_engine_order", "paged_regions", "region_layer_notices",
                                    "system_shared_memory"};
  if (prefix_cache_enabled) names.push_back("prefix_cache");
  if (prefix_cache_enabled && prefix_digest) names.push_back("prefix_digest");
  std::sort(names.begin(), names.end());
  return names;
}

v1::ServerMetadataResponse ServerMetadataOf(bool prefix_cache_enabled,
                                            const PrefixDigest* digest) {
  v1::ServerMetadataResponse response;
  response.set_name("kvtd");
  response.set_version(kKvtdVersion);
  for (std::string& name : ServerExtensions(prefix_cache_enabled, digest != nullptr)) {
    response.add_extensions(std::move(name));
  }
  if (prefix_cache_enabled && digest != nullptr) {
    v1::PrefixDigestInfo* info = response.mutable_prefix_digest();
    info->set_shm_name(digest->shm_name());
    info->set_slots(static_cast<uint64_t>(digest->slots()));
    info->set_block_tokens(static_cast<uint32_t>(digest->block_tokens()));
    info->set_hashes(kPrefixDigestHashes);
    info->set_instance(digest->instance());
  }
  return response;
}

}  // namespace kvt
