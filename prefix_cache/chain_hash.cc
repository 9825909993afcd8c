#include "prefix_cache/chain_hash.h"

#include <openssl/evp.h>

#include <cstdlib>
#include <memory>

namespace kvt {
namespace {

void AppendLittleEndian(uint64_t value, int bytes, std::vector<uint8_t>* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<uint8_t>(value >> (8 * i)));
}

// The tokens of one block as little-endian u32, so hashes are the same on any host.
void AppendBlock(absl::Span<const uint32_t> block, std::vector<uint8_t>* out) {
  for (uint32_t token : block) AppendLittleEndian(token, 4, out);
}

struct CtxFree {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};

BlockHash Digest(EVP_MD_CTX* ctx, const std::vector<uint8_t>& message) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  // SHA-256 over memory only fails when OpenSSL itself is broken (allocation failure inside the
  // context); a wrong hash would silently split or merge cache entries, so stop instead.
  if (EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(ctx, message.data(), message.size()) != 1 ||
      EVP_DigestFinal_ex(ctx, digest, &length) != 1 || length != 32) {
    std::abort();
  }
  BlockHash hash;
  std::memcpy(hash.data(), digest, hash.size());
  return hash;
}

}  // namespace

std::vector<BlockHash> ChainHashes(absl::string_view model, absl::Span<const uint32_t> tokens,
                                   int block_tokens) {
  std::vector<BlockHash> hashes;
  if (block_tokens <= 0) return hashes;
  const size_t num_blocks = tokens.size() / static_cast<size_t>(block_tokens);
  if (num_blocks == 0) return hashes;
  std::unique_ptr<EVP_MD_CTX, CtxFree> ctx(EVP_MD_CTX_new());
  if (ctx == nullptr) std::abort();
  hashes.reserve(num_blocks);
  std::vector<uint8_t> message;
  message.reserve(8 + model.size() + 4 * static_cast<size_t>(block_tokens));
  for (size_t i = 0; i < num_blocks; ++i) {
    message.clear();
    if (i == 0) {
      AppendLittleEndian(model.size(), 8, &message);
      message.insert(message.end(), model.begin(), model.end());
    } else {
      message.insert(message.end(), hashes.back().begin(), hashes.back().end());
    }
    AppendBlock(tokens.subspan(i * block_tokens, block_tokens), &message);
    hashes.push_back(Digest(ctx.get(), message));
  }
  return hashes;
}

std::string BlockHashHex(const BlockHash& hash) {
  static const char kHex[] = "0123456789abcdef";
  std::string hex(2 * hash.size(), '0');
  for (size_t i = 0; i < hash.size(); ++i) {
    hex[2 * i] = kHex[hash[i] >> 4];
    hex[2 * i + 1] = kHex[hash[i] & 15];
  }
  return hex;
}

}  // namespace kvt
