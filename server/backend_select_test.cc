#include "server/backend_select.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

KvtdConfig::Backend WithType(const char* type) {
  KvtdConfig::Backend config;
  config.type = type;
  config.cpu_threads = 1;
  return config;
}

TEST(BackendSelectTest, CpuIsCpu) {
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("cpu"));
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(selected->backend->name(), "cpu");
  EXPECT_EQ(selected->reason, "backend.type=cpu");
  EXPECT_THAT(selected->cpu_gemm_path, ::testing::AnyOf("onednn_bf16", "sgemm"));
  EXPECT_FALSE(selected->cpu_isa.empty());
}

// backend.cpu_gemm reaches the CPU backend: fp32 forces sgemm, bf16 forces oneDNN (where
// oneDNN has a bf16 matmul at all), anything else is refused.
TEST(BackendSelectTest, CpuGemmIsPassedOn) {
  KvtdConfig::Backend config = WithType("cpu");
  config.cpu_gemm = "fp32";
  absl::StatusOr<SelectedBackend> selected = SelectBackend(config);
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(selected->cpu_gemm_path, "sgemm");
  EXPECT_THAT(selected->backend->description(), HasSubstr("sgemm"));
  config.cpu_gemm = "bf16";
  selected = SelectBackend(config);
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_THAT(selected->cpu_gemm_reason, HasSubstr(selected->cpu_isa));
  if (selected->cpu_gemm_path == "onednn_bf16") {
    EXPECT_THAT(selected->backend->description(), HasSubstr("oneDNN"));
  } else {
    EXPECT_THAT(selected->cpu_gemm_reason, HasSubstr("has no bf16 matmul"));
  }
  config.cpu_gemm = "fp16";
  EXPECT_EQ(SelectBackend(config).status().code(), absl::StatusCode::kInvalidArgument);
}

// auto picks CUDA exactly when a device is usable; the reason says what was found.
TEST(BackendSelectTest, AutoFollowsTheDevice) {
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("auto"));
  ASSERT_TRUE(selected.ok()) << selected.status();
  if (cuda::DeviceCount().ok()) {
    EXPECT_EQ(selected->backend->name(), "cuda");
    EXPECT_EQ(selected->backend->device(), "cuda:0");
    EXPECT_THAT(selected->reason, HasSubstr("using cuda:0"));
  } else {
    EXPECT_EQ(selected->backend->name(), "cpu");
    EXPECT_THAT(selected->reason, HasSubstr("auto: no usable CUDA device"));
    EXPECT_THAT(selected->reason, HasSubstr("using CPU"));
  }
}

// cuda forced without a device is a startup error that says why, never a CPU fallback.
TEST(BackendSelectTest, ForcedCudaWithoutDeviceIsAnError) {
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("cuda"));
  if (cuda::DeviceCount().ok()) {
    ASSERT_TRUE(selected.ok()) << selected.status();
    EXPECT_EQ(selected->backend->name(), "cuda");
    return;
  }
  ASSERT_FALSE(selected.ok());
  EXPECT_EQ(selected.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(selected.status().message(), HasSubstr("backend.type=cuda"));
  EXPECT_THAT(selected.status().message(), HasSubstr("use backend.type=auto or cpu"));
}

TEST(BackendSelectTest, UnknownTypeNamesTheField) {
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("tpu"));
  ASSERT_FALSE(selected.ok());
  EXPECT_EQ(selected.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(selected.status().message(), HasSubstr("backend.type='tpu'"));
}

}  // namespace
}  // namespace kvt
