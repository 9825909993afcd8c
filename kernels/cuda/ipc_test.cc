#include "kernels/cuda/ipc.h"

#include <string>

#include "gtest/gtest.h"
#include "kernels/cuda/device.h"

namespace kvt {
namespace cuda {
namespace {

TEST(IpcTest, RefusalsNeedingNoGpu) {
  const bool have_device = BuiltWithCuda() && DeviceCount().ok();
  absl::StatusOr<IpcMapping> short_handle = OpenIpcHandle(std::string(10, 'x'), 0, 4096);
  if (!BuiltWithCuda()) {
    EXPECT_EQ(short_handle.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(short_handle.status().message().find("built without CUDA"), std::string::npos);
    return;
  }
  EXPECT_EQ(short_handle.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(short_handle.status().message(),
            "raw_handle has 10 bytes; a cudaIpcMemHandle_t has 64");
  EXPECT_EQ(OpenIpcHandle(std::string(64, '\0'), 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<IpcMapping> zeros = OpenIpcHandle(std::string(64, '\0'), 0, 4096);
  if (!have_device) {
    EXPECT_EQ(zeros.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(zeros.status().message().find("no CUDA device"), std::string::npos)
        << zeros.status();
    EXPECT_EQ(AllocateDevice(0, 16).status().code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(ExportIpcHandle(0, nullptr).status().code(), absl::StatusCode::kUnavailable);
    return;
  }
  // A GPU: an all-zero handle is no allocation, and device ids are range-checked.
  EXPECT_EQ(zeros.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenIpcHandle(std::string(64, '\0'), 1 << 20, 4096).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cuda
}  // namespace kvt
