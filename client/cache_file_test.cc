#include "client/cache_file.h"

#include <cstdlib>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace kvt {
namespace {

HostCache RandomCache(Layout layout) {
  HostCache cache;
  cache.dtype = DType::kBF16;
  cache.layout = layout;
  cache.num_layers = 3;
  cache.num_kv_heads = 2;
  cache.head_dim = 4;
  cache.num_tokens = 5;
  cache.Allocate();
  std::mt19937 rng(std::random_device{}());
  for (auto* buffers : {&cache.k, &cache.v}) {
    for (auto& buffer : *buffers) {
      for (char& byte : buffer) byte = static_cast<char>(rng());
    }
  }
  return cache;
}

std::string TempPath(const char* name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

TEST(CacheFileTest, WriteThenReadRoundTripsBothLayouts) {
  for (Layout layout : {Layout::kHND, Layout::kNHD}) {
    const HostCache cache = RandomCache(layout);
    const std::string path = TempPath("cache.safetensors");
    ASSERT_TRUE(WriteCacheFile(path, cache).ok());
    absl::StatusOr<HostCache> read = ReadCacheFile(path);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->layout, Layout::kHND);
    EXPECT_EQ(read->num_layers, 3);
    EXPECT_EQ(read->num_tokens, 5);
    const HostCache back = ToLayout(*read, layout);
    EXPECT_EQ(back.k, cache.k);
    EXPECT_EQ(back.v, cache.v);
  }
}

TEST(CacheFileTest, NotADumpIsNamed) {
  absl::StatusOr<HostCache> read = ReadCacheFile(TempPath("missing.safetensors"));
  EXPECT_FALSE(read.ok());
}

}  // namespace
}  // namespace kvt
