#include "server/mapper_store_setup.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "server/config.h"

namespace kvt {
namespace {

// A GPU-like backend: device memory and call workspaces reported, nothing translated.
class DeviceLikeBackend : public Backend {
 public:
  DeviceLikeBackend(uint64_t memory, uint64_t reserved) : memory_(memory), reserved_(reserved) {}
  std::string name() const override { return "gpu-like"; }
  std::string device() const override { return "gpu-like:0"; }
  absl::StatusOr<std::shared_ptr<PreparedMapper>> Prepare(const MapperView&) override {
    return absl::UnimplementedError("not here");
  }
  absl::Status TranslateLayer(const PreparedMapper&, int, const CacheView&, const Positions&,
                              const TranslateOptions&, MutableCacheView*) override {
    return absl::UnimplementedError("not here");
  }
  uint64_t DeviceMemoryBytes() const override { return memory_; }
  uint64_t ReservedDeviceBytes() const override { return reserved_; }

 private:
  uint64_t memory_, reserved_;
};

constexpr uint64_t kGiB = uint64_t{1} << 30;

// The call workspaces a GPU backend may hold come out of the automatic budget, so prepared
// mappers and workspaces together stay within 90% of the device.
TEST(DeviceBudgetTest, AutomaticBudgetLeavesTheWorkspacesFree) {
  KvtdConfig config;
  EXPECT_EQ(DeviceBudgetBytes(config, DeviceLikeBackend(100 * kGiB, 0)), 90 * kGiB);
  EXPECT_EQ(DeviceBudgetBytes(config, DeviceLikeBackend(100 * kGiB, 8 * kGiB)), 82 * kGiB);
  // Workspaces larger than the device's 90%: a tenth is left to the store, not 0 (unlimited).
  EXPECT_EQ(DeviceBudgetBytes(config, DeviceLikeBackend(10 * kGiB, 20 * kGiB)), 1 * kGiB);
}

TEST(DeviceBudgetTest, ConfiguredBudgetIsTheOperators) {
  KvtdConfig config;
  config.mapper_store.device_budget_bytes = 5 * kGiB;
  EXPECT_EQ(DeviceBudgetBytes(config, DeviceLikeBackend(100 * kGiB, 8 * kGiB)), 5 * kGiB);
}

}  // namespace
}  // namespace kvt
