#include "transport/kv_chunks.h"

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(KvChunksTest, ScatterThenGatherRoundTripsEveryLayoutAndSplit) {
  std::mt19937 rng(std::random_device{}());
  for (Layout layout : {Layout::kHND, Layout::kNHD}) {
    LayerGeometry g{layout, 3, 37, 5, 2};
    std::vector<uint16_t> layer(g.num_heads * g.num_tokens * g.head_dim);
    std::iota(layer.begin(), layer.end(), 1);
    std::vector<uint16_t> rebuilt(layer.size(), 0);
    int64_t start = 0;
    while (start < g.num_tokens) {
      const int64_t count = std::min<int64_t>(1 + rng() % 9, g.num_tokens - start);
      std::vector<uint16_t> chunk(g.num_heads * count * g.head_dim);
      GatherChunk(g, start, count, layer.data(), chunk.data());
      // The chunk itself is in compact layout: check one element by the layout formula.
      const int64_t h = g.num_heads - 1, t = count - 1, d = 2;
      const int64_t in_chunk = CacheOffset(layout, g.num_heads, count, g.head_dim, h, t, d);
      const int64_t in_layer =
          CacheOffset(layout, g.num_heads, g.num_tokens, g.head_dim, h, start + t, d);
      EXPECT_EQ(chunk[in_chunk], layer[in_layer]);
      ScatterChunk(g, start, count, chunk.data(), rebuilt.data());
      start += count;
    }
    EXPECT_EQ(rebuilt, layer) << LayoutName(layout);
  }
}

TEST(KvChunksTest, TokensPerChunkRespectsByteBudget) {
  LayerGeometry g{Layout::kHND, 8, 1000, 128, 2};  // 2 KiB per token
  EXPECT_EQ(TokensPerChunk(g, 4 << 20), 2048);
  EXPECT_EQ(TokensPerChunk(g, 100), 1);  // never zero
}

TEST(CoverageTrackerTest, DetectsOverlapAndGaps) {
  CoverageTracker tracker(2, 10);
  EXPECT_TRUE(tracker.Add(0, 0, 0, 5).ok());
  absl::Status overlap = tracker.Add(0, 0, 4, 2);
  EXPECT_EQ(overlap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.message().find("repeats token 4"), absl::string_view::npos);
  EXPECT_FALSE(tracker.Complete());
  EXPECT_EQ(tracker.FirstGap(), "layer 0 K: tokens [5, 10) missing");
  EXPECT_FALSE(tracker.KindComplete(0, 0));
  EXPECT_TRUE(tracker.Add(0, 0, 5, 5).ok());
  EXPECT_TRUE(tracker.KindComplete(0, 0));
  EXPECT_FALSE(tracker.KindComplete(0, 1));
  EXPECT_TRUE(tracker.Add(0, 1, 0, 10).ok());
  EXPECT_TRUE(tracker.KindComplete(0, 1));
  EXPECT_TRUE(tracker.LayerComplete(0));
  EXPECT_FALSE(tracker.LayerComplete(1));
  EXPECT_EQ(tracker.FirstGap(), "layer 1 K: tokens [0, 10) missing");
  EXPECT_TRUE(tracker.Add(1, 0, 0, 10).ok());
  EXPECT_TRUE(tracker.Add(1, 1, 0, 10).ok());
  EXPECT_TRUE(tracker.Complete());
  EXPECT_EQ(tracker.FirstGap(), "");
}

}  // namespace
}  // namespace kvt
