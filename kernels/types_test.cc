// CheckPagedBounds against a big-integer reference: random paged geometries in both orders,
// many near the int64 limits or wrapping to exactly the range's size, must be accepted exactly
// when the exact (128-bit, saturating) arithmetic puts every layer inside the range, and an
// accepted one must address no element outside it.
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "kernels/checked_math.h"
#include "kernels/types.h"

namespace kvt {
namespace {

using u128 = unsigned __int128;
constexpr u128 kHuge = u128{1} << 120;  // anything this large is outside every int64 range

// Saturating, so that the reference never wraps: every factor is below 2^64.
u128 Mul(u128 a, u128 b) {
  if (a == 0 || b == 0) return 0;
  if (a >= kHuge || b >= kHuge || a > kHuge / b) return kHuge;
  return a * b;
}
u128 Add(u128 a, u128 b) { return a + b >= kHuge ? kHuge : a + b; }

u128 LastElement(const PagedLayout& p, const BlockStrides& s) {
  return Add(Add(Add(u128(s.offset), Mul(p.block_size - 1, s.slot_stride)),
                 Mul(p.num_kv_heads - 1, s.head_stride)),
             Mul(p.head_dim - 1, s.dim_stride));
}

// The layer extent in exact arithmetic; kHuge when it does not fit an int64.
u128 ReferenceExtent(const PagedLayout& p) {
  if (!p.engine_order) {
    return Mul(Mul(Mul(Mul(Mul(2, p.num_blocks), p.block_size), p.num_kv_heads), p.head_dim),
               p.element_size);
  }
  const EngineBlockOrder& o = *p.engine_order;
  const u128 last = std::max(LastElement(p, o.kv[0]), LastElement(p, o.kv[1]));
  return Mul(Add(Add(Mul(p.num_blocks - 1, o.block_stride), last), 1), p.element_size);
}

bool ReferenceAccepts(const PagedLayout& p, int layers, int64_t range) {
  if (p.num_blocks <= 0 || p.block_size <= 0 || p.num_kv_heads <= 0 || p.head_dim <= 0 ||
      p.element_size <= 0) {
    return false;
  }
  if (p.engine_order) {
    const EngineBlockOrder& o = *p.engine_order;
    for (const BlockStrides& s : o.kv) {
      if (s.offset < 0 || s.slot_stride < 0 || s.head_stride < 0 || s.dim_stride < 0) {
        return false;
      }
    }
    if (o.block_stride < 0) return false;
  }
  const u128 extent = ReferenceExtent(p);
  if (extent > u128(std::numeric_limits<int64_t>::max())) return false;
  if (!p.engine_order) return Mul(layers, extent) == u128(range);
  if (static_cast<int>(p.engine_order->layer_offsets.size()) != layers) return false;
  for (const int64_t at : p.engine_order->layer_offsets) {
    if (at < 0 || at % p.element_size != 0 || Add(u128(at), extent) > u128(range)) return false;
  }
  return true;
}

class Draw {
 public:
  explicit Draw(uint64_t seed) : rng_(seed) {}
  // Small, near 2^31 / 2^32 (the wire's uint32), near 2^62 or near INT64_MAX; sometimes <= 0.
  int64_t Size() {
    switch (rng_() % 8) {
      case 0: return static_cast<int64_t>(rng_() % 3) - 1;
      case 1: return (int64_t{1} << 31) + Jitter();
      case 2: return (int64_t{1} << 32) - 1 - static_cast<int64_t>(rng_() % 4);
      case 3: return (int64_t{1} << 62) + Jitter();
      case 4: return std::numeric_limits<int64_t>::max() - static_cast<int64_t>(rng_() % 4);
      default: return 1 + static_cast<int64_t>(rng_() % 64);
    }
  }
  int64_t Stride() { return rng_() % 4 == 0 ? Size() : static_cast<int64_t>(rng_() % 512); }
  uint64_t Next() { return rng_(); }

 private:
  int64_t Jitter() { return static_cast<int64_t>(rng_() % 9) - 4; }
  std::mt19937_64 rng_;
};

PagedLayout RandomLayout(Draw& d, bool engine, int layers) {
  PagedLayout p;
  p.block_layout = d.Next() % 2 ? Layout::kNHD : Layout::kHND;
  p.num_blocks = d.Size();
  p.block_size = d.Size();
  p.num_kv_heads = d.Next() % 8 == 0 ? d.Size() : 1 + static_cast<int64_t>(d.Next() % 8);
  p.head_dim = d.Next() % 8 == 0 ? d.Size() : 1 + static_cast<int64_t>(d.Next() % 128);
  p.element_size = d.Next() % 2 ? 2 : 4;
  if (engine) {
    EngineBlockOrder o;
    o.block_stride = d.Stride();
    for (BlockStrides& s : o.kv) s = {d.Stride(), d.Stride(), d.Stride(), d.Stride()};
    for (int l = 0; l < layers; ++l) {
      // Mostly whole elements (a real engine's layers), sometimes between two.
      const int64_t at = d.Stride();
      o.layer_offsets.push_back(d.Next() % 8 == 0 ? at : at / p.element_size * p.element_size);
    }
    p.engine_order = o;
  }
  return p;
}

// An accepted layout's farthest element of every layer (both kinds, last block, last slot,
// head and dim) ends inside the range, computed exactly.
void ExpectInside(const PagedLayout& p, int layers, int64_t range) {
  for (int l = 0; l < layers; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      const BlockStrides s = p.Strides(kind);
      const u128 stride = p.engine_order ? u128(p.engine_order->block_stride)
                                         : u128(p.block_size * p.num_kv_heads * p.head_dim);
      const u128 last = Add(Mul(p.num_blocks - 1, stride), LastElement(p, s));
      const u128 end = Add(Add(u128(p.LayerOffset(l)), Mul(last, p.element_size)),
                           p.element_size);
      ASSERT_LE(end, u128(range)) << "layer " << l << " kind " << kind;
    }
  }
}

void RunProperty(bool engine, uint64_t seed, int draws) {
  Draw d(seed);
  int accepted = 0, wrapped = 0;
  for (int i = 0; i < draws; ++i) {
    const int layers = 1 + static_cast<int>(d.Next() % 4);
    const PagedLayout p = RandomLayout(d, engine, layers);
    int64_t range;
    const u128 exact = Mul(layers, ReferenceExtent(p));
    switch (d.Next() % 4) {
      case 0:  // the size an int64 computation wraps to: what used to pass the check
        range = static_cast<int64_t>(static_cast<uint64_t>(exact) & (~uint64_t{0} >> 1));
        ++wrapped;
        break;
      case 1:
        range = exact <= u128(std::numeric_limits<int64_t>::max()) ? static_cast<int64_t>(exact)
                                                                   : d.Size();
        break;
      default:
        range = d.Size();
    }
    if (range < 0) range = 0;
    const bool want = ReferenceAccepts(p, layers, range);
    const absl::Status got = CheckPagedBounds(p, layers, range, "f", "r");
    ASSERT_EQ(got.ok(), want) << "draw " << i << ": " << got << " nb=" << p.num_blocks
                              << " bs=" << p.block_size << " h=" << p.num_kv_heads
                              << " d=" << p.head_dim << " range=" << range;
    if (got.ok()) {
      ++accepted;
      ExpectInside(p, layers, range);
    } else {
      EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
    }
  }
  // The draws must exercise both verdicts, or the property says nothing.
  EXPECT_GT(accepted, draws / 50);
  EXPECT_LT(accepted, draws);
  EXPECT_GT(wrapped, 0);
}

TEST(PagedBoundsProperty, StandardOrderMatchesBigIntegerReference) {
  RunProperty(/*engine=*/false, 40, 200000);
}

TEST(PagedBoundsProperty, EngineOrderMatchesBigIntegerReference) {
  RunProperty(/*engine=*/true, 41, 200000);
}

// A geometry of 2^64 bytes per layer (0 after an int64 wrap) and one whose 2 layers wrap to 0
// are refused, naming the field.
TEST(PagedBounds, WrappingStandardGeometryIsRefused) {
  PagedLayout layer{Layout::kNHD, int64_t{1} << 31, int64_t{1} << 26, 1, 8, 4};
  absl::Status s = CheckPagedBounds(layer, 1, 0, "header.input.region.paged",
                                    "header.input.region");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("header.input.region.paged: num_blocks=2147483648 x "
                             "block_size=67108864 makes a layer larger than 2^63"),
            std::string::npos)
      << s;
  PagedLayout layers{Layout::kNHD, int64_t{1} << 31, int64_t{1} << 25, 1, 8, 4};
  s = CheckPagedBounds(layers, 4, 0, "header.input.region.paged", "header.input.region");
  EXPECT_NE(s.message().find("header.input.region.byte_size=0 but the paged cache is over 2^63"),
            std::string::npos)
      << s;
}

// An engine order whose layer starts between two elements is refused (found by the surface
// fuzzer: a bf16 layer at an odd byte offset was read through uint16_t pointers, misaligned).
TEST(PagedBounds, EngineOrderLayerBetweenElementsIsRefused) {
  PagedLayout p{Layout::kNHD, 4, 2, 1, 8, 2};
  EngineBlockOrder o;
  o.block_stride = 32;
  o.kv[0] = {0, 8, 8, 1};
  o.kv[1] = {16, 8, 8, 1};
  o.layer_offsets = {0, 257};
  p.engine_order = o;
  absl::Status s = CheckEngineBlockOrder(p, 2, 4096, "header.output.region.paged.engine_order");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("header.output.region.paged.engine_order.layer_offsets[1]=257 is "
                             "not a multiple of the element size (2 bytes)"),
            std::string::npos)
      << s;
  p.engine_order->layer_offsets = {0, 256};
  EXPECT_TRUE(CheckEngineBlockOrder(p, 2, 4096, "f").ok());
}

TEST(CheckedMath, DetectsOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(CheckedMul(kMax, 2), std::nullopt);
  EXPECT_EQ(CheckedAdd(kMax, 1), std::nullopt);
  EXPECT_EQ(CheckedProduct({2, int64_t{1} << 31, int64_t{1} << 32}), std::nullopt);
  EXPECT_EQ(CheckedProduct({2, 3, 7}), 42);
}

// A block table is checked without sizing anything by num_blocks.
TEST(CheckBlockTable, HugeNumBlocksAllocatesNothingPerBlock) {
  PagedLayout p{Layout::kNHD, 4294967295, 16, 1, 8, 4};
  const uint32_t table[] = {7, 3, 7};
  const absl::Status s = CheckBlockTable(p, table, 3, 48, /*distinct=*/true, "f");
  EXPECT_NE(s.message().find("f.block_table[2]=7 repeats block_table[0]"), std::string::npos)
      << s;
  EXPECT_TRUE(CheckBlockTable(p, table, 2, 32, true, "f").ok());
}

}  // namespace
}  // namespace kvt
