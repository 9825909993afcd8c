// Chain hashes of fixed token blocks: the keys under which the prefix cache indexes published
// KV caches, so that two sequences sharing their first k blocks share their first k hashes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvt {

// SHA-256 truncated to 128 bits: collisions are out of reach by chance, and the cache verifies
// tokens on every hit anyway, so a collision could never return another sequence's data.
using BlockHash = std::array<uint8_t, 16>;

// One hash per WHOLE block of `block_tokens` tokens (a partial tail block is ignored):
//   h_0 = SHA256(u64le(model.size()) || model || tokens[0 .. B) as u32le)[0 .. 16)
//   h_i = SHA256(h_{i-1} || tokens[i*B .. (i+1)*B) as u32le)[0 .. 16)
// The model name seeds the chain (length-prefixed, so no name/token boundary is ambiguous), so a
// hash alone identifies (model, token prefix). Empty when block_tokens <= 0 or the sequence is
// shorter than one block.
std::vector<BlockHash> ChainHashes(absl::string_view model, absl::Span<const uint32_t> tokens,
                                   int block_tokens);

// 32 lower-case hex digits, for logs and the admin listing.
std::string BlockHashHex(const BlockHash& hash);

// Hasher for absl::flat_hash_map / flat_hash_set keys. The bytes are already a uniform
// cryptographic digest, so the first 8 of them are a hash as good as any mixing would make.
struct BlockHashHash {
  size_t operator()(const BlockHash& hash) const {
    uint64_t word;
    std::memcpy(&word, hash.data(), sizeof(word));
    return static_cast<size_t>(word);
  }
};

}  // namespace kvt
