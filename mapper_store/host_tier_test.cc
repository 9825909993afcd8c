#include "mapper_store/host_tier.h"

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/source.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace store_internal {
namespace {

using ::absl::StatusCode;

class HostTierTest : public ::testing::Test {
 protected:
  // A mapper directory listed as Scan would list it; returns its expected bytes.
  uint64_t AddMapper(const std::string& id, uint64_t seed) {
    SynthOptions o;
    o.source = NeoxModelSpec("a", 2, 2, 8);
    o.target = NeoxModelSpec("b", 3, 2, 8);
    o.k = 1;
    o.dtype = DType::kFP16;
    o.seed = seed;
    const std::string dir = JoinPath(root_, id);
    EXPECT_TRUE(WriteSynthMapper(dir, o).ok());
    const Fingerprint fingerprint = *FingerprintDirectory(dir);
    MutexLock lock(&state_.mu);
    Entry& entry = state_.entries[id];
    entry.info.id = id;
    entry.fingerprint = fingerprint;
    entry.expected_bytes = ExpectedWeightBytes(dir, kDefaultWeightsFileName, fingerprint);
    return entry.expected_bytes;
  }

  void MakeHost(uint64_t budget) {
    StoreOptions options;
    options.host_budget_bytes = budget;
    options.host_budget_key = "host_budget";
    host_ = std::make_unique<HostTier>(&state_, &devices_, root_, options);
    devices_.set_host(host_.get());
  }

  absl::StatusOr<std::shared_ptr<Version>> Acquire(const std::string& id,
                                                   absl::Time deadline = absl::InfiniteFuture()) {
    Aftermath after;
    UniqueLock lock(&state_.mu);
    absl::StatusOr<std::shared_ptr<Version>> version;
    {
      SameLock host_lock(Held(state_.mu), host_->mu());
      version = host_->AcquireLocked(id, deadline, after);
    }
    lock.Unlock();
    state_.Fire(after);
    return version;
  }

  void Release(Version& version) {
    Aftermath after;
    {
      MutexLock lock(&state_.mu);
      SameLock host_lock(Held(state_.mu), host_->mu());
      host_->Release(version, after);
    }
    state_.Fire(after);
  }

  MapperInfo Info(const std::string& id) {
    MutexLock lock(&state_.mu);
    SameLock host_lock(Held(state_.mu), host_->mu());
    return host_->InfoLocked(state_.entries.at(id));
  }

  TierUsage Usage() {
    MutexLock lock(&state_.mu);
    SameLock host_lock(Held(state_.mu), host_->mu());
    return host_->Usage();
  }

  std::string root_ = testing::MakeTempDir("host_tier");
  StoreState state_{StoreEvents()};
  DeviceTier devices_{&state_, "device_budget"};
  std::unique_ptr<HostTier> host_;
};

TEST_F(HostTierTest, LoadsOnceThenHitsAndAccountsPins) {
  const uint64_t bytes = AddMapper("m", 1);
  MakeHost(0);
  EXPECT_EQ(Info("m").state, MapperState::kDiscovered);
  absl::StatusOr<std::shared_ptr<Version>> first = Acquire("m");
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::shared_ptr<Version>> second = Acquire("m");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->get(), second->get());
  EXPECT_EQ((*first)->bytes, bytes);  // the source's estimate was exact
  MapperInfo info = Info("m");
  EXPECT_EQ(info.state, MapperState::kHostResident);
  EXPECT_EQ(info.loads, 1u);
  EXPECT_EQ(info.hits, 2u);
  EXPECT_EQ(info.generation, 1);
  TierUsage usage = Usage();
  EXPECT_EQ(usage.pins, 2);
  EXPECT_EQ(usage.used_bytes, bytes);
  EXPECT_EQ(usage.pinned_bytes, bytes);
  Release(**first);
  Release(**second);
  usage = Usage();
  EXPECT_EQ(usage.pins, 0);
  EXPECT_EQ(usage.pinned_bytes, 0u);
  EXPECT_EQ(usage.used_bytes, bytes);  // resident until evicted
  KVT_EXPECT_ERROR(Acquire("nope"), StatusCode::kNotFound, "no mapper with id 'nope' in ");
}

TEST_F(HostTierTest, FullBudgetEvictsTheUnpinnedAndWaitsForThePinned) {
  const uint64_t bytes = AddMapper("a", 1);
  AddMapper("b", 2);
  MakeHost(bytes + bytes / 2);  // room for one
  absl::StatusOr<std::shared_ptr<Version>> a = Acquire("a");
  ASSERT_TRUE(a.ok()) << a.status();
  KVT_EXPECT_ERROR(Acquire("b", absl::Now() + absl::Milliseconds(50)),
                   StatusCode::kResourceExhausted, "retry later or raise host_budget");
  Release(**a);
  absl::StatusOr<std::shared_ptr<Version>> b = Acquire("b");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE((*a)->freed);
  EXPECT_EQ(Info("a").state, MapperState::kDiscovered);
  EXPECT_EQ(Info("a").evictions, 1u);
  EXPECT_EQ(Usage().used_bytes, (*b)->bytes);
  Release(**b);
}

TEST_F(HostTierTest, TooLargeFailsAtOnceNamingTheKey) {
  const uint64_t bytes = AddMapper("m", 1);
  MakeHost(bytes - 1);
  KVT_EXPECT_ERROR(Acquire("m"), StatusCode::kFailedPrecondition,
                   "of host memory but host_budget is");
}

TEST_F(HostTierTest, ScanLoadNeverWaitsAndABrokenDirectoryFails) {
  const uint64_t bytes = AddMapper("a", 1);
  AddMapper("b", 2);
  MakeHost(bytes + bytes / 2);
  host_->ScanLoad("a");
  EXPECT_EQ(Info("a").state, MapperState::kHostResident);
  host_->ScanLoad("b");  // does not fit beside a, and a scan evicts nothing for a new mapper
  EXPECT_EQ(Info("b").state, MapperState::kDiscovered);
  EXPECT_EQ(Info("a").state, MapperState::kHostResident);

  ASSERT_TRUE(RemoveTree(JoinPath(root_, "a")).ok());
  ASSERT_TRUE(MakeDirs(JoinPath(root_, "a")).ok());
  {
    MutexLock lock(&state_.mu);
    state_.entries["a"].fingerprint = Fingerprint();  // as Scan relists a changed directory
  }
  host_->ScanLoad("a");  // the reload fails: the stale version stops serving too
  const MapperInfo info = Info("a");
  EXPECT_EQ(info.state, MapperState::kFailed);
  EXPECT_FALSE(info.state_reason.empty());
  KVT_EXPECT_ERROR(Acquire("a"), StatusCode::kFailedPrecondition, "failed to load");
  EXPECT_EQ(Usage().used_bytes, 0u);
}

}  // namespace
}  // namespace store_internal
}  // namespace kvt
