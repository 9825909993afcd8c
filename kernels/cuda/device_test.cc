#include "kernels/cuda/device.h"

#include "gtest/gtest.h"

namespace kvt {
namespace cuda {
namespace {

// Runs everywhere: without a GPU (CI) the probe must report why, not crash; with one it
// counts devices and poisons a buffer.
TEST(CudaDeviceTest, ProbeNeverCrashes) {
  absl::StatusOr<int> count = DeviceCount();
  if (count.ok()) {
    EXPECT_GT(*count, 0);
  } else {
    EXPECT_FALSE(count.status().message().empty());
  }
}

TEST(CudaDeviceTest, PoisonFailsCleanlyWithoutDevice) {
  if (DeviceCount().ok()) GTEST_SKIP() << "a device is present: covered by tests/gpu";
  absl::Status status = PoisonDeviceBuffer(nullptr, 16);
  EXPECT_FALSE(status.ok());
}

}  // namespace
}  // namespace cuda
}  // namespace kvt
