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

TEST(ServerMetadataTest, ListsThePrefixCacheOnlyWhenEnabled) {
  EXPECT_THAT(ServerExtensions(/*prefix_cache_enabled=*/false), Not(Contains("prefix_cache")));
  EXPECT_THAT(ServerExtensions(/*prefix_cache_enabled=*/false), Contains("system_shared_memory"));
}

}  // namespace
}  // namespace kvt
