#include "host_cache/cache_file.h"

#include <cstdlib>
#include <random>
#include <string>

#include "common/testing/test_seed.h"
#include "gtest/gtest.h"
#include "safetensors/safetensors.h"

namespace kvt {
namespace {

HostCache RandomCache(Layout layout) {
  HostCache cache = HostCache::Zeros(DType::kBF16, layout, 3, 2, 4, 5);
  std::mt19937 rng(testing::FreshSeed("random cache"));
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

// Tensors outside layers.* (dump_kv.py --queries writes queries.{j}) are tolerated; a layer
// tensor beyond the numbered run is not.
TEST(CacheFileTest, ExtraTensorsAreToleratedGapsAreNot) {
  const std::vector<uint8_t> bytes(2 * 5 * 4 * 2, 0);
  const std::vector<uint8_t> query_bytes(4 * 5 * 4 * 2, 0);
  std::vector<TensorRef> tensors;
  for (const char* name : {"layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"}) {
    tensors.push_back({{name, DType::kBF16, {2, 5, 4}}, absl::MakeConstSpan(bytes)});
  }
  tensors.push_back({{"queries.0", DType::kBF16, {4, 5, 4}}, absl::MakeConstSpan(query_bytes)});
  tensors.push_back({{"queries.1", DType::kBF16, {4, 5, 4}}, absl::MakeConstSpan(query_bytes)});
  const std::string path = TempPath("extras.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  absl::StatusOr<HostCache> read = ReadCacheFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->num_layers, 2);
  tensors.push_back({{"layers.3.k", DType::kBF16, {2, 5, 4}}, absl::MakeConstSpan(bytes)});
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  read = ReadCacheFile(path);
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("without gaps"), std::string::npos) << read.status();
}

TEST(CacheFileTest, NotADumpIsNamed) {
  absl::StatusOr<HostCache> read = ReadCacheFile(TempPath("missing.safetensors"));
  EXPECT_FALSE(read.ok());
}

}  // namespace
}  // namespace kvt
