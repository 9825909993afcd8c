#include "server/server_metadata.h"

#include <algorithm>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace {

using ::testing::Contains;
using ::testing::Not;

TEST(ServerMetadataTest, NamesTheServerItsReleaseAndSortedExtensions) {
  const v1::ServerMetadataResponse m = ServerMetadataOf(/*prefix_cache_enabled=*/true);
  EXPECT_EQ(m.name(), "kvtd");
  EXPECT_EQ(m.version(), kKvtdVersion);
  EXPECT_TRUE(std::is_sorted(m.extensions().begin(), m.extensions().end()));
  EXPECT_THAT(m.extensions(), Contains("paged_engine_order"));
  EXPECT_THAT(m.extensions(), Contains("prefix_cache"));
}

TEST(ServerMetadataTest, NamesTheDigestWhenThereIsOne) {
  EXPECT_FALSE(ServerMetadataOf(/*prefix_cache_enabled=*/true).has_prefix_digest());
  PrefixDigestOptions options;
  options.slots = 1 << 10;
  options.block_tokens = 8;
  absl::StatusOr<std::unique_ptr<PrefixDigest>> digest = PrefixDigest::Create(options);
  ASSERT_TRUE(digest.ok()) << digest.status();
  const v1::ServerMetadataResponse m = ServerMetadataOf(true, digest->get());
  EXPECT_THAT(m.extensions(), Contains("prefix_digest"));
  EXPECT_TRUE(std::is_sorted(m.extensions().begin(), m.extensions().end()));
  EXPECT_EQ(m.prefix_digest().shm_name(), (*digest)->shm_name());
  EXPECT_EQ(m.prefix_digest().slots(), 1u << 10);
  EXPECT_EQ(m.prefix_digest().block_tokens(), 8u);
  EXPECT_EQ(m.prefix_digest().hashes(), 3u);
  EXPECT_EQ(m.prefix_digest().instance(), (*digest)->instance());
}

TEST(ServerMetadataTest, ListsThePrefixCacheOnlyWhenEnabled) {
  EXPECT_THAT(ServerExtensions(/*prefix_cache_enabled=*/false), Not(Contains("prefix_cache")));
  EXPECT_THAT(ServerExtensions(/*prefix_cache_enabled=*/false), Contains("system_shared_memory"));
}

}  // namespace
}  // namespace kvt
