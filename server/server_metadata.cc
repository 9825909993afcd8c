#include "server/server_metadata.h"

#include <algorithm>

namespace kvt {

std::vector<std::string> ServerExtensions(bool prefix_cache_enabled) {
  // A name is added with the feature it names, never removed while the feature is served: a
  // client that finds it relies on the fields it covers.
  std::vector<std::string> names = {"paged_engine_order", "paged_regions", "region_layer_notices",
                                    "system_shared_memory"};
  if (prefix_cache_enabled) names.push_back("prefix_cache");
  std::sort(names.begin(), names.end());
  return names;
}

v1::ServerMetadataResponse ServerMetadataOf(bool prefix_cache_enabled) {
  v1::ServerMetadataResponse response;
  response.set_name("kvtd");
  response.set_version(kKvtdVersion);
  for (std::string& name : ServerExtensions(prefix_cache_enabled)) {
    response.add_extensions(std::move(name));
  }
  return response;
}

}  // namespace kvt
