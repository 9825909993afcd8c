#include "host_cache/host_cache.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "host_cache/host_cache_testing.h"
#include "kernels/testing/reference.h"

namespace kvt {
namespace {

using testing::Kind;
using testing::ReadLayer;

// Every layer's K and V of `cache` as doubles [token][head][dim], whatever its layout.
std::vector<std::vector<double>> Rows(const HostCache& cache) {
  std::vector<std::vector<double>> rows;
  const CacheView view = cache.view();
  for (int l = 0; l < cache.num_layers; ++l) {
    for (Kind kind : {Kind::kK, Kind::kV}) rows.push_back(ReadLayer(view, l, kind));
  }
  return rows;
}

// Slices and joins keep every element where it belongs, in both layouts (HND re-strides every
// head), and a join takes the first cache's layout.
TEST(HostCacheTest, SliceAndConcatTokensKeepEveryElementInBothLayouts) {
  const ModelSpec model = NeoxModelSpec("m", 2, 3, 4);
  for (Layout first_layout : {Layout::kHND, Layout::kNHD}) {
    for (Layout second_layout : {Layout::kHND, Layout::kNHD}) {
      SCOPED_TRACE(static_cast<int>(first_layout) * 2 + static_cast<int>(second_layout));
      const HostCache whole = testing::RandomHostCache(model, 11, DType::kBF16, first_layout,
                                                       testing::FreshSeed("host cache"));
      const HostCache head = SliceTokens(whole, 0, 4);
      HostCache tail = SliceTokens(whole, 4, 11);
      EXPECT_EQ(head.num_tokens, 4);
      EXPECT_EQ(tail.num_tokens, 7);
      if (second_layout != first_layout) {
        // The same tokens in the other layout, to join across layouts.
        const HostCache other = testing::RandomHostCache(model, 7, DType::kBF16, second_layout,
                                                         testing::FreshSeed("other"));
        tail = ConcatTokens(SliceTokens(other, 0, 0), tail);  // re-laid out as `other`
        EXPECT_EQ(tail.layout, second_layout);
      }
      const HostCache joined = ConcatTokens(head, tail);
      EXPECT_EQ(joined.layout, first_layout);
      EXPECT_EQ(joined.num_tokens, 11);
      EXPECT_EQ(Rows(joined), Rows(whole));
      // A slice of [t, t + n) is rows t*heads*dim ... of every layer.
      const std::vector<std::vector<double>> all = Rows(whole);
      const std::vector<std::vector<double>> part = Rows(SliceTokens(whole, 3, 8));
      const int64_t row = 3 * 4;  // heads x head_dim
      for (size_t i = 0; i < all.size(); ++i) {
        EXPECT_EQ(part[i], std::vector<double>(all[i].begin() + 3 * row,
                                               all[i].begin() + 8 * row));
      }
    }
  }
}

}  // namespace
}  // namespace kvt
