// The store's tiers: LRU under byte budgets, pins, waits, single flight, device choice, streamed
// page-ins, hot reload and model control, with real mapper directories and the real CPU backend
// as the "device" (its prepared fp32 copy has its own budget).
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "kernels/testing/reference.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

// Source: 3 layers; target: `target_layers` (the size knob), 2 heads x 8 each.
SynthOptions Pair(const std::string& source, const std::string& target, int target_layers,
                  uint64_t seed = 1) {
  SynthOptions o;
  o.source = NeoxModelSpec(source, 3, 2, 8);
  o.target = NeoxModelSpec(target, target_layers, 2, 8);
  o.k = 2;
  o.dtype = DType::kBF16;  // the CPU backend's prepared copy is fp32: twice the host bytes
  o.seed = seed;
  return o;
}

// The real CPU backend under another device name: a second "device" for device-choice tests.
class RenamedBackend : public Backend {
 public:
  RenamedBackend(Backend* inner, std::string name) : inner_(inner), name_(std::move(name)) {}
  std::string name() const override { return inner_->name(); }
  std::string device() const override { return name_; }
  absl::StatusOr<std::shared_ptr<PreparedMapper>> Prepare(const MapperView& mapper) override {
    return inner_->Prepare(mapper);
  }
  absl::Status TranslateLayer(const PreparedMapper& mapper, int target_layer,
                              const CacheView& source, const Positions& positions,
                              const TranslateOptions& options, MutableCacheView* target) override {
    return inner_->TranslateLayer(mapper, target_layer, source, positions, options, target);
  }

 private:
  Backend* inner_;
  std::string name_;
};

// The CPU backend with a streamed page-in whose layers the test releases one by one, the way a
// GPU backend's copies arrive: checks that the store hands out a copy before it is complete
// and reports each layer as it lands.
class GatedBackend : public RenamedBackend {
 public:
  using RenamedBackend::RenamedBackend;
  absl::Status PrepareLayer(PreparedMapper&, int target_layer) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_ > target_layer; });
    return absl::OkStatus();
  }
  void Open(int layers) {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = layers;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int open_ = 0;
};

absl::Time Soon() { return absl::Now() + absl::Milliseconds(100); }
absl::Time Later() { return absl::Now() + absl::Seconds(20); }

class StorePagingTest : public ::testing::Test {
 protected:
  void Write(const std::string& id, const SynthOptions& options, bool overwrite = false) {
    WriteOptions w;
    w.overwrite = overwrite;
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root_, id), options, w));
  }
  // Host bytes of a mapper directory once loaded (what the host budget accounts).
  uint64_t HostBytes(const std::string& id) {
    absl::StatusOr<std::unique_ptr<LoadedMapper>> m = LoadMapperDir(JoinPath(root_, id));
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? (*m)->weight_bytes() : 0;
  }
  uint64_t PreparedBytes(const std::string& id) {
    absl::StatusOr<std::unique_ptr<LoadedMapper>> m = LoadMapperDir(JoinPath(root_, id));
    EXPECT_TRUE(m.ok()) << m.status();
    return cpu_->Prepare((*m)->view()).value()->bytes();
  }
  std::unique_ptr<MapperStore> Open(StoreOptions options) {
    absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(root_, options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }
  static uint64_t Used(const MapperStore& store, const std::string& place) {
    for (const TierUsage& tier : store.Usage()) {
      if (tier.place == place) return tier.used_bytes;
    }
    return ~0ull;
  }
  // The sum of what List() reports resident per place must equal the tier's accounting.
  static void ExpectAccountingMatches(const MapperStore& store) {
    std::map<std::string, uint64_t> listed;
    for (const MapperInfo& info : store.List()) {
      for (const Placement& p : info.placements) listed[p.device] += p.bytes;
    }
    for (const TierUsage& tier : store.Usage()) {
      EXPECT_EQ(tier.used_bytes, listed[tier.place]) << tier.place;
      EXPECT_EQ(tier.reserved_bytes, 0u) << tier.place;
      if (tier.budget_bytes > 0) {
        EXPECT_LE(tier.used_bytes, tier.budget_bytes) << tier.place;
      }
    }
  }
  MapperState State(const MapperStore& store, const std::string& id) {
    return store.Info(id).value().state;
  }

  std::string root_ = testing::MakeTempDir("paging");
  // The sgemm path: its prepared copy is exactly the fp32 conversion (twice the bf16 host
  // bytes), which the accounting tests below rely on, and it translates within 1e-5. The
  // oneDNN bf16 path's bytes and numerics are kernels/cpu_backend_test's.
  std::unique_ptr<Backend> cpu_ = NewCpuBackend(CpuBackendOptions{1, 64, CpuGemmPath::kSgemm});
};

TEST_F(StorePagingTest, HostLruEvictsLeastRecentlyUsedUnderAByteBudgetWithMixedSizes) {
  Write("small1", Pair("a", "b", 1));
  Write("small2", Pair("c", "d", 1));
  Write("big", Pair("e", "f", 4));
  const uint64_t s1 = HostBytes("small1"), s2 = HostBytes("small2"), big = HostBytes("big");
  ASSERT_EQ(s1, s2);
  ASSERT_GT(big, 2 * s1);
  StoreOptions options;
  options.host_budget_bytes = big + s1;  // big + one small, or both smalls
  options.load_on_scan = false;
  std::unique_ptr<MapperStore> store = Open(options);
  for (const MapperInfo& info : store->List()) {
    EXPECT_EQ(info.state, MapperState::kDiscovered) << info.id;
    EXPECT_GT(info.weight_bytes, 0u);  // what a load will take
  }

  ASSERT_TRUE(store->Acquire("small1").ok());
  ASSERT_TRUE(store->Acquire("small2").ok());
  ASSERT_TRUE(store->Acquire("small1").ok());  // small2 is now the least recently used
  EXPECT_EQ(Used(*store, "host"), s1 + s2);
  ASSERT_TRUE(store->Acquire("big").ok());      // evicts small2 only
  EXPECT_EQ(State(*store, "small1"), MapperState::kHostResident);
  EXPECT_EQ(State(*store, "small2"), MapperState::kDiscovered);
  EXPECT_EQ(State(*store, "big"), MapperState::kHostResident);
  EXPECT_EQ(Used(*store, "host"), s1 + big);
  EXPECT_EQ(store->Info("small2")->evictions, 1u);
  ExpectAccountingMatches(*store);

  ASSERT_TRUE(store->Acquire("small2").ok());  // small1 is older than big: it goes
  EXPECT_EQ(State(*store, "small1"), MapperState::kDiscovered);
  EXPECT_EQ(Used(*store, "host"), s2 + big);
  ASSERT_TRUE(store->Acquire("small1").ok());  // both smalls need room: big goes (LRU)
  EXPECT_EQ(State(*store, "big"), MapperState::kDiscovered);
  EXPECT_EQ(Used(*store, "host"), s1 + s2);
  EXPECT_EQ(store->Info("small1")->loads, 2u);
  EXPECT_EQ(store->Info("small1")->hits, 3u);
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, PinnedMappersAreNeverEvictedAndRequestsWaitThenGetResourceExhausted) {
  Write("one", Pair("a", "b", 2));
  Write("two", Pair("c", "d", 2));
  StoreOptions options;
  options.host_budget_bytes = HostBytes("one") + HostBytes("one") / 2;  // room for one
  options.load_on_scan = false;
  std::unique_ptr<MapperStore> store = Open(options);

  absl::StatusOr<MapperHandle> held = store->Acquire("one");
  ASSERT_TRUE(held.ok());
  AcquireOptions soon;
  soon.deadline = Soon();
  const absl::Time before = absl::Now();
  KVT_EXPECT_ERROR(store->Acquire("two", soon), StatusCode::kResourceExhausted,
                   "mapper_store.host_budget_bytes");
  EXPECT_GE(absl::Now() - before, absl::Milliseconds(90));  // it waited for its deadline
  EXPECT_EQ(State(*store, "one"), MapperState::kHostResident);
  EXPECT_EQ(State(*store, "two"), MapperState::kDiscovered);

  // The pin goes while a request waits: that request gets the room (and only then: the
  // releaser marks the release before it happens).
  absl::Notification acquiring;
  std::atomic<bool> released{false};
  std::thread releaser([&] {
    acquiring.WaitForNotification();
    released = true;
    held->Release();
  });
  AcquireOptions later;
  later.deadline = Later();
  acquiring.Notify();
  absl::StatusOr<MapperHandle> two = store->Acquire("two", later);
  EXPECT_TRUE(released.load());
  releaser.join();
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(State(*store, "one"), MapperState::kDiscovered);
  EXPECT_EQ(Used(*store, "host"), HostBytes("two"));
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, MappersLargerThanABudgetAreAClearError) {
  Write("big", Pair("a", "b", 3));
  StoreOptions options;
  options.host_budget_bytes = HostBytes("big") / 2;
  options.load_on_scan = false;
  std::unique_ptr<MapperStore> store = Open(options);
  KVT_EXPECT_ERROR(store->Acquire("big"), StatusCode::kFailedPrecondition,
                   "but mapper_store.host_budget_bytes is");

  StoreOptions device_options;
  device_options.devices = {{cpu_.get(), PreparedBytes("big") - 1}};
  store = Open(device_options);
  AcquireOptions on_device;
  on_device.device = "any";
  KVT_EXPECT_ERROR(store->Acquire("big", on_device), StatusCode::kFailedPrecondition,
                   "on a device but mapper_store.device_budget_bytes is smaller (cpu: ");
  on_device.device = "cuda:7";
  KVT_EXPECT_ERROR(store->Acquire("big", on_device), StatusCode::kInvalidArgument,
                   "device='cuda:7' is not a device of this server (devices: cpu)");
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, ConcurrentRequestsForAColdMapperCauseOneLoadAndOnePageIn) {
  Write("cold", Pair("a", "b", 3));
  StoreOptions options;
  options.load_on_scan = false;
  options.devices = {{cpu_.get(), 0}};
  std::atomic<int> host_page_ins{0}, device_page_ins{0}, misses{0}, hits{0};
  // The page-in worker reports the device page-in after it hands out the last layer, so after
  // the requests have their layers: the count is read once the report is in.
  absl::Notification device_paged_in;
  options.events.page_in = [&](const LoadedMapper&, const std::string& place, double seconds) {
    EXPECT_GE(seconds, 0);
    if (place == "host") {
      ++host_page_ins;
    } else if (++device_page_ins == 1) {
      device_paged_in.Notify();
    }
  };
  options.events.access = [&](const LoadedMapper&, const std::string& place, bool hit) {
    if (place == "cpu") ++(hit ? hits : misses);
  };
  std::unique_ptr<MapperStore> store = Open(options);
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      AcquireOptions o;
      o.device = "any";
      absl::StatusOr<MapperHandle> h = store->Acquire("cold", o);
      if (h.ok() && h->prepared() != nullptr && h->device() == "cpu" &&
          h->WaitLayerReady(2, Later()).ok()) {
        ++ok;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads);
  ASSERT_TRUE(device_paged_in.WaitForNotificationWithTimeout(absl::Seconds(30)));
  const MapperInfo info = store->Info("cold").value();
  EXPECT_EQ(info.loads, 1u);
  EXPECT_EQ(info.page_ins, 1u);
  EXPECT_EQ(info.hits, static_cast<uint64_t>(kThreads));
  EXPECT_EQ(info.state, MapperState::kDeviceResident);
  EXPECT_EQ(info.devices, (std::vector<std::string>{"host", "cpu"}));
  EXPECT_EQ(host_page_ins.load(), 1);
  EXPECT_EQ(device_page_ins.load(), 1);
  EXPECT_EQ(misses.load(), 1);
  EXPECT_EQ(hits.load(), kThreads - 1);
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, DeviceTierLruPinsAndExactAccounting) {
  Write("m1", Pair("a", "b", 1));
  Write("m2", Pair("c", "d", 1));
  Write("m3", Pair("e", "f", 2));
  const uint64_t p1 = PreparedBytes("m1"), p3 = PreparedBytes("m3");
  ASSERT_EQ(p1, 2 * HostBytes("m1"));  // bf16 -> fp32
  StoreOptions options;
  options.devices = {{cpu_.get(), 2 * p1}};  // m1 + m2, or m3 alone
  int evicted = 0;
  options.events.eviction = [&](const LoadedMapper&, const std::string& place) {
    if (place == "cpu") ++evicted;
  };
  std::unique_ptr<MapperStore> store = Open(options);
  ASSERT_EQ(p3, 2 * p1);
  AcquireOptions dev;
  dev.device = "cpu";
  dev.deadline = Soon();
  {
    absl::StatusOr<MapperHandle> h1 = store->Acquire("m1", dev);
    ASSERT_TRUE(h1.ok()) << h1.status();
    absl::StatusOr<MapperHandle> h2 = store->Acquire("m2", dev);
    ASSERT_TRUE(h2.ok()) << h2.status();
    EXPECT_EQ(Used(*store, "cpu"), 2 * p1);
    // Both pinned: m3 waits for its deadline, then RESOURCE_EXHAUSTED naming the key.
    KVT_EXPECT_ERROR(store->Acquire("m3", dev), StatusCode::kResourceExhausted,
                     "mapper_store.device_budget_bytes");
    const MapperInfo info = store->Info("m1").value();
    ASSERT_EQ(info.placements.size(), 2u);
    EXPECT_EQ(info.placements[1].device, "cpu");
    EXPECT_EQ(info.placements[1].pins, 1);
    EXPECT_EQ(info.placements[1].bytes, p1);
    ExpectAccountingMatches(*store);
  }
  // Unpinned now: m3 evicts both (LRU), and only the device copies: host stays.
  dev.deadline = Later();
  {
    absl::StatusOr<MapperHandle> h3 = store->Acquire("m3", dev);
    ASSERT_TRUE(h3.ok()) << h3.status();
    KVT_ASSERT_OK(h3->WaitLayerReady(1, Later()));
  }
  EXPECT_EQ(evicted, 2);
  EXPECT_EQ(Used(*store, "cpu"), p3);
  EXPECT_EQ(State(*store, "m1"), MapperState::kHostResident);
  EXPECT_EQ(State(*store, "m3"), MapperState::kDeviceResident);
  ExpectAccountingMatches(*store);

  // Unload frees exactly what was accounted.
  ASSERT_TRUE(store->Unload("m3", "cpu", Later()).ok());
  EXPECT_EQ(Used(*store, "cpu"), 0u);
  EXPECT_EQ(State(*store, "m3"), MapperState::kHostResident);
  ASSERT_TRUE(store->Unload("m3", "", Later()).ok());
  EXPECT_EQ(State(*store, "m3"), MapperState::kDiscovered);
  EXPECT_EQ(Used(*store, "host"), HostBytes("m1") + HostBytes("m2"));
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, NewCopiesGoToTheDeviceWithRoomAndTheLeastLoad) {
  Write("m1", Pair("a", "b", 1));
  Write("m2", Pair("c", "d", 1));
  Write("m3", Pair("e", "f", 1));
  RenamedBackend second(cpu_.get(), "cpu:1");
  StoreOptions options;
  const uint64_t p = PreparedBytes("m1");
  options.devices = {{cpu_.get(), 4 * p}, {&second, 4 * p}};
  std::unique_ptr<MapperStore> store = Open(options);
  AcquireOptions any;
  any.device = "any";
  absl::StatusOr<MapperHandle> h1 = store->Acquire("m1", any);
  ASSERT_TRUE(h1.ok());
  absl::StatusOr<MapperHandle> h2 = store->Acquire("m2", any);
  ASSERT_TRUE(h2.ok());
  EXPECT_NE(h1->device(), h2->device());  // the first device is busy with m1
  EXPECT_EQ(h2->backend()->device(), h2->device());
  // A second request for m1 shares its copy rather than making another.
  absl::StatusOr<MapperHandle> again = store->Acquire("m1", any);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->prepared(), h1->prepared());
  h2->Release();
  // Device of m2 is idle now, m1's has two pins: m3 goes where m2 was.
  absl::StatusOr<MapperHandle> h3 = store->Acquire("m3", any);
  ASSERT_TRUE(h3.ok());
  EXPECT_NE(h3->device(), h1->device());
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, StreamedPageInHandsOutTheCopyBeforeEveryLayerHasArrived) {
  Write("m", Pair("a", "b", 3));
  GatedBackend gated(cpu_.get(), "gpu-like");
  StoreOptions options;
  options.devices = {{&gated, 0}};
  std::unique_ptr<MapperStore> store = Open(options);
  AcquireOptions dev;
  dev.device = "gpu-like";
  absl::StatusOr<MapperHandle> h = store->Acquire("m", dev);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_NE(h->prepared(), nullptr);
  KVT_EXPECT_ERROR(h->WaitLayerReady(0, Soon()), StatusCode::kDeadlineExceeded,
                   "target layer 0 was paging in onto gpu-like");
  EXPECT_EQ(State(*store, "m"), MapperState::kHostResident);  // not resident until complete
  EXPECT_FALSE(store->Info("m")->placements[1].ready);
  gated.Open(1);
  KVT_EXPECT_OK(h->WaitLayerReady(0, Later()));
  KVT_EXPECT_ERROR(h->WaitLayerReady(1, Soon()), StatusCode::kDeadlineExceeded, "layer 1");
  gated.Open(3);
  KVT_EXPECT_OK(h->WaitLayerReady(2, Later()));
  // The worker reports the page-in right after the last layer.
  for (int i = 0; i < 200 && State(*store, "m") != MapperState::kDeviceResident; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(State(*store, "m"), MapperState::kDeviceResident);
}

TEST_F(StorePagingTest, PagedCopiesTranslateLikeTheFloat64ReferenceAcrossAReload) {
  Write("m", Pair("a", "b", 2, /*seed=*/11));
  StoreOptions options;
  options.devices = {{cpu_.get(), 0}};
  std::unique_ptr<MapperStore> store = Open(options);
  const uint64_t seed = testing::FreshSeed("paged translate");
  testing::OwnedCache source =
      testing::MakeRandomCache(3, 2, 8, 5, DType::kFP32, Layout::kHND, seed);
  const Positions positions{7};
  auto check = [&](const MapperHandle& h) -> std::vector<double> {
    testing::OwnedCache target = testing::MakeOutputCache(2, 2, 8, 5, DType::kFP32, Layout::kHND);
    for (int l = 0; l < 2; ++l) {
      KVT_EXPECT_OK(h.WaitLayerReady(l, Later()));
      KVT_EXPECT_OK(h.backend()->TranslateLayer(*h.prepared(), l, source.view, positions, {},
                                                &target.mutable_view));
      for (testing::Kind kind : {testing::Kind::kK, testing::Kind::kV}) {
        const std::vector<double> expected = testing::ReferenceTranslate(
            h.mapper().view(), l, kind, source.view, positions);
        EXPECT_LE(testing::MaxRelError(testing::ReadLayer(target.mutable_view, l, kind),
                                       expected),
                  testing::TranslationTolerance(DType::kFP32));
      }
    }
    return testing::ReadLayer(target.mutable_view, 1, testing::Kind::kV);
  };
  AcquireOptions dev;
  dev.device = "cpu";
  absl::StatusOr<MapperHandle> old_handle = store->Acquire("m", dev);
  ASSERT_TRUE(old_handle.ok());
  const std::vector<double> old_out = check(*old_handle);
  Write("m", Pair("a", "b", 2, /*seed=*/12), /*overwrite=*/true);
  KVT_ASSERT_OK(store->Scan());
  absl::StatusOr<MapperHandle> new_handle = store->Acquire("m", dev);
  ASSERT_TRUE(new_handle.ok());
  EXPECT_EQ(old_handle->generation(), 1);
  EXPECT_EQ(new_handle->generation(), 2);
  const std::vector<double> new_out = check(*new_handle);
  EXPECT_NE(old_out, new_out);               // new weights
  EXPECT_EQ(check(*old_handle), old_out);    // the in-flight request keeps its version
  old_handle->Release();
  new_handle->Release();
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, HotReloadNoticesAddModifyCorruptAndRemoveWhileHandlesKeepTheirVersion) {
  Write("m", Pair("a", "b", 2, 1));
  std::unique_ptr<MapperStore> store = Open(StoreOptions());
  store->StartPolling(absl::Milliseconds(10));
  auto wait_for = [&](const std::function<bool()>& done) {
    for (int i = 0; i < 1000 && !done(); ++i) absl::SleepFor(absl::Milliseconds(5));
    return done();
  };

  absl::StatusOr<MapperHandle> v1 = store->Acquire("m");
  ASSERT_TRUE(v1.ok());
  const WeightView w = v1->mapper().view().layers[0].w_k;
  const std::vector<uint8_t> v1_bytes(static_cast<const uint8_t*>(w.data),
                                      static_cast<const uint8_t*>(w.data) + 64);

  // Add.
  Write("added", Pair("c", "d", 1));
  EXPECT_TRUE(wait_for([&] {
    return store->Info("added").ok() && State(*store, "added") == MapperState::kHostResident;
  }));

  // Modify: swapped for the new version; the held handle still reads the old bytes.
  Write("m", Pair("a", "b", 2, 2), /*overwrite=*/true);
  EXPECT_TRUE(wait_for([&] { return store->Info("m")->generation == 2; }));
  absl::StatusOr<MapperHandle> v2 = store->Acquire("m");
  ASSERT_TRUE(v2.ok());
  EXPECT_NE(&v2->mapper(), &v1->mapper());
  EXPECT_EQ(std::vector<uint8_t>(static_cast<const uint8_t*>(w.data),
                                 static_cast<const uint8_t*>(w.data) + 64),
            v1_bytes);
  EXPECT_EQ(Used(*store, "host"), 2 * HostBytes("m") + HostBytes("added"));  // old still held
  v1->Release();
  EXPECT_EQ(Used(*store, "host"), HostBytes("m") + HostBytes("added"));

  // Corrupt: FAILED with the reason, never serves (not even the old version).
  {
    const std::string path = JoinPath(JoinPath(root_, "m"), kDefaultWeightsFileName);
    std::string bytes = *ReadFileToString(path);
    bytes[bytes.size() - 3] ^= 0x10;
    KVT_ASSERT_OK(WriteStringToFile(path, bytes));
  }
  EXPECT_TRUE(wait_for([&] { return State(*store, "m") == MapperState::kFailed; }));
  EXPECT_NE(store->Info("m")->state_reason.find("checksum mismatch"), std::string::npos)
      << store->Info("m")->state_reason;
  KVT_EXPECT_ERROR(store->Acquire("m"), StatusCode::kFailedPrecondition,
                   "mapper 'm' failed to load and cannot serve: ");
  EXPECT_EQ(&v2->mapper().view(), &v2->mapper().view());  // still held and valid
  v2->Release();
  EXPECT_EQ(Used(*store, "host"), HostBytes("added"));

  // Repaired, then removed.
  Write("m", Pair("a", "b", 2, 3), /*overwrite=*/true);
  EXPECT_TRUE(wait_for([&] { return State(*store, "m") == MapperState::kHostResident; }));
  absl::StatusOr<MapperHandle> v3 = store->Acquire("added");
  ASSERT_TRUE(v3.ok());
  KVT_ASSERT_OK(RemoveTree(JoinPath(root_, "added")));
  EXPECT_TRUE(wait_for([&] { return !store->Info("added").ok(); }));
  KVT_EXPECT_ERROR(store->Acquire("added"), StatusCode::kNotFound, "no mapper with id 'added'");
  EXPECT_EQ(v3->mapper().id(), "added");  // dropped once unused
  EXPECT_EQ(Used(*store, "host"), HostBytes("m") + v3->mapper().weight_bytes());
  v3->Release();
  EXPECT_EQ(Used(*store, "host"), HostBytes("m"));
  KVT_EXPECT_OK(store->last_poll_status());
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, LoadAndUnloadModelControl) {
  Write("m", Pair("a", "b", 2));
  StoreOptions options;
  options.load_on_scan = false;
  options.devices = {{cpu_.get(), 0}};
  std::unique_ptr<MapperStore> store = Open(options);
  EXPECT_EQ(State(*store, "m"), MapperState::kDiscovered);
  absl::StatusOr<MapperInfo> info = store->Load("m", "host", Later());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, MapperState::kHostResident);
  info = store->Load("m", "cpu", Later());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, MapperState::kDeviceResident);
  EXPECT_EQ(info->devices, (std::vector<std::string>{"host", "cpu"}));
  EXPECT_EQ(info->page_ins, 1u);
  KVT_EXPECT_ERROR(store->Load("m", "cuda:3", Later()), StatusCode::kInvalidArgument,
                   "device='cuda:3'");
  KVT_EXPECT_ERROR(store->Load("nope", "", Later()), StatusCode::kNotFound, "'nope'");

  // Unload of a pinned mapper detaches it at once and waits for the request.
  absl::StatusOr<MapperHandle> held = store->Acquire("m");
  ASSERT_TRUE(held.ok());
  absl::Notification unloading;
  std::atomic<bool> released{false};
  std::thread releaser([&] {
    unloading.WaitForNotification();
    released = true;
    held->Release();
  });
  unloading.Notify();
  info = store->Unload("m", "", Later());
  EXPECT_TRUE(released.load());  // Unload returned once the pin was gone
  releaser.join();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state, MapperState::kDiscovered);
  EXPECT_EQ(Used(*store, "host"), 0u);
  EXPECT_EQ(Used(*store, "cpu"), 0u);

  // Bounded by the deadline: still pinned -> DEADLINE_EXCEEDED, freed when the request ends.
  held = store->Acquire("m");
  ASSERT_TRUE(held.ok());
  KVT_EXPECT_ERROR(store->Unload("m", "", Soon()), StatusCode::kDeadlineExceeded,
                   "1 in-flight request(s) still hold it");
  EXPECT_EQ(State(*store, "m"), MapperState::kDiscovered);
  EXPECT_GT(Used(*store, "host"), 0u);
  held->Release();
  EXPECT_EQ(Used(*store, "host"), 0u);
  KVT_EXPECT_ERROR(store->Unload("m", "tpu", Later()), StatusCode::kInvalidArgument,
                   "device='tpu'");
  ExpectAccountingMatches(*store);
}

TEST_F(StorePagingTest, RemovedDevicesDropTheirCopiesAndCanBeAddedAgain) {
  Write("m", Pair("a", "b", 2));
  std::unique_ptr<MapperStore> store = Open(StoreOptions());
  KVT_ASSERT_OK(store->AddDevice({cpu_.get(), 0}));
  KVT_EXPECT_ERROR(store->AddDevice({cpu_.get(), 0}), StatusCode::kAlreadyExists, "'cpu'");
  ASSERT_TRUE(store->Load("m", "cpu", Later()).ok());
  EXPECT_EQ(Used(*store, "cpu"), PreparedBytes("m"));
  {
    AcquireOptions dev;
    dev.device = "cpu";
    absl::StatusOr<MapperHandle> held = store->Acquire("m", dev);
    ASSERT_TRUE(held.ok());
    KVT_EXPECT_ERROR(store->RemoveDevice("cpu", Soon()), StatusCode::kDeadlineExceeded,
                     "still used by 1");
  }
  KVT_ASSERT_OK(store->RemoveDevice("cpu", Later()));
  EXPECT_TRUE(store->DeviceNames().empty());
  EXPECT_EQ(State(*store, "m"), MapperState::kHostResident);
  AcquireOptions any;
  any.device = "any";
  KVT_EXPECT_ERROR(store->Acquire("m", any), StatusCode::kFailedPrecondition, "no devices");
  KVT_ASSERT_OK(store->AddDevice({cpu_.get(), 0}));
  ASSERT_TRUE(store->Acquire("m", any).ok());
  ExpectAccountingMatches(*store);
}

}  // namespace
}  // namespace kvt
