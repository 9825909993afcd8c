#include "transport/paged.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/types.h"
#include "transport/paged_testing.h"

namespace kvt {
namespace {

// vLLM's indexing written out: kv_cache[kind][block][slot][head][dim] (NHD blocks) or
// kv_cache[kind][block][head][slot][dim] (HND blocks), in elements.
int64_t PagedIndex(const PagedLayout& p, int kind, int64_t block, int64_t slot, int64_t head,
                   int64_t dim) {
  const int64_t inner = p.block_layout == Layout::kNHD
                            ? (slot * p.num_kv_heads + head) * p.head_dim + dim
                            : (head * p.block_size + slot) * p.head_dim + dim;
  return ((kind * p.num_blocks + block) * p.block_size * p.num_kv_heads) * p.head_dim + inner;
}

TEST(PagedTest, ScatterPlacesEveryElementWhereVllmLooksAndGatherInverts) {
  std::mt19937 rng(std::random_device{}());
  for (Layout block_layout : {Layout::kNHD, Layout::kHND}) {
    for (Layout layer_layout : {Layout::kNHD, Layout::kHND}) {
      PagedLayout paged{block_layout, /*num_blocks=*/9, /*block_size=*/4, /*heads=*/3,
                        /*head_dim=*/5, /*element_size=*/4};
      const int64_t tokens = 10;  // 3 blocks, the last one partly used
      const std::vector<uint32_t> table = {7, 2, 5};
      ASSERT_TRUE(CheckBlockTable(paged, table.data(), 3, tokens, true, "t").ok());
      const LayerGeometry layer{layer_layout, 3, tokens, 5, 4};
      std::vector<float> contiguous(3 * tokens * 5);
      for (float& x : contiguous) x = std::uniform_real_distribution<float>(-1, 1)(rng);
      std::vector<float> tensor(paged.layer_bytes() / 4, -7.0f);
      for (int kind = 0; kind < 2; ++kind) {
        ScatterPaged(paged, table.data(), kind, contiguous.data(), layer, tensor.data(), 0, tokens);
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t h = 0; h < 3; ++h) {
            for (int64_t d = 0; d < 5; ++d) {
              ASSERT_EQ(tensor[PagedIndex(paged, kind, table[t / 4], t % 4, h, d)],
                        contiguous[CacheOffset(layer_layout, 3, tokens, 5, h, t, d)]);
            }
          }
        }
        std::vector<float> back(contiguous.size(), 0);
        GatherPaged(paged, table.data(), kind, tensor.data(), layer, back.data());
        EXPECT_EQ(back, contiguous);
      }
      // Slots the request does not use are left alone: 2 * (9 * 4 - 10) slots of 3 x 5.
      int64_t untouched = 0;
      for (float x : tensor) untouched += x == -7.0f;
      EXPECT_EQ(untouched, 2 * (9 * 4 - 10) * 3 * 5);
    }
  }
}

// vLLM's CPU attention order, fp32, small blocks (the element loop). Tokens before first_token
// stay untouched.
TEST(PagedTest, EngineOrderScatterAndGather) {
  std::mt19937 rng(std::random_device{}());
  constexpr int64_t kBlocks = 6, kBlockSize = 4, kHeads = 3, kDim = 5, kTokens = 10, kFirst = 4;
  const PagedLayout paged = VllmCpuOrder(kBlocks, kBlockSize, kHeads, kDim, /*element_size=*/4);
  const EngineBlockOrder& order = *paged.engine_order;
  const int64_t bytes = kBlocks * order.block_stride * 4;
  ASSERT_EQ(paged.RequiredBytes(1), bytes);
  ASSERT_TRUE(CheckEngineBlockOrder(paged, 1, bytes, "f").ok());
  EXPECT_EQ(std::string(CheckEngineBlockOrder(paged, 1, bytes - 4, "f").message()),
            "f.layer_offsets[0]=0: the layer's 2880 bytes end past the region range of 2876 bytes");
  const std::vector<uint32_t> table = {5, 0, 3};
  const LayerGeometry layer{Layout::kHND, kHeads, kTokens, kDim, 4};
  std::vector<float> contiguous(kHeads * kTokens * kDim);
  for (float& x : contiguous) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<float> tensor(static_cast<size_t>(bytes / 4), -7.0f);
    ScatterPaged(paged, table.data(), kind, contiguous.data(), layer, tensor.data(), kFirst, kTokens);
    int64_t written = 0;
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t d = 0; d < kDim; ++d) {
          const int64_t slot = t % kBlockSize;
          const int64_t inner = kind == 0 ? d * kBlockSize + slot : kBlockSize * kDim + slot * kDim + d;
          const float got = tensor[table[t / kBlockSize] * order.block_stride +
                                   h * 2 * kBlockSize * kDim + inner];
          if (t < kFirst) {
            ASSERT_EQ(got, -7.0f);
          } else {
            ASSERT_EQ(got, contiguous[CacheOffset(Layout::kHND, kHeads, kTokens, kDim, h, t, d)]);
            ++written;
          }
        }
      }
    }
    int64_t untouched = 0;
    for (float x : tensor) untouched += x == -7.0f;
    EXPECT_EQ(untouched, bytes / 4 - written);
    std::vector<float> back(contiguous.size(), 0);
    ScatterPaged(paged, table.data(), kind, contiguous.data(), layer, tensor.data(), 0, kTokens);
    GatherPaged(paged, table.data(), kind, tensor.data(), layer, back.data());
    EXPECT_EQ(back, contiguous);
  }
}

// The engine order at vLLM CPU's real block size, for 2- and 4-byte elements: whole blocks take
// the tiled transpose, a partly used first or last block (and a head_dim that is not a multiple
// of the tile) the element loop. Every element is checked against the index formula, bit for
// bit (random bit patterns, NaNs included).
template <typename Element>
void CheckEngineOrderTiles(int64_t head_dim, int64_t first_token, int64_t tokens,
                           Layout layer_layout) {
  SCOPED_TRACE(testing::Message() << sizeof(Element) << "-byte elements, head_dim " << head_dim
                                  << ", tokens [" << first_token << ", " << tokens << ")");
  std::mt19937 rng(std::random_device{}());
  constexpr int64_t kBlocks = 7, kBlockSize = 32, kHeads = 3;
  const int64_t element = sizeof(Element);
  const PagedLayout paged = VllmCpuOrder(kBlocks, kBlockSize, kHeads, head_dim, element);
  const EngineBlockOrder& order = *paged.engine_order;
  const int64_t elements = kBlocks * order.block_stride;
  ASSERT_TRUE(CheckEngineBlockOrder(paged, 1, elements * element, "f").ok());
  const std::vector<uint32_t> table = {4, 0, 6, 2, 5};
  const LayerGeometry layer{layer_layout, kHeads, tokens, head_dim, element};
  std::vector<Element> contiguous(kHeads * tokens * head_dim);
  for (Element& x : contiguous) x = static_cast<Element>(rng());
  for (int kind = 0; kind < 2; ++kind) {
    std::vector<Element> tensor(elements, static_cast<Element>(0x5a5a5a5a));
    ScatterPaged(paged, table.data(), kind, contiguous.data(), layer, tensor.data(), first_token,
                 tokens);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          const int64_t slot = t % kBlockSize;
          const int64_t inner = kind == 0 ? d * kBlockSize + slot
                                          : kBlockSize * head_dim + slot * head_dim + d;
          const Element got = tensor[table[t / kBlockSize] * order.block_stride +
                                     h * 2 * kBlockSize * head_dim + inner];
          const Element want =
              t < first_token ? static_cast<Element>(0x5a5a5a5a)
                              : contiguous[CacheOffset(layer_layout, kHeads, tokens, head_dim, h,
                                                       t, d)];
          ASSERT_EQ(got, want) << "kind " << kind << " token " << t << " head " << h << " dim "
                               << d;
        }
      }
    }
    std::vector<Element> back(contiguous.size(), 0);
    ScatterPaged(paged, table.data(), kind, contiguous.data(), layer, tensor.data(), 0, tokens);
    GatherPaged(paged, table.data(), kind, tensor.data(), layer, back.data());
    ASSERT_EQ(back, contiguous) << "kind " << kind;
  }
}

TEST(PagedTest, EngineOrderTilesAtVllmCpuBlockSize) {
  for (Layout layer_layout : {Layout::kNHD, Layout::kHND}) {
    // 150 tokens: blocks 0-3 whole, block 4 partly used; scattering from token 40 starts in
    // the middle of block 1, at a tile boundary (40 = 32 + 8), and from 37 off one.
    for (int64_t first : {0, 37, 40}) {
      CheckEngineOrderTiles<uint16_t>(16, first, 150, layer_layout);
      CheckEngineOrderTiles<uint32_t>(16, first, 150, layer_layout);
      CheckEngineOrderTiles<uint16_t>(12, first, 150, layer_layout);  // not a multiple of 8
      CheckEngineOrderTiles<uint32_t>(6, first, 150, layer_layout);   // nor of 4
    }
  }
}

TEST(PagedTest, BadBlockTablesNameTheField) {
  const PagedLayout paged{Layout::kNHD, 8, 16, 2, 4, 2};
  const std::vector<uint32_t> table = {1, 8, 1};
  absl::Status short_table = CheckBlockTable(paged, table.data(), 1, 17, false, "f");
  EXPECT_EQ(short_table.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(short_table.message(),
            "f.block_table has 1 entries; 17 tokens in blocks of 16 need 2");
  absl::Status outside = CheckBlockTable(paged, table.data(), 3, 40, false, "f");
  EXPECT_EQ(outside.message(), "f.block_table[1]=8 is outside num_blocks=8");
  const std::vector<uint32_t> repeated = {1, 3, 1};
  EXPECT_TRUE(CheckBlockTable(paged, repeated.data(), 3, 40, false, "f").ok());
  absl::Status repeat = CheckBlockTable(paged, repeated.data(), 3, 40, true, "f");
  EXPECT_EQ(repeat.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(repeat.message().find("f.block_table[2]=1 repeats block_table[0]"),
            absl::string_view::npos);
  // Entries past the tokens' blocks are not looked at.
  EXPECT_TRUE(CheckBlockTable(paged, table.data(), 3, 16, true, "f").ok());
  EXPECT_NE(CheckBlockTable(PagedLayout{Layout::kNHD, 8, 0, 2, 4, 2}, table.data(), 3, 4, false,
                            "f")
                .message()
                .find("f.block_size must be > 0"),
            absl::string_view::npos);
}

}  // namespace
}  // namespace kvt
