#include "prefix_cache/prefix_digest.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/types.h"
#include "prefix_cache/chain_hash.h"
#include "prefix_cache/prefix_cache.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

constexpr int kBlock = 4;

std::vector<uint32_t> Seq(int n, uint32_t start) {
  std::vector<uint32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), start);
  return tokens;
}

BlockHash Key(const std::vector<uint32_t>& tokens) {
  return *PrefixDigest::KeyOf(tokens, kBlock);
}

std::unique_ptr<PrefixDigest> MakeDigest(int64_t slots = 1 << 12) {
  PrefixDigestOptions options;
  options.slots = slots;
  options.block_tokens = kBlock;
  options.heartbeat_interval = absl::Milliseconds(20);
  absl::StatusOr<std::unique_ptr<PrefixDigest>> digest = PrefixDigest::Create(options);
  if (!digest.ok()) {
    ADD_FAILURE() << digest.status();
    return nullptr;
  }
  return std::move(*digest);
}

// The object as another process sees it: opened read-only by name, parsed by the layout in
// prefix_digest.h alone.
class ForeignReader {
 public:
  explicit ForeignReader(const std::string& name) {
    const int fd = shm_open(name.c_str(), O_RDONLY, 0);
    EXPECT_GE(fd, 0) << name;
    struct stat st;
    fstat(fd, &st);
    bytes_ = st.st_size;
    base_ = static_cast<const uint8_t*>(mmap(nullptr, bytes_, PROT_READ, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~ForeignReader() { munmap(const_cast<uint8_t*>(base_), bytes_); }

  std::string magic() const { return std::string(reinterpret_cast<const char*>(base_), 8); }
  uint64_t U64(int offset) const { return Load<uint64_t>(offset); }
  uint32_t U32(int offset) const { return Load<uint32_t>(offset); }
  uint16_t U16(int64_t offset) const { return Load<uint16_t>(offset); }
  int64_t bytes() const { return bytes_; }

  bool MightHold(const BlockHash& key) const {
    const uint64_t slots = U64(16);
    for (int i = 0; i < static_cast<int>(U32(8)); ++i) {
      uint32_t word = 0;
      for (int b = 0; b < 4; ++b) word |= uint32_t{key[4 * i + b]} << (8 * b);
      const uint64_t slot = word & (slots - 1);
      if (Load<uint16_t>(kPrefixDigestHeaderBytes + 2 * slot) == 0) return false;
    }
    return true;
  }

 private:
  template <typename T>
  T Load(int64_t offset) const {
    T value = 0;
    for (size_t b = 0; b < sizeof(T); ++b) value |= static_cast<T>(T{base_[offset + b]} << (8 * b));
    return value;
  }

  const uint8_t* base_ = nullptr;
  int64_t bytes_ = 0;
};

TEST(PrefixDigestTest, KeyIsTheSeededChainHashOfTheFirstBlockOnly) {
  const std::vector<uint32_t> tokens = Seq(10, 7);
  EXPECT_EQ(Key(tokens), ChainHashes(kPrefixDigestSeed, Seq(kBlock, 7), kBlock).front());
  // Whatever follows the first block, and whatever model stored it, the key is the same.
  EXPECT_EQ(Key(tokens), Key(Seq(kBlock, 7)));
  EXPECT_NE(Key(tokens), Key(Seq(kBlock, 8)));
  EXPECT_FALSE(PrefixDigest::KeyOf(Seq(kBlock - 1, 7), kBlock).has_value());
  EXPECT_FALSE(PrefixDigest::KeyOf(Seq(8, 7), 0).has_value());
}

TEST(PrefixDigestTest, LayoutAsDocumentedAndHeartbeatMoves) {
  std::unique_ptr<PrefixDigest> digest = MakeDigest(1 << 12);
  ASSERT_NE(digest, nullptr);
  EXPECT_THAT(digest->shm_name(), HasSubstr("/kvt-prefix-digest-"));
  ForeignReader reader(digest->shm_name());
  EXPECT_EQ(reader.bytes(), kPrefixDigestHeaderBytes + 2 * (1 << 12));
  EXPECT_EQ(reader.magic(), "kvtdgst1");
  EXPECT_EQ(reader.U32(8), 3u);
  EXPECT_EQ(reader.U32(12), static_cast<uint32_t>(kBlock));
  EXPECT_EQ(reader.U64(16), 1u << 12);
  EXPECT_EQ(reader.U64(24), digest->instance());
  const uint64_t now_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  const uint64_t first = reader.U64(32);
  EXPECT_LE(first, now_ms);
  EXPECT_GT(first + 5000, now_ms);
  std::this_thread::sleep_for(std::chrono::milliseconds(120));
  EXPECT_GT(reader.U64(32), first);
  struct stat st;
  ASSERT_EQ(stat(("/dev/shm" + digest->shm_name()).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

TEST(PrefixDigestTest, NoFalseNegativesAndRemovalUndoesAddition) {
  std::unique_ptr<PrefixDigest> digest = MakeDigest(1 << 10);
  ASSERT_NE(digest, nullptr);
  ForeignReader reader(digest->shm_name());
  std::mt19937 rng(11);
  std::vector<BlockHash> added;
  for (int i = 0; i < 300; ++i) {
    added.push_back(Key(Seq(kBlock, static_cast<uint32_t>(rng()))));
    digest->Add(added.back());
  }
  EXPECT_EQ(digest->keys(), 300);
  EXPECT_EQ(reader.U64(40), 300u);
  for (const BlockHash& key : added) {
    ASSERT_TRUE(digest->MightHold(key));
    ASSERT_TRUE(reader.MightHold(key));
  }
  // With 300 keys in 1024 counters some other keys read "maybe", most do not.
  int maybe = 0;
  for (int i = 0; i < 1000; ++i) maybe += digest->MightHold(Key(Seq(kBlock, 1u << 30 | i)));
  EXPECT_LT(maybe, 700);
  // Removing every key leaves every counter at zero: nothing reads "maybe".
  for (const BlockHash& key : added) digest->Remove(key);
  EXPECT_EQ(digest->keys(), 0);
  for (const BlockHash& key : added) ASSERT_FALSE(reader.MightHold(key));
  // A key added twice stays until removed twice.
  digest->Add(added[0]);
  digest->Add(added[0]);
  digest->Remove(added[0]);
  EXPECT_TRUE(digest->MightHold(added[0]));
  digest->Remove(added[0]);
  EXPECT_FALSE(digest->MightHold(added[0]));
}

// The occupancy counted in the writer is the number of non-zero counters a reader sees, and the
// false-positive estimate from it matches the rate measured on keys never added.
TEST(PrefixDigestTest, OccupancyAndFalsePositiveEstimateMatchTheCounters) {
  constexpr int64_t kSlots = 1 << 12;
  std::unique_ptr<PrefixDigest> digest = MakeDigest(kSlots);
  ASSERT_NE(digest, nullptr);
  ForeignReader reader(digest->shm_name());
  auto nonzero = [&reader] {
    int64_t n = 0;
    for (int64_t slot = 0; slot < kSlots; ++slot) {
      n += reader.U16(kPrefixDigestHeaderBytes + 2 * slot) != 0;
    }
    return n;
  };
  EXPECT_EQ(digest->occupied_slots(), 0);
  EXPECT_EQ(digest->false_positive_rate(), 0.0);
  std::mt19937 rng(5);
  std::vector<BlockHash> added;
  for (int i = 0; i < 1500; ++i) {
    added.push_back(Key(Seq(kBlock, static_cast<uint32_t>(rng()))));
    digest->Add(added.back());
    if (i % 2 == 0) digest->Add(added.back());  // counters above 1 still count once
  }
  EXPECT_EQ(digest->occupied_slots(), nonzero());
  const double estimate = digest->false_positive_rate();
  int maybe = 0;
  constexpr int kProbes = 20000;
  for (int i = 0; i < kProbes; ++i) maybe += digest->MightHold(Key(Seq(kBlock, 1u << 31 | i)));
  const double measured = static_cast<double>(maybe) / kProbes;
  // About 1500 keys x 3 counters in 4096 slots: fill ~0.67, rate ~0.3; 20000 probes measure it to
  // about +-0.01.
  EXPECT_GT(estimate, 0.2);
  EXPECT_NEAR(measured, estimate, 0.03) << "estimate " << estimate;
  for (size_t i = 0; i < added.size(); ++i) {
    digest->Remove(added[i]);
    if (i % 2 == 0) digest->Remove(added[i]);
    if (i == added.size() / 2) {
      EXPECT_EQ(digest->occupied_slots(), nonzero());
    }
  }
  EXPECT_EQ(digest->occupied_slots(), 0);
  EXPECT_EQ(nonzero(), 0);
}

TEST(PrefixDigestTest, SaturatedCountersStaySet) {
  std::unique_ptr<PrefixDigest> digest = MakeDigest(1 << 10);
  ASSERT_NE(digest, nullptr);
  const BlockHash key = Key(Seq(kBlock, 3));
  for (int i = 0; i < 0x10000 + 5; ++i) digest->Add(key);
  for (int i = 0; i < 0x10000 + 5; ++i) digest->Remove(key);
  EXPECT_TRUE(digest->MightHold(key));  // lost count: "maybe" forever, never a false "no"
}

TEST(PrefixDigestTest, ConcurrentWritersKeepCounts) {
  std::unique_ptr<PrefixDigest> digest = MakeDigest(1 << 10);
  ASSERT_NE(digest, nullptr);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&digest, t] {
      for (int i = 0; i < 500; ++i) {
        const BlockHash key = Key(Seq(kBlock, static_cast<uint32_t>(t * 1000 + i)));
        digest->Add(key);
        digest->Remove(key);
        digest->Add(key);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(digest->keys(), 2000);
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 500; ++i) {
      const BlockHash key = Key(Seq(kBlock, static_cast<uint32_t>(t * 1000 + i)));
      ASSERT_TRUE(digest->MightHold(key));
      digest->Remove(key);
    }
  }
  ForeignReader reader(digest->shm_name());
  for (int64_t slot = 0; slot < (1 << 10); ++slot) {
    ASSERT_EQ(reader.U16(kPrefixDigestHeaderBytes + 2 * slot), 0) << slot;
  }
}

TEST(PrefixDigestTest, BadOptionsNameTheOption) {
  PrefixDigestOptions options;
  options.slots = 1000;
  EXPECT_THAT(PrefixDigest::Create(options).status().message(), HasSubstr("slots: 1000"));
  options.slots = 1 << 10;
  options.block_tokens = 0;
  EXPECT_THAT(PrefixDigest::Create(options).status().message(), HasSubstr("block_tokens"));
  options.block_tokens = 4;
  options.shm_name = "no-slash";
  EXPECT_THAT(PrefixDigest::Create(options).status().message(), HasSubstr("shm_name"));
}

TEST(PrefixDigestTest, NameTakenIsAlreadyExistsAndDestructionUnlinks) {
  std::unique_ptr<PrefixDigest> digest = MakeDigest();
  ASSERT_NE(digest, nullptr);
  const std::string name = digest->shm_name();
  PrefixDigestOptions options;
  options.shm_name = name;
  options.block_tokens = kBlock;
  EXPECT_EQ(PrefixDigest::Create(options).status().code(), absl::StatusCode::kAlreadyExists);
  {
    ForeignReader reader(name);
    EXPECT_GT(reader.U64(32), 0u);
    digest.reset();
    // The reader's mapping outlives the object's name and shows the heartbeat gone.
    EXPECT_EQ(reader.U64(32), 0u);
  }
  EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0);
}

// A digest object left behind by a killed kvtd (heartbeat stopped long ago, or never a digest).
void MakeObject(const std::string& name, const std::string& magic, uint64_t heartbeat_ms) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << name;
  uint8_t header[kPrefixDigestHeaderBytes] = {};
  std::memcpy(header, magic.data(), 8);
  for (int b = 0; b < 8; ++b) header[32 + b] = static_cast<uint8_t>(heartbeat_ms >> (8 * b));
  ASSERT_EQ(write(fd, header, sizeof(header)), static_cast<ssize_t>(sizeof(header)));
  close(fd);
}

bool Exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) close(fd);
  return fd >= 0;
}

TEST(PrefixDigestTest, CreateRemovesDigestsOfDeadKvtdsOnly) {
  const std::string tag = absl::StrCat(getpid(), "-", absl::ToUnixNanos(absl::Now()));
  const uint64_t now_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  const std::string old_beat = "/kvt-prefix-digest-test-old-" + tag;
  const std::string stopped = "/kvt-prefix-digest-test-stopped-" + tag;
  const std::string fresh = "/kvt-prefix-digest-test-fresh-" + tag;
  const std::string not_digest = "/kvt-prefix-digest-test-other-" + tag;
  const std::string other_name = "/kvt-unrelated-" + tag;
  std::unique_ptr<PrefixDigest> live = MakeDigest();  // a live one: beats every 20 ms
  ASSERT_NE(live, nullptr);
  MakeObject(old_beat, "kvtdgst1", now_ms - 120000);
  MakeObject(stopped, "kvtdgst1", 0);
  MakeObject(fresh, "kvtdgst1", now_ms - 1000);
  MakeObject(not_digest, "notadgst", 0);
  MakeObject(other_name, "kvtdgst1", 0);

  PrefixDigestOptions options;
  options.block_tokens = kBlock;
  options.remove_stale_after = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<PrefixDigest>> digest = PrefixDigest::Create(options);
  ASSERT_TRUE(digest.ok()) << digest.status();
  EXPECT_GE((*digest)->stale_removed(), 2);
  EXPECT_FALSE(Exists(old_beat));
  EXPECT_FALSE(Exists(stopped));
  EXPECT_TRUE(Exists(fresh));
  EXPECT_TRUE(Exists(not_digest));
  EXPECT_TRUE(Exists(other_name));
  EXPECT_TRUE(Exists(live->shm_name()));
  for (const std::string& name : {fresh, not_digest, other_name}) shm_unlink(name.c_str());
}

// The cache keeps the digest in step with what it stores.
class DigestedCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    digest_ = MakeDigest();
    ASSERT_NE(digest_, nullptr);
    PrefixCacheOptions options;
    options.max_bytes = 1 << 20;
    options.block_tokens = kBlock;
    options.digest = digest_.get();
    options.now = [this] { return now_; };
    absl::StatusOr<std::unique_ptr<PrefixCache>> cache = PrefixCache::Create(options);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  void Publish(const std::string& model, const std::vector<uint32_t>& tokens) {
    absl::StatusOr<std::unique_ptr<PendingEntry>> pending =
        cache_->Reserve(model, tokens, {1, 1, 4, DType::kFP32});
    ASSERT_TRUE(pending.ok()) << pending.status();
    ASSERT_TRUE(cache_->Commit(std::move(*pending)).ok());
  }

  bool Maybe(const std::vector<uint32_t>& tokens) { return digest_->MightHold(Key(tokens)); }

  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::unique_ptr<PrefixDigest> digest_;
  std::unique_ptr<PrefixCache> cache_;
};

TEST_F(DigestedCacheTest, FollowsCommitsAndEveryKindOfRemoval) {
  const std::vector<uint32_t> a = Seq(12, 100), b = Seq(8, 200);
  EXPECT_FALSE(Maybe(a));
  Publish("m1", a);
  EXPECT_TRUE(Maybe(a));
  EXPECT_TRUE(Maybe(Seq(kBlock, 100)));  // any prompt starting with a's first block
  EXPECT_EQ(digest_->keys(), 1);
  // The same text from another model, a longer turn (subsumes the first), a duplicate.
  Publish("m2", a);
  Publish("m1", Seq(16, 100));
  Publish("m1", Seq(16, 100));
  EXPECT_EQ(digest_->keys(), 2);
  Publish("m1", b);
  EXPECT_TRUE(Maybe(b));
  // Admin eviction of one model's entries leaves the other model's copy of a.
  cache_->Evict("m1", "");
  EXPECT_FALSE(Maybe(b));
  EXPECT_TRUE(Maybe(a));
  // Expiry.
  now_ += absl::Hours(2);
  cache_->SweepExpired();
  EXPECT_FALSE(Maybe(a));
  EXPECT_EQ(digest_->keys(), 0);
  // Shorter than a block: nothing stored, nothing added.
  Publish("m1", Seq(kBlock - 1, 5));
  EXPECT_EQ(digest_->keys(), 0);
}

TEST_F(DigestedCacheTest, LruEvictionRemovesTheKey) {
  // 1 MiB budget, 1x1x4 fp32 entries of 4096 tokens take 128 KiB + alignment: publish until
  // the first is evicted.
  const std::vector<uint32_t> first = Seq(4096, 1);
  Publish("m", first);
  for (uint32_t i = 1; i < 12; ++i) Publish("m", Seq(4096, 1 + 10000 * i));
  EXPECT_GT(cache_->stats().evictions_lru, 0);
  EXPECT_FALSE(Maybe(first));
  EXPECT_EQ(digest_->keys(), cache_->stats().entries);
}

TEST(DigestedCacheCreateTest, BlockTokensMustAgree) {
  std::unique_ptr<PrefixDigest> digest = MakeDigest();
  ASSERT_NE(digest, nullptr);
  PrefixCacheOptions options;
  options.block_tokens = kBlock * 2;
  options.digest = digest.get();
  EXPECT_THAT(PrefixCache::Create(options).status().message(),
              HasSubstr("digest's block_tokens=4"));
}

}  // namespace
}  // namespace kvt
