#include "prefix_cache/chain_hash.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"

namespace kvt {
namespace {

std::vector<uint32_t> Iota(int n, uint32_t start = 1) {
  std::vector<uint32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), start);
  return tokens;
}

TEST(ChainHashTest, OneHashPerWholeBlockTailIgnored) {
  EXPECT_EQ(ChainHashes("m", Iota(63), 16).size(), 3u);
  EXPECT_EQ(ChainHashes("m", Iota(64), 16).size(), 4u);
  EXPECT_TRUE(ChainHashes("m", Iota(15), 16).empty());
  EXPECT_TRUE(ChainHashes("m", Iota(64), 0).empty());
  // The tail's content does not matter either.
  std::vector<uint32_t> a = Iota(40), b = Iota(40);
  b[39] = 9999;
  EXPECT_EQ(ChainHashes("m", a, 16), ChainHashes("m", b, 16));
}

TEST(ChainHashTest, Deterministic) {
  EXPECT_EQ(ChainHashes("llama", Iota(48), 16), ChainHashes("llama", Iota(48), 16));
}

TEST(ChainHashTest, MatchesAnIndependentImplementation) {
  // Computed independently with python hashlib, truncated to 16 bytes:
  //   h0 = sha256(struct.pack('<Q', 1) + b'm' + struct.pack('<I', 1))
  //   h1 = sha256(h0[:16] + struct.pack('<I', 2))
  const std::vector<BlockHash> hashes = ChainHashes("m", std::vector<uint32_t>{1, 2}, 1);
  ASSERT_EQ(hashes.size(), 2u);
  EXPECT_EQ(BlockHashHex(hashes[0]), "72b34a06e735cdd67aef4784ea29ab5b");
  EXPECT_EQ(BlockHashHex(hashes[1]), "42ca87956b71a8350fc3e076673d2586");
}

TEST(ChainHashTest, PrefixProperty) {
  const std::vector<uint32_t> tokens = Iota(160);
  const std::vector<BlockHash> full = ChainHashes("m", tokens, 16);
  for (int blocks = 1; blocks <= 10; ++blocks) {
    const std::vector<BlockHash> prefix =
        ChainHashes("m", absl::MakeConstSpan(tokens).subspan(0, blocks * 16 + 3), 16);
    ASSERT_EQ(prefix.size(), static_cast<size_t>(blocks));
    EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), full.begin())) << blocks;
  }
}

TEST(ChainHashTest, DiffersByModel) {
  const std::vector<BlockHash> a = ChainHashes("model-a", Iota(32), 16);
  const std::vector<BlockHash> b = ChainHashes("model-b", Iota(32), 16);
  EXPECT_NE(a[0], b[0]);
  EXPECT_NE(a[1], b[1]);
  // Length prefixing: moving bytes between the name and the tokens changes the hash.
  EXPECT_NE(ChainHashes("", Iota(16), 16)[0], ChainHashes(std::string(4, '\0'), Iota(16), 16)[0]);
}

TEST(ChainHashTest, AnyTokenChangesItsBlockAndAllLaterOnes) {
  const std::vector<uint32_t> base = Iota(64);
  const std::vector<BlockHash> h = ChainHashes("m", base, 16);
  for (int position : {0, 15, 16, 33, 63}) {
    std::vector<uint32_t> changed = base;
    changed[position] ^= 1u << 20;
    const std::vector<BlockHash> g = ChainHashes("m", changed, 16);
    const int block = position / 16;
    for (int j = 0; j < 4; ++j) {
      if (j < block) {
        EXPECT_EQ(g[j], h[j]) << position << " " << j;
      } else {
        EXPECT_NE(g[j], h[j]) << position << " " << j;
      }
    }
  }
}

TEST(ChainHashTest, UsableAsHashSetKey) {
  absl::flat_hash_set<BlockHash, BlockHashHash> set;
  for (const BlockHash& h : ChainHashes("m", Iota(16 * 100), 16)) set.insert(h);
  EXPECT_EQ(set.size(), 100u);
}

}  // namespace
}  // namespace kvt
