#include "mapper_store/device_tier.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace store_internal {
namespace {

using ::absl::StatusCode;

TEST(DeviceWorkerTest, RunsJobsInOrderAndResetDrainsTheQueue) {
  std::vector<int> ran;
  Device device;
  for (int i = 0; i < 5; ++i) device.worker->Submit([&ran, i] { ran.push_back(i); });
  device.worker.reset();
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2, 3, 4}));
  device.worker.reset();  // idempotent
  EXPECT_EQ(ran.size(), 5u);
}

// Counts the host unpins of page-in workers; frees nothing (the versions are the test's).
class CountingUnpinner : public VersionUnpinner {
 public:
  void UnpinVersion(Version& version, Aftermath&) override {
    --version.pins;
    ++unpins;
  }
  int unpins = 0;
};

class DeviceTierTest : public ::testing::Test {
 protected:
  void SetUp() override { tier_.set_host(&unpinner_); }
  void TearDown() override { tier_.StopAll(); }

  // A resident version of a small mapper, listed as entry `id`.
  std::shared_ptr<Version> AddVersion(const std::string& id, uint64_t seed) {
    SynthOptions o;
    o.source = NeoxModelSpec("a", 2, 2, 8);
    o.target = NeoxModelSpec("b", 3, 2, 8);
    o.k = 1;
    o.dtype = DType::kBF16;  // the CPU backend's copy is fp32: its own bytes (fp32 would alias)
    o.seed = seed;
    const std::string dir = JoinPath(root_, id);
    EXPECT_TRUE(WriteSynthMapper(dir, o).ok());
    absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    auto version = std::make_shared<Version>();
    version->id = id;
    version->mapper = std::shared_ptr<const LoadedMapper>(std::move(*loaded));
    version->pins = 1;  // the caller's, as a handle would hold
    MutexLock lock(&state_.mu);
    state_.entries[id].current = version;
    return version;
  }

  uint64_t CopyBytes(const Version& version) {
    const uint64_t bytes = cpu_->PreparedBytesEstimate(version.mapper->view());
    EXPECT_GT(bytes, 0u);
    return bytes;
  }

  void Unpin(DeviceCopy& copy) {
    Aftermath after;
    MutexLock lock(&state_.mu);
    SameLock tier_lock(Held(state_.mu), tier_.mu());
    tier_.Unpin(copy, after);
  }

  TierUsage Usage() {
    std::vector<TierUsage> usage;
    MutexLock lock(&state_.mu);
    SameLock tier_lock(Held(state_.mu), tier_.mu());
    tier_.AppendUsage(&usage);
    EXPECT_EQ(usage.size(), 1u);
    return usage.empty() ? TierUsage() : usage[0];
  }

  std::string root_ = testing::MakeTempDir("device_tier");
  std::unique_ptr<Backend> cpu_ = NewCpuBackend(CpuBackendOptions{1, 64, CpuGemmPath::kSgemm});
  StoreState state_{StoreEvents()};
  CountingUnpinner unpinner_;
  DeviceTier tier_{&state_, "device_budget"};
};

TEST_F(DeviceTierTest, AddNamesAndChecksDevices) {
  KVT_ASSERT_OK(tier_.Add({cpu_.get(), 0}));
  KVT_EXPECT_ERROR(tier_.Add({cpu_.get(), 0}), StatusCode::kAlreadyExists, "already");
  EXPECT_EQ(tier_.Names(), (std::vector<std::string>{"cpu"}));
  EXPECT_EQ(tier_.Find("cpu"), 0);
  EXPECT_EQ(tier_.Find("cuda:0"), -1);
  KVT_EXPECT_OK(tier_.CheckDevice("any"));
  KVT_EXPECT_ERROR(tier_.CheckDevice("cuda:0"), StatusCode::kInvalidArgument,
                   "device='cuda:0' is not a device of this server (devices: cpu)");
  KVT_ASSERT_OK(tier_.Remove("cpu", absl::InfiniteFuture()));
  EXPECT_TRUE(tier_.Names().empty());
  KVT_EXPECT_ERROR(tier_.CheckDevice("cpu"), StatusCode::kInvalidArgument, "(devices: none)");
}

TEST_F(DeviceTierTest, PinPagesInStreamsEveryLayerAndSharesTheCopy) {
  KVT_ASSERT_OK(tier_.Add({cpu_.get(), 0}));
  std::shared_ptr<Version> version = AddVersion("m", 1);
  absl::StatusOr<std::shared_ptr<DeviceCopy>> copy =
      tier_.Pin(version, "any", absl::InfiniteFuture());
  ASSERT_TRUE(copy.ok()) << copy.status();
  KVT_ASSERT_OK(tier_.WaitLayer(**copy, 2, absl::Now() + absl::Seconds(60)));
  absl::StatusOr<std::shared_ptr<DeviceCopy>> again =
      tier_.Pin(version, "cpu", absl::InfiniteFuture());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->get(), copy->get());
  tier_.StopAll();  // the page-in worker is done: its pins are gone
  EXPECT_EQ(unpinner_.unpins, 1);
  TierUsage usage = Usage();
  EXPECT_EQ(usage.pins, 2);
  EXPECT_GT(usage.used_bytes, 0u);
  EXPECT_EQ(usage.pinned_bytes, usage.used_bytes);
  {
    MutexLock lock(&state_.mu);
    SameLock tier_lock(Held(state_.mu), tier_.mu());
    MapperInfo info;
    tier_.AddPlacements(*version, &info);
    EXPECT_EQ(info.devices, (std::vector<std::string>{"cpu"}));
    EXPECT_EQ(info.state, MapperState::kDeviceResident);
    EXPECT_EQ(state_.entries["m"].info.page_ins, 1u);
  }
  Unpin(**copy);
  Unpin(**again);
  usage = Usage();
  EXPECT_EQ(usage.pins, 0);
  EXPECT_EQ(usage.pinned_bytes, 0u);  // resident, evictable
}

TEST_F(DeviceTierTest, FullBudgetEvictsTheLeastRecentlyUsedUnpinnedCopy) {
  std::shared_ptr<Version> first = AddVersion("first", 1);
  std::shared_ptr<Version> second = AddVersion("second", 2);
  KVT_ASSERT_OK(tier_.Add({cpu_.get(), CopyBytes(*first) + CopyBytes(*second) / 2}));
  absl::StatusOr<std::shared_ptr<DeviceCopy>> a = tier_.Pin(first, "", absl::InfiniteFuture());
  ASSERT_TRUE(a.ok()) << a.status();
  // Pinned: the second copy cannot make room before the deadline.
  KVT_EXPECT_ERROR(tier_.Pin(second, "", absl::Now() + absl::Milliseconds(50)),
                   StatusCode::kResourceExhausted, "retry later or raise device_budget");
  Unpin(**a);
  absl::StatusOr<std::shared_ptr<DeviceCopy>> b = tier_.Pin(second, "", absl::InfiniteFuture());
  ASSERT_TRUE(b.ok()) << b.status();
  tier_.StopAll();
  MutexLock lock(&state_.mu);
  SameLock tier_lock(Held(state_.mu), tier_.mu());
  EXPECT_EQ(state_.entries["first"].info.evictions, 1u);
  EXPECT_TRUE((*a)->freed);
  EXPECT_TRUE(first->copies.empty());
  EXPECT_EQ(second->copies.count(0), 1u);
  Aftermath after;
  tier_.Unpin(**b, after);
}

TEST_F(DeviceTierTest, CopyLargerThanEveryBudgetNamesTheKey) {
  std::shared_ptr<Version> version = AddVersion("big", 1);
  KVT_ASSERT_OK(tier_.Add({cpu_.get(), CopyBytes(*version) - 1}));
  KVT_EXPECT_ERROR(tier_.Pin(version, "any", absl::InfiniteFuture()),
                   StatusCode::kFailedPrecondition, "device_budget is smaller (cpu: ");
}

}  // namespace
}  // namespace store_internal
}  // namespace kvt
