// What kvtd says of itself (kvt.v1 ServerMetadata): its release and the protocol extensions a
// newer client may test for before it sends a field an older server would silently ignore.
#pragma once

#include <string>
#include <vector>

#include "prefix_cache/prefix_digest.h"
#include "proto/kvt/v1/service.pb.h"

namespace kvt {

// kvtd's release: ServerMetadata.version and the kvt_build_info metric's "version" label.
inline constexpr char kKvtdVersion[] = "0.1";

// The extensions this build understands, sorted (ServerMetadataResponse.extensions documents
// each name). "prefix_cache" only when the KvPrefixCache service is enabled, "prefix_digest"
// only with a digest.
std::vector<std::string> ServerExtensions(bool prefix_cache_enabled, bool prefix_digest = false);

// `digest`: the prefix cache's published-prefix digest, null when there is none.
v1::ServerMetadataResponse ServerMetadataOf(bool prefix_cache_enabled,
                                            const PrefixDigest* digest = nullptr);

}  // namespace kvt
