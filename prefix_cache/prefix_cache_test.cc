#include "prefix_cache/prefix_cache.h"

#include <atomic>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/types.h"
#include "prefix_cache/chain_hash.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

constexpr int kBlock = 4;
const EntryShape kShape{/*num_layers=*/2, /*num_kv_heads=*/2, /*head_dim=*/4, DType::kFP32};
// One token of one layer's K (or V): 2 heads x 4 dims x 4 bytes; the 64-byte segment alignment
// makes an 8-token entry exactly 2 layers x {K, V} x 256 = 1024 bytes.
constexpr int64_t kEightTokenBytes = 1024;

// Every element depends on the token id at its position, so data of another sequence (or of
// the wrong position) cannot pass for the right one. Exact in fp32 for token ids < 1000.
float Pattern(uint32_t token, int layer, int kind, int head, int dim) {
  return static_cast<float>(token * 10000 + layer * 100 + kind * 50 + head * 10 + dim);
}

void Fill(PendingEntry& pending, absl::Span<const uint32_t> tokens) {
  const EntryShape& s = pending.shape();
  for (int layer = 0; layer < s.num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      float* data = static_cast<float*>(kind == 0 ? pending.k(layer) : pending.v(layer));
      for (int64_t t = 0; t < pending.stored_tokens(); ++t) {
        for (int h = 0; h < s.num_kv_heads; ++h) {
          for (int d = 0; d < s.head_dim; ++d) {
            data[(t * s.num_kv_heads + h) * s.head_dim + d] = Pattern(tokens[t], layer, kind, h, d);
          }
        }
      }
    }
  }
}

// Number of mismatching elements of `view` against the pattern of `tokens`.
int64_t Mismatches(const CacheView& view, absl::Span<const uint32_t> tokens) {
  int64_t bad = 0;
  for (size_t layer = 0; layer < view.k.size(); ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const float* data = static_cast<const float*>(kind == 0 ? view.k[layer] : view.v[layer]);
      for (int64_t t = 0; t < view.num_tokens; ++t) {
        for (int h = 0; h < view.num_kv_heads; ++h) {
          for (int d = 0; d < view.head_dim; ++d) {
            bad += data[(t * view.num_kv_heads + h) * view.head_dim + d] !=
                   Pattern(tokens[t], static_cast<int>(layer), kind, h, d);
          }
        }
      }
    }
  }
  return bad;
}

std::vector<uint32_t> Seq(int n, uint32_t start) {
  std::vector<uint32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), start);
  return tokens;
}

std::vector<uint32_t> Concat(std::vector<uint32_t> a, const std::vector<uint32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Reserve, fill with the pattern, commit: what the server does for an inline Publish.
absl::StatusOr<PublishResult> Publish(PrefixCache& cache, absl::string_view model,
                                      const std::vector<uint32_t>& tokens,
                                      EntryShape shape = kShape,
                                      absl::Duration ttl = absl::ZeroDuration()) {
  absl::StatusOr<std::unique_ptr<PendingEntry>> pending = cache.Reserve(model, tokens, shape, ttl);
  if (!pending.ok()) return pending.status();
  Fill(**pending, tokens);
  return cache.Commit(std::move(*pending));
}

struct FakeClock {
  absl::Time now = absl::FromUnixSeconds(1'800'000'000);
  void Advance(absl::Duration d) { now += d; }
};

class PrefixCacheTest : public ::testing::Test {
 protected:
  std::unique_ptr<PrefixCache> Make(int64_t max_bytes, absl::Duration ttl = absl::Seconds(100),
                                    absl::Duration lease = absl::Seconds(5)) {
    PrefixCacheOptions options;
    options.max_bytes = max_bytes;
    options.ttl = ttl;
    options.block_tokens = kBlock;
    options.lease_duration = lease;
    options.now = [this] { return clock_.now; };
    options.on_evict = [this](absl::string_view model, absl::string_view reason, int64_t bytes) {
      evicted_.push_back(std::string(model) + ":" + std::string(reason));
    };
    absl::StatusOr<std::unique_ptr<PrefixCache>> cache = PrefixCache::Create(std::move(options));
    EXPECT_TRUE(cache.ok()) << cache.status();
    return std::move(*cache);
  }

  FakeClock clock_;
  std::vector<std::string> evicted_;
};

TEST_F(PrefixCacheTest, RoundTripIsByteExactThroughPrefixViews) {
  auto cache = Make(1 << 20);
  const std::vector<uint32_t> tokens = Seq(10, 100);  // 2 whole blocks + a 2-token tail
  absl::StatusOr<PublishResult> published = Publish(*cache, "m", tokens);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(published->stored_tokens, 8);
  EXPECT_EQ(published->new_blocks, 2);
  EXPECT_EQ(published->reused_blocks, 0);
  EXPECT_EQ(published->entry_bytes, kEightTokenBytes);
  EXPECT_EQ(cache->bytes_held(), kEightTokenBytes);

  std::optional<PrefixMatch> match = cache->Longest("m", tokens);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->tokens, 8);
  EXPECT_EQ(match->entry->num_tokens(), 8);
  EXPECT_EQ(match->entry->id(), published->entry_id);
  for (int64_t prefix : {8, 4, 0}) {
    const CacheView view = match->entry->View(prefix);
    EXPECT_EQ(view.layout, Layout::kNHD);
    EXPECT_EQ(view.dtype, DType::kFP32);
    EXPECT_EQ(view.num_tokens, prefix);
    ASSERT_EQ(view.k.size(), 2u);
    EXPECT_EQ(Mismatches(view, tokens), 0) << prefix;
  }
  // A one-block query finds the same entry, cut to that block.
  match = cache->Longest("m", Seq(5, 100));
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->tokens, 4);
  EXPECT_EQ(Mismatches(match->entry->View(match->tokens), tokens), 0);
  // Other model, other first token, too short: misses.
  EXPECT_FALSE(cache->Longest("other", tokens).has_value());
  EXPECT_FALSE(cache->Longest("m", Seq(8, 101)).has_value());
  EXPECT_FALSE(cache->Longest("m", Seq(3, 100)).has_value());
  const PrefixCacheStats stats = cache->stats();
  EXPECT_EQ(stats.hits, 2);
  EXPECT_EQ(stats.misses, 3);
  EXPECT_EQ(stats.entries, 1);
  EXPECT_EQ(cache->Models(), std::vector<std::string>{"m"});
}

TEST_F(PrefixCacheTest, LongestPrefixAcrossTwoEntriesAndMaxTokens) {
  auto cache = Make(1 << 20);
  const std::vector<uint32_t> a = Seq(16, 100);
  const std::vector<uint32_t> b = Concat(Seq(8, 100), Seq(12, 500));  // shares 2 blocks with a
  ASSERT_TRUE(Publish(*cache, "m", a).ok());
  absl::StatusOr<PublishResult> pb = Publish(*cache, "m", b);
  ASSERT_TRUE(pb.ok());
  EXPECT_EQ(pb->reused_blocks, 2);
  EXPECT_EQ(pb->new_blocks, 3);
  EXPECT_EQ(pb->subsumed_entries, 0);  // a branch, not a continuation

  std::optional<PrefixMatch> m = cache->Longest("m", Concat(a, Seq(4, 900)));
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->tokens, 16);
  EXPECT_EQ(Mismatches(m->entry->View(m->tokens), a), 0);

  // Diverges from b inside its 4th block: 3 blocks of b.
  std::vector<uint32_t> q = b;
  q[13] = 7;
  m = cache->Longest("m", q);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->tokens, 12);
  EXPECT_EQ(Mismatches(m->entry->View(m->tokens), b), 0);

  // max_tokens rounds down to whole blocks.
  m = cache->Longest("m", a, /*max_tokens=*/11);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->tokens, 8);
  EXPECT_FALSE(cache->Longest("m", a, /*max_tokens=*/3).has_value());
}

TEST_F(PrefixCacheTest, ShorterThanOneBlockStoresNothing) {
  auto cache = Make(1 << 20);
  absl::StatusOr<std::unique_ptr<PendingEntry>> pending = cache->Reserve("m", Seq(3, 1), kShape);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_EQ((*pending)->stored_tokens(), 0);
  EXPECT_EQ((*pending)->bytes(), 0);
  absl::StatusOr<PublishResult> result = cache->Commit(std::move(*pending));
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->stored_tokens, 0);
  EXPECT_TRUE(result->entry_id.empty());
  EXPECT_TRUE(cache->Models().empty());
  EXPECT_EQ(cache->bytes_held(), 0);
}

TEST_F(PrefixCacheTest, ReservationsCountAndDroppingOneReturnsIt) {
  auto cache = Make(kEightTokenBytes);
  {
    absl::StatusOr<std::unique_ptr<PendingEntry>> pending = cache->Reserve("m", Seq(8, 1), kShape);
    ASSERT_TRUE(pending.ok());
    EXPECT_EQ((*pending)->stored_tokens(), 8);
    EXPECT_EQ((*pending)->MutableView().k.size(), 2u);
    EXPECT_EQ(cache->stats().bytes_reserved, kEightTokenBytes);
    // A publish in progress holds its bytes: nothing else fits, and nothing is evictable.
    absl::Status full = Publish(*cache, "m", Seq(8, 50)).status();
    EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(full.message(), HasSubstr("1024 reserved by publishes in progress"));
  }  // dropped uncommitted
  EXPECT_EQ(cache->stats().bytes_reserved, 0);
  EXPECT_TRUE(Publish(*cache, "m", Seq(8, 50)).ok());
  EXPECT_EQ(cache->bytes_held(), kEightTokenBytes);
  EXPECT_EQ(cache->stats().bytes_reserved, 0);
}

TEST_F(PrefixCacheTest, LruEvictsLeastRecentlyUsedFirst) {
  auto cache = Make(3 * kEightTokenBytes);
  const std::vector<uint32_t> a = Seq(8, 100), b = Seq(8, 200), c = Seq(8, 300);
  const std::vector<uint32_t> d = Seq(8, 400), e = Seq(8, 500);
  for (const auto& tokens : {a, b, c}) ASSERT_TRUE(Publish(*cache, "m", tokens).ok());
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(cache->Longest("m", a).has_value());  // a is now the most recent
  absl::StatusOr<PublishResult> pd = Publish(*cache, "m", d);
  ASSERT_TRUE(pd.ok());
  EXPECT_EQ(pd->evicted_entries, 1);
  EXPECT_FALSE(cache->Longest("m", b).has_value());
  EXPECT_TRUE(cache->Longest("m", a).has_value());
  ASSERT_TRUE(Publish(*cache, "m", e).ok());  // c is now the oldest
  EXPECT_FALSE(cache->Longest("m", c).has_value());
  EXPECT_TRUE(cache->Longest("m", d).has_value());
  EXPECT_EQ(evicted_, (std::vector<std::string>{"m:lru", "m:lru"}));
  EXPECT_EQ(cache->stats().evictions_lru, 2);
  EXPECT_EQ(cache->bytes_held(), 3 * kEightTokenBytes);
  // An entry larger than the whole budget is refused up front, naming the limit.
  absl::Status too_big = Publish(*cache, "m", Seq(64, 1)).status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(too_big.message(), HasSubstr("prefix_cache.max_bytes=3072"));
  EXPECT_EQ(cache->stats().entries, 3);  // and nothing was evicted for it
}

TEST_F(PrefixCacheTest, LeasedEntriesSurviveEvictionPressure) {
  auto cache = Make(2 * kEightTokenBytes);
  const std::vector<uint32_t> a = Seq(8, 100), b = Seq(8, 200), c = Seq(8, 300);
  ASSERT_TRUE(Publish(*cache, "m", a).ok());
  ASSERT_TRUE(Publish(*cache, "m", b).ok());
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(cache->Longest("m", b).has_value());  // a is the LRU victim, but leased:
  const std::string lease_a = cache->Lease(*cache->Longest("m", a));
  ASSERT_TRUE(cache->Longest("m", b).has_value());
  ASSERT_TRUE(Publish(*cache, "m", c).ok());
  EXPECT_TRUE(cache->Longest("m", a).has_value());
  EXPECT_FALSE(cache->Longest("m", b).has_value());

  absl::StatusOr<PrefixLease> taken_c = cache->Take(cache->Lease(*cache->Longest("m", c)));
  ASSERT_TRUE(taken_c.ok()) << taken_c.status();
  // Only leased entries remain: nothing can make room.
  absl::Status full = Publish(*cache, "m", Seq(8, 400)).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("prefix_cache.max_bytes=2048"));
  EXPECT_THAT(full.message(), HasSubstr("1024 bytes"));
  EXPECT_EQ(cache->stats().entries, 2);
  // Admin eviction does not touch them either.
  EvictResult evicted = cache->Evict("", "");
  EXPECT_EQ(evicted.evicted_entries, 0);
  EXPECT_EQ(evicted.skipped_leased, 2);

  *taken_c = PrefixLease();  // the translation finished: c is evictable again
  absl::StatusOr<PublishResult> pd = Publish(*cache, "m", Seq(8, 400));
  ASSERT_TRUE(pd.ok()) << pd.status();
  EXPECT_EQ(pd->evicted_entries, 1);
  EXPECT_FALSE(cache->Longest("m", c).has_value());
  EXPECT_TRUE(cache->Longest("m", a).has_value());
  EXPECT_TRUE(cache->Take(lease_a).ok());
}

TEST_F(PrefixCacheTest, TtlDefaultsCapsAndExpiresWithTheClock) {
  auto cache = Make(1 << 20, /*ttl=*/absl::Seconds(10));
  const std::vector<uint32_t> a = Seq(8, 100), b = Seq(8, 200), c = Seq(8, 300);
  ASSERT_TRUE(Publish(*cache, "m", a).ok());                               // default 10 s
  ASSERT_TRUE(Publish(*cache, "m", b, kShape, absl::Seconds(5)).ok());     // 5 s
  ASSERT_TRUE(Publish(*cache, "m", c, kShape, absl::Seconds(1000)).ok());  // capped to 10 s
  const std::vector<EntryInfo> infos = cache->List("m");
  ASSERT_EQ(infos.size(), 3u);
  EXPECT_EQ(infos[0].expires, clock_.now + absl::Seconds(10));
  EXPECT_EQ(infos[1].expires, clock_.now + absl::Seconds(5));
  EXPECT_EQ(infos[2].expires, clock_.now + absl::Seconds(10));

  clock_.Advance(absl::Seconds(5));
  EXPECT_FALSE(cache->Longest("m", b).has_value());
  EXPECT_TRUE(cache->Longest("m", a).has_value());
  EXPECT_EQ(cache->stats().evictions_ttl, 1);
  EXPECT_EQ(evicted_, std::vector<std::string>{"m:ttl"});

  clock_.Advance(absl::Seconds(5));
  cache->SweepExpired();
  EXPECT_EQ(cache->stats().entries, 0);
  EXPECT_EQ(cache->bytes_held(), 0);
  EXPECT_TRUE(cache->Models().empty());
  EXPECT_EQ(Publish(*cache, "m", a, kShape, absl::Seconds(-1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(PrefixCacheTest, ExpiredLeasedEntryIsHiddenThenRemovedOnRelease) {
  auto cache = Make(1 << 20, /*ttl=*/absl::Seconds(10), /*lease=*/absl::Seconds(60));
  const std::vector<uint32_t> a = Seq(8, 100);
  ASSERT_TRUE(Publish(*cache, "m", a).ok());
  absl::StatusOr<PrefixLease> lease = cache->Take(cache->Lease(*cache->Longest("m", a)));
  ASSERT_TRUE(lease.ok());
  clock_.Advance(absl::Seconds(11));
  EXPECT_FALSE(cache->Longest("m", a).has_value());
  EXPECT_EQ(cache->stats().entries, 1);  // still pinned: the translation reads it
  EXPECT_EQ(Mismatches(lease->View(), a), 0);
  *lease = PrefixLease();
  cache->SweepExpired();
  EXPECT_EQ(cache->stats().entries, 0);
}

TEST_F(PrefixCacheTest, LeasesAreSingleUseAndExpire) {
  auto cache = Make(1 << 20, absl::Seconds(100), /*lease=*/absl::Seconds(5));
  const std::vector<uint32_t> a = Seq(12, 100);
  ASSERT_TRUE(Publish(*cache, "m", a).ok());
  std::optional<PrefixMatch> match = cache->Longest("m", a, 8);
  ASSERT_TRUE(match.has_value());
  const std::string id = cache->Lease(*match);
  EXPECT_EQ(id.size(), 32u);
  EXPECT_NE(cache->Lease(*match), id);
  EXPECT_EQ(cache->List("m")[0].leases, 2);

  absl::StatusOr<PrefixLease> taken = cache->Take(id);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->id(), id);
  EXPECT_EQ(taken->match().tokens, 8);
  EXPECT_EQ(taken->View().num_tokens, 8);
  EXPECT_EQ(Mismatches(taken->View(), a), 0);
  absl::Status again = cache->Take(id).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(again.message(), HasSubstr("unknown or already used"));
  EXPECT_THAT(again.message(), HasSubstr(id));

  const std::string late = cache->Lease(*match);
  clock_.Advance(absl::Seconds(6));
  cache->SweepExpired();
  EXPECT_EQ(cache->List("m")[0].leases, 1);  // the expired leases let go; `taken` still holds
  absl::Status expired = cache->Take(late).status();
  EXPECT_EQ(expired.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(expired.message(), HasSubstr(late));
  EXPECT_THAT(expired.message(), HasSubstr("expired: issued 6s ago"));
  EXPECT_EQ(cache->Take(late).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache->Take("nonsense").status().code(), absl::StatusCode::kNotFound);
  *taken = PrefixLease();
  EXPECT_EQ(cache->List("m")[0].leases, 0);
  const PrefixCacheStats stats = cache->stats();
  EXPECT_EQ(stats.leases_issued, 3);
  EXPECT_EQ(stats.leases_taken, 1);
  EXPECT_EQ(stats.leases_expired, 2);
  EXPECT_TRUE(cache->Lease(PrefixMatch{}).empty());
}

TEST_F(PrefixCacheTest, TakenLeaseOutlivesTheCache) {
  const std::vector<uint32_t> a = Seq(8, 100);
  PrefixLease lease;
  {
    auto cache = Make(1 << 20);
    ASSERT_TRUE(Publish(*cache, "m", a).ok());
    absl::StatusOr<PrefixLease> taken = cache->Take(cache->Lease(*cache->Longest("m", a)));
    ASSERT_TRUE(taken.ok());
    lease = std::move(*taken);
  }
  EXPECT_EQ(Mismatches(lease.View(), a), 0);
}

TEST_F(PrefixCacheTest, LaterTurnSubsumesEarlierOneUnlessLeased) {
  auto cache = Make(1 << 20);
  const std::vector<uint32_t> turn1 = Seq(9, 100);                         // 8 stored
  const std::vector<uint32_t> turn2 = Concat(Seq(8, 100), Seq(10, 300));   // 16 stored
  const std::vector<uint32_t> t2_only = Concat(Seq(8, 100), Seq(8, 300));  // turn 2 as stored
  const std::vector<uint32_t> turn3 = Concat(t2_only, Seq(8, 600));        // 24 stored
  ASSERT_TRUE(Publish(*cache, "m", turn1).ok());
  absl::StatusOr<PublishResult> p2 = Publish(*cache, "m", turn2);
  ASSERT_TRUE(p2.ok());
  EXPECT_EQ(p2->reused_blocks, 2);
  EXPECT_EQ(p2->new_blocks, 2);
  EXPECT_EQ(p2->subsumed_entries, 1);
  ASSERT_EQ(cache->List("m").size(), 1u);
  EXPECT_EQ(cache->List("m")[0].num_tokens, 16);
  EXPECT_EQ(cache->stats().evictions_subsumed, 1);
  EXPECT_EQ(cache->bytes_held(), 2 * kEightTokenBytes);
  EXPECT_EQ(evicted_, std::vector<std::string>{"m:subsumed"});

  // Leased, turn 2 is kept when turn 3 arrives; lookups prefer the longer entry.
  absl::StatusOr<PrefixLease> lease = cache->Take(cache->Lease(*cache->Longest("m", t2_only)));
  ASSERT_TRUE(lease.ok());
  absl::StatusOr<PublishResult> p3 = Publish(*cache, "m", turn3);
  ASSERT_TRUE(p3.ok());
  EXPECT_EQ(p3->reused_blocks, 4);
  EXPECT_EQ(p3->new_blocks, 2);
  EXPECT_EQ(p3->subsumed_entries, 0);
  EXPECT_EQ(cache->List("m").size(), 2u);
  std::optional<PrefixMatch> m = cache->Longest("m", turn3);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->tokens, 24);
  EXPECT_EQ(m->entry->id(), p3->entry_id);
  m = cache->Longest("m", t2_only);  // ties go to the newest entry
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->entry->id(), p3->entry_id);
  EXPECT_EQ(Mismatches(lease->View(), t2_only), 0);
  // Once released, turn 2 is no longer pinned and the next turn drops both earlier ones.
  *lease = PrefixLease();
  absl::StatusOr<PublishResult> p4 = Publish(*cache, "m", Concat(turn3, Seq(4, 700)));
  ASSERT_TRUE(p4.ok());
  EXPECT_EQ(p4->subsumed_entries, 2);
  ASSERT_EQ(cache->List("m").size(), 1u);
  EXPECT_EQ(cache->List("m")[0].num_tokens, 28);
}

TEST_F(PrefixCacheTest, SequencesAlreadyHeldInFullAreDeduplicated) {
  auto cache = Make(1 << 20, absl::Seconds(100));
  const std::vector<uint32_t> a = Seq(16, 100);
  absl::StatusOr<PublishResult> first = Publish(*cache, "m", a, kShape, absl::Seconds(10));
  ASSERT_TRUE(first.ok());
  clock_.Advance(absl::Seconds(5));
  // The same sequence again refreshes the entry (lifetime from now) instead of storing twice.
  absl::StatusOr<PublishResult> same = Publish(*cache, "m", a, kShape, absl::Seconds(10));
  ASSERT_TRUE(same.ok());
  EXPECT_TRUE(same->deduplicated);
  EXPECT_EQ(same->entry_id, first->entry_id);
  EXPECT_EQ(same->reused_blocks, 4);
  EXPECT_EQ(same->new_blocks, 0);
  // A prefix of a held sequence adds nothing either.
  absl::StatusOr<PublishResult> prefix = Publish(*cache, "m", Seq(8, 100));
  ASSERT_TRUE(prefix.ok());
  EXPECT_TRUE(prefix->deduplicated);
  EXPECT_EQ(prefix->stored_tokens, 8);
  const std::vector<EntryInfo> infos = cache->List("");
  ASSERT_EQ(infos.size(), 1u);
  EXPECT_EQ(infos[0].expires, clock_.now + absl::Seconds(100));
  EXPECT_EQ(cache->bytes_held(), 2 * kEightTokenBytes);
  EXPECT_EQ(cache->stats().bytes_reserved, 0);
  EXPECT_EQ(cache->stats().deduplicated, 2);
}

TEST_F(PrefixCacheTest, ShapeErrorsNameTheField) {
  auto cache = Make(1 << 20);
  ASSERT_TRUE(Publish(*cache, "m", Seq(8, 1)).ok());
  EntryShape heads = kShape;
  heads.num_kv_heads = 4;
  absl::Status status = Publish(*cache, "m", Seq(8, 1), heads).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("shape.num_kv_heads=4 differs from 2"));
  EXPECT_THAT(status.message(), HasSubstr("'m'"));
  EntryShape layers = kShape;
  layers.num_layers = 3;
  EXPECT_THAT(Publish(*cache, "m", Seq(8, 1), layers).status().message(),
              HasSubstr("shape.num_layers=3"));
  EntryShape dtype = kShape;
  dtype.dtype = DType::kFP16;
  EXPECT_THAT(Publish(*cache, "m", Seq(8, 1), dtype).status().message(),
              HasSubstr("dtype=fp16 differs from fp32"));
  EntryShape zero = kShape;
  zero.head_dim = 0;
  EXPECT_THAT(Publish(*cache, "x", Seq(8, 1), zero).status().message(),
              HasSubstr("shape.head_dim=0 must be > 0"));
  // Other models have shapes of their own; once a model's entries are gone, it may change.
  EXPECT_TRUE(Publish(*cache, "other", Seq(8, 1), heads).ok());
  EXPECT_EQ(cache->Evict("m", "").evicted_entries, 1);
  EXPECT_TRUE(Publish(*cache, "m", Seq(8, 1), heads).ok());
  EXPECT_EQ(Publish(*cache, "", Seq(8, 1)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PrefixCacheTest, EvictByIdModelAndAll) {
  auto cache = Make(1 << 20);
  absl::StatusOr<PublishResult> a1 = Publish(*cache, "a", Seq(8, 100));
  ASSERT_TRUE(a1.ok());
  ASSERT_TRUE(Publish(*cache, "a", Seq(8, 200)).ok());
  ASSERT_TRUE(Publish(*cache, "b", Seq(8, 100)).ok());
  ASSERT_TRUE(Publish(*cache, "c", Seq(8, 100)).ok());
  EXPECT_EQ(cache->Models(), (std::vector<std::string>{"a", "b", "c"}));
  const std::vector<EntryInfo> listed = cache->List("a");
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].id, a1->entry_id);
  EXPECT_EQ(listed[0].model, "a");
  EXPECT_EQ(listed[0].num_tokens, 8);
  EXPECT_EQ(listed[0].dtype, DType::kFP32);
  EXPECT_EQ(listed[0].bytes, kEightTokenBytes);
  EXPECT_EQ(listed[0].first_block_hash, BlockHashHex(ChainHashes("a", Seq(4, 100), kBlock)[0]));

  EXPECT_EQ(cache->Evict("b", a1->entry_id).evicted_entries, 0);  // id of another model
  EXPECT_EQ(cache->Evict("", "no-such-id").evicted_entries, 0);
  EvictResult by_id = cache->Evict("", a1->entry_id);
  EXPECT_EQ(by_id.evicted_entries, 1);
  EXPECT_EQ(by_id.evicted_bytes, kEightTokenBytes);
  EXPECT_EQ(cache->List("a").size(), 1u);
  EXPECT_EQ(cache->Evict("a", "").evicted_entries, 1);
  EXPECT_EQ(cache->Models(), (std::vector<std::string>{"b", "c"}));
  EvictResult all = cache->Evict("", "");
  EXPECT_EQ(all.evicted_entries, 2);
  EXPECT_EQ(all.evicted_bytes, 2 * kEightTokenBytes);
  EXPECT_TRUE(cache->Models().empty());
  EXPECT_EQ(cache->bytes_held(), 0);
  EXPECT_EQ(cache->stats().evictions_admin, 4);
  EXPECT_EQ(evicted_.size(), 4u);
}

TEST(PrefixCacheOptionsTest, CreateNamesTheBadOption) {
  PrefixCacheOptions options;
  options.max_bytes = 1 << 20;
  options.block_tokens = 0;
  EXPECT_THAT(PrefixCache::Create(options).status().message(),
              HasSubstr("prefix_cache.block_tokens=0"));
  options.block_tokens = 16;
  options.max_bytes = -1;
  EXPECT_THAT(PrefixCache::Create(options).status().message(),
              HasSubstr("prefix_cache.max_bytes=-1"));
  options.max_bytes = 1;
  options.lease_duration = absl::ZeroDuration();
  EXPECT_THAT(PrefixCache::Create(options).status().message(),
              HasSubstr("prefix_cache.lease_duration"));
}

// Publishers, readers and admins on one small cache: every hit must read exactly its tokens'
// data, and the books must balance at the end. Meant for --config=tsan as well.
TEST(PrefixCacheStressTest, ConcurrentPublishLookupLeaseEvict) {
  PrefixCacheOptions options;
  options.max_bytes = 12 * kEightTokenBytes;  // far fewer than the sequences below
  options.ttl = absl::Seconds(60);
  options.block_tokens = kBlock;
  options.lease_duration = absl::Seconds(60);
  std::atomic<int64_t> evicted_bytes{0};
  options.on_evict = [&](absl::string_view, absl::string_view, int64_t bytes) {
    evicted_bytes += bytes;
  };
  absl::StatusOr<std::unique_ptr<PrefixCache>> created = PrefixCache::Create(options);
  ASSERT_TRUE(created.ok());
  PrefixCache& cache = **created;

  // Sequences sharing prefixes (conversation trees): 3 roots x branches x turns.
  auto sequence = [](int id) {
    std::vector<uint32_t> tokens = Seq(8, 100 + 10 * (id % 3));
    const int depth = 1 + (id / 3) % 3;
    for (int d = 0; d < depth; ++d)
      tokens = Concat(tokens, Seq(4 + (id % 5), 400 + 20 * d + id % 7));
    return tokens;
  };
  std::atomic<int64_t> bad{0}, hits{0}, published{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 1500; ++i) {
        const std::vector<uint32_t> tokens = sequence(rng() % 30);
        const int action = rng() % 10;
        const std::string model = (rng() % 4 == 0) ? "b" : "a";
        if (action < 4) {
          if (Publish(cache, model, tokens).ok()) ++published;
        } else if (action < 9) {
          std::optional<PrefixMatch> match = cache.Longest(model, tokens);
          if (!match.has_value()) continue;
          ++hits;
          bad += Mismatches(match->entry->View(match->tokens), tokens);
          if (action == 8) {
            absl::StatusOr<PrefixLease> lease = cache.Take(cache.Lease(*match));
            if (!lease.ok()) {
              ++bad;
              continue;
            }
            bad += Mismatches(lease->View(), tokens);
          }
        } else if (rng() % 8 == 0) {
          cache.Evict(model, "");
        } else {
          cache.List("");
          cache.stats();
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(hits.load(), 0);
  EXPECT_GT(published.load(), 0);
  const PrefixCacheStats stats = cache.stats();
  EXPECT_LE(stats.bytes_held, options.max_bytes);
  EXPECT_EQ(stats.bytes_reserved, 0);
  EXPECT_GT(stats.evictions_lru + stats.evictions_subsumed, 0);  // the budget was contended
  EXPECT_EQ(stats.hits, hits.load());
  int64_t listed = 0;
  for (const EntryInfo& info : cache.List("")) {
    listed += info.bytes;
    EXPECT_EQ(info.leases, 0);
  }
  EXPECT_EQ(listed, stats.bytes_held);
  EXPECT_EQ(cache.Evict("", "").evicted_bytes, stats.bytes_held);
  EXPECT_EQ(cache.bytes_held(), 0);
}

}  // namespace
}  // namespace kvt
