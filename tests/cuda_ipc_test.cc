// CUDA IPC registration through a real kvtd process, every refusal that needs no GPU: feature
// disabled, bad handle size, zero size, no device (or no CUDA build), names shared with system
// memory, unknown names. The GPU round trip is tests/cuda_ipc_gpu_test.cc.
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device.h"
#include "mapper_store/synth.h"
#include "tests/kvtd_process.h"
#include "tests/shm_object.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<test::KvtdProcess> StartKvtd(bool allow_regions) {
  const std::string store = test::TestTmpDir() + "/cuda_ipc_store";
  std::filesystem::create_directories(store);
  const std::string config = test::TestTmpDir() + "/cuda_ipc.yaml";
  test::WriteFile(config, "shared_memory:\n  allow_client_regions: true\n");
  std::vector<std::string> flags = {"--listen_address=127.0.0.1:0", "--mapper_store=" + store,
                                    "--backend=cpu", "--drain_grace_seconds=0"};
  if (allow_regions) flags.push_back("--config=" + config);
  return std::make_unique<test::KvtdProcess>(allow_regions ? "cuda-on" : "cuda-off", flags);
}

TEST(CudaIpcTest, DisabledUnlessConfigured) {
  auto kvtd = StartKvtd(false);
  const int port = kvtd->WaitForPort();
  ASSERT_GT(port, 0);
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));
  absl::Status registered = client->RegisterCudaMemory("gpu", std::string(64, '\0'), 0, 4096);
  EXPECT_EQ(registered.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(registered.message()), HasSubstr("allow_client_regions"));
  EXPECT_EQ(client->CudaMemoryStatus().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client->UnregisterCudaMemory("").code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CudaIpcTest, BadRegistrationsGetClearErrors) {
  auto kvtd = StartKvtd(true);
  const int port = kvtd->WaitForPort();
  ASSERT_GT(port, 0);
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));

  absl::Status short_handle = client->RegisterCudaMemory("gpu", std::string(16, 'x'), 0, 4096);
  EXPECT_EQ(short_handle.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(short_handle.message(), "raw_handle has 16 bytes; a cudaIpcMemHandle_t has 64");
  EXPECT_EQ(client->RegisterCudaMemory("gpu", std::string(64, '\0'), 0, 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->RegisterCudaMemory("", std::string(64, '\0'), 0, 16).code(),
            absl::StatusCode::kInvalidArgument);

  // kvtd is built like this test: either without CUDA, or with it and (here) no device.
  absl::Status no_gpu = client->RegisterCudaMemory("gpu", std::string(64, '\0'), 0, 4096);
  if (!cuda::BuiltWithCuda()) {
    EXPECT_EQ(no_gpu.code(), absl::StatusCode::kFailedPrecondition) << no_gpu;
    EXPECT_THAT(std::string(no_gpu.message()), HasSubstr("built without CUDA"));
  } else if (!cuda::DeviceCount().ok()) {
    EXPECT_EQ(no_gpu.code(), absl::StatusCode::kUnavailable) << no_gpu;
    EXPECT_THAT(std::string(no_gpu.message()), HasSubstr("no CUDA device"));
  } else {
    EXPECT_EQ(no_gpu.code(), absl::StatusCode::kInvalidArgument) << no_gpu;  // zero handle
    EXPECT_THAT(std::string(no_gpu.message()), HasSubstr("cudaIpcOpenMemHandle"));
  }

  absl::StatusOr<v1::CudaMemoryStatusResponse> status = client->CudaMemoryStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->regions_size(), 0);
  EXPECT_EQ(client->CudaMemoryStatus("gpu").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client->UnregisterCudaMemory("gpu").code(), absl::StatusCode::kNotFound);

  // One namespace for both kinds: a system-memory name is not available to CUDA.
  test::ShmObject object(4096);
  ASSERT_TRUE(client->RegisterSystemMemory("shared-name", object.key(), 0, 4096).ok());
  absl::Status taken = client->RegisterCudaMemory("shared-name", std::string(64, '\0'), 0, 16);
  EXPECT_EQ(taken.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(taken.message()), HasSubstr("system memory region named"));
}

}  // namespace
}  // namespace kvt
