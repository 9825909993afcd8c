#include "kernels/cuda/cuda_backend.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

// Without a device (CI), asking for the CUDA backend is a clear refusal that says why; with
// one, it starts and names its device.
TEST(CudaBackendStartupTest, RefusesWithReasonOrStarts) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = NewCudaBackend();
  if (cuda::DeviceCount().ok()) {
    ASSERT_TRUE(backend.ok()) << backend.status();
    EXPECT_EQ((*backend)->name(), "cuda");
    EXPECT_EQ((*backend)->device(), "cuda:0");
    return;
  }
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(backend.status().message(), HasSubstr("backend cuda"));
  if (!cuda::BuiltWithCuda()) {
    EXPECT_THAT(backend.status().message(), HasSubstr("without the CUDA toolkit"));
  } else {
    EXPECT_THAT(backend.status().message(), HasSubstr("no usable CUDA device"));
  }
}

TEST(CudaBackendStartupTest, BadDeviceIndexOrWorkspaceIsRefused) {
  CudaBackendOptions options;
  options.device = 1000;
  EXPECT_FALSE(NewCudaBackend(options).ok());
  options.device = 0;
  options.workspace_bytes = 0;
  EXPECT_FALSE(NewCudaBackend(options).ok());
}

}  // namespace
}  // namespace kvt
