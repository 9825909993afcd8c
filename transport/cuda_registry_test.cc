#include "transport/cuda_registry.h"

#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device.h"

namespace kvt {
namespace {

TEST(CudaMemoryRegistryTest, BadRegistrationsAreRefusedWithoutAGpu) {
  CudaMemoryRegistry registry;
  EXPECT_EQ(registry.Register("", std::string(64, '\0'), 0, 16).code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status short_handle = registry.Register("r", std::string(63, '\0'), 0, 16);
  EXPECT_EQ(short_handle.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(short_handle.message(), "raw_handle has 63 bytes; a cudaIpcMemHandle_t has 64");
  EXPECT_EQ(registry.Register("r", std::string(64, '\0'), 0, 0).code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status no_device = registry.Register("r", std::string(64, '\0'), 0, 16);
  if (!cuda::BuiltWithCuda()) {
    EXPECT_EQ(no_device.code(), absl::StatusCode::kFailedPrecondition) << no_device;
  } else if (!cuda::DeviceCount().ok()) {
    EXPECT_EQ(no_device.code(), absl::StatusCode::kUnavailable) << no_device;
    EXPECT_NE(no_device.message().find("no CUDA device"), std::string::npos);
  } else {
    EXPECT_EQ(no_device.code(), absl::StatusCode::kInvalidArgument) << no_device;  // zero handle
  }
  EXPECT_FALSE(registry.Contains("r"));
  EXPECT_EQ(registry.Acquire("r", 0, 16, "header.input.region").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.Unregister("r", absl::Now()).code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::vector<CudaMemoryRegistry::RegionInfo>> all = registry.Status("");
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(all->empty());
}

}  // namespace
}  // namespace kvt
