// Many requests pinning, paging in and releasing mappers under tight host and device budgets
// while another thread rewrites, rescans and unloads them. Checks that a held version never
// changes under its holder, that budgets hold and that every byte accounted is freed; run
// under TSan (--config=tsan) and ASan for races and use-after-free.
#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

constexpr int kMappers = 4;

SynthOptions Options(int index, uint64_t seed) {
  SynthOptions o;
  o.source = NeoxModelSpec(absl::StrCat("src", index), 3, 2, 8);
  o.target = NeoxModelSpec(absl::StrCat("tgt", index), 2, 2, 8);
  o.k = 2;
  o.dtype = DType::kBF16;
  o.seed = seed;
  return o;
}

uint64_t Fingerprint(const LoadedMapper& mapper) {
  uint64_t sum = 0;
  for (const LayerMapView& layer : mapper.view().layers) {
    const auto* bytes = static_cast<const uint8_t*>(layer.w_k.data);
    for (int i = 0; i < 256; ++i) sum = sum * 131 + bytes[i];
  }
  return sum;
}

TEST(StoreStressTest, ConcurrentPinEvictPageInReloadAndUnload) {
  const std::string root = testing::MakeTempDir("stress");
  for (int m = 0; m < kMappers; ++m) {
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root, absl::StrCat("m", m)), Options(m, m)));
  }
  absl::StatusOr<std::unique_ptr<LoadedMapper>> probe = LoadMapperDir(JoinPath(root, "m0"));
  ASSERT_TRUE(probe.ok());
  const uint64_t host_bytes = (*probe)->weight_bytes();
  std::unique_ptr<Backend> cpu = NewCpuBackend(CpuBackendOptions{1, 64});
  const uint64_t device_bytes = cpu->Prepare((*probe)->view()).value()->bytes();

  StoreOptions options;
  options.host_budget_bytes = 5 * host_bytes / 2;  // 2 of 4 mappers
  options.devices = {{cpu.get(), 3 * device_bytes / 2}};  // 1 copy
  std::atomic<int> events{0};
  options.events.eviction = [&](const LoadedMapper& m, const std::string&) {
    if (!m.id().empty()) ++events;
  };
  absl::StatusOr<std::unique_ptr<MapperStore>> opened = MapperStore::Open(root, options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  MapperStore& store = **opened;

  std::atomic<bool> stop{false};
  std::atomic<int> served{0}, on_device{0}, refused{0}, changed_under_holder{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (!stop.load()) {
        const std::string id = absl::StrCat("m", rng() % kMappers);
        AcquireOptions acquire;
        acquire.deadline = absl::Now() + absl::Milliseconds(rng() % 30);
        acquire.device = rng() % 2 ? "any" : "";
        absl::StatusOr<MapperHandle> handle = store.Acquire(id, acquire);
        if (!handle.ok()) {
          const absl::StatusCode code = handle.status().code();
          // Budgets held by pinned mappers, a reload or unload racing, a rewrite mid-flight.
          EXPECT_TRUE(code == absl::StatusCode::kResourceExhausted ||
                      code == absl::StatusCode::kDeadlineExceeded ||
                      code == absl::StatusCode::kFailedPrecondition ||
                      code == absl::StatusCode::kNotFound)
              << handle.status();
          ++refused;
          continue;
        }
        const uint64_t before = Fingerprint(handle->mapper());
        if (handle->prepared() != nullptr) {
          if (handle->WaitLayerReady(1, absl::Now() + absl::Seconds(10)).ok()) ++on_device;
        }
        std::this_thread::yield();
        if (Fingerprint(handle->mapper()) != before) ++changed_under_holder;
        ++served;
      }
    });
  }
  threads.emplace_back([&] {
    std::mt19937 rng(99);
    uint64_t seed = 100;
    while (!stop.load()) {
      const int m = rng() % kMappers;
      const std::string id = absl::StrCat("m", m);
      switch (rng() % 4) {
        case 0: {
          WriteOptions overwrite;
          overwrite.overwrite = true;
          EXPECT_TRUE(WriteSynthMapper(JoinPath(root, id), Options(m, ++seed), overwrite).ok());
          break;
        }
        case 1:
          store.Unload(id, rng() % 2 ? "" : "cpu", absl::Now() + absl::Milliseconds(5))
              .IgnoreError();
          break;
        case 2:
          store.Load(id, "any", absl::Now() + absl::Milliseconds(20)).IgnoreError();
          break;
        default:
          break;
      }
      EXPECT_TRUE(store.Scan().ok());
      store.List();
      store.Usage();
    }
  });
  absl::SleepFor(absl::Seconds(3));
  stop = true;
  for (std::thread& t : threads) t.join();

  EXPECT_GT(served.load(), 0);
  EXPECT_GT(on_device.load(), 0);
  EXPECT_EQ(changed_under_holder.load(), 0);
  // Nothing held: every tier's accounting equals what is listed resident, within budget.
  std::map<std::string, uint64_t> listed;
  for (const MapperInfo& info : store.List()) {
    for (const Placement& p : info.placements) {
      listed[p.device] += p.bytes;
      EXPECT_EQ(p.pins, 0) << info.id << " on " << p.device;
    }
  }
  for (const TierUsage& tier : store.Usage()) {
    EXPECT_EQ(tier.used_bytes, listed[tier.place]) << tier.place;
    EXPECT_EQ(tier.reserved_bytes, 0u) << tier.place;
    EXPECT_EQ(tier.pins, 0) << tier.place;
    EXPECT_LE(tier.used_bytes, tier.budget_bytes) << tier.place;
  }
  // Unloading everything brings every tier to zero: nothing leaked in the accounting.
  for (int m = 0; m < kMappers; ++m) {
    EXPECT_TRUE(store.Unload(absl::StrCat("m", m), "", absl::Now() + absl::Seconds(5)).ok());
  }
  for (const TierUsage& tier : store.Usage()) EXPECT_EQ(tier.used_bytes, 0u) << tier.place;
  std::cerr << "served " << served.load() << " (" << on_device.load() << " on the device), "
            << refused.load() << " refused, " << events.load() << " evictions\n";
}

}  // namespace
}  // namespace kvt
