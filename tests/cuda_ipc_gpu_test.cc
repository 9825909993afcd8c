// CUDA IPC end to end on a GPU machine (manual, run by tests/gpu/run.sh): this process is the
// client, kvtd a separate process. The source cache goes into a cudaMalloc'd buffer exported
// with cudaIpcGetMemHandle from inside a larger allocation (offsets from its base), kvtd opens
// the handle, translates and writes the result into a second exported buffer; it must equal the
// inline translation bit for bit. Sizes beyond the real allocation and wrong device ids are
// refused.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/testing/test_seed.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ipc.h"
#include "kernels/dtype.h"
#include "mapper_store/synth.h"
#include "tests/kvtd_process.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

// demo-tiny: source 4 layers x 2 heads x 32, target 6 layers x 2 heads x 32; bf16 caches.
constexpr int64_t kTokens = 300;
constexpr int64_t kSourceBytes = 2 * 4 * (2 * kTokens * 32) * 2;
constexpr int64_t kTargetBytes = 2 * 6 * (2 * kTokens * 32) * 2;

// A device buffer of this process, exported for kvtd: `bytes` at `offset` inside an allocation
// `slack` bytes larger on each side, as a caching allocator hands out a tensor, so the handle's
// allocation base is not the buffer (RegionRef offsets count from the base).
struct DeviceBuffer {
  DeviceBuffer(size_t bytes, size_t slack) : bytes(bytes) {
    absl::StatusOr<void*> allocated = cuda::AllocateDevice(0, bytes + 2 * slack);
    EXPECT_TRUE(allocated.ok()) << allocated.status();
    if (!allocated.ok()) return;
    base = *allocated;
    ptr = static_cast<char*>(base) + slack;
    absl::StatusOr<cuda::IpcExport> exported = cuda::ExportIpcHandle(0, ptr);
    EXPECT_TRUE(exported.ok()) << exported.status();
    if (!exported.ok()) return;
    EXPECT_EQ(exported->offset, slack);
    EXPECT_GE(exported->allocation_bytes, bytes + 2 * slack);
    handle = exported->handle;
    offset = exported->offset;
    allocation_bytes = exported->allocation_bytes;
  }
  ~DeviceBuffer() { cuda::FreeDevice(0, base); }
  void* base = nullptr;
  void* ptr = nullptr;
  size_t bytes;
  std::string handle;
  uint64_t offset = 0;
  uint64_t allocation_bytes = 0;
};

TEST(CudaIpcGpuTest, RoundTripThroughExportedHandlesEqualsInline) {
  absl::StatusOr<int> devices = cuda::DeviceCount();
  ASSERT_TRUE(devices.ok()) << "this test needs a GPU: " << devices.status();

  const std::string store = test::TestTmpDir() + "/cuda_gpu_store";
  std::filesystem::remove_all(store);
  std::filesystem::create_directories(store);
  absl::StatusOr<SynthOptions> preset = SynthPreset("demo-tiny");
  ASSERT_TRUE(preset.ok());
  preset->dtype = DType::kBF16;
  ASSERT_TRUE(WriteSynthMapper(store + "/demo-tiny", *preset).ok());
  const std::string config = test::TestTmpDir() + "/cuda_gpu.yaml";
  test::WriteFile(config, "shared_memory:\n  allow_client_regions: true\n");
  test::KvtdProcess kvtd("cuda-gpu", {"--listen_address=127.0.0.1:0", "--mapper_store=" + store,
                                      "--backend=cpu", "--drain_grace_seconds=0",
                                      "--config=" + config});
  const int port = kvtd.WaitForPort();
  ASSERT_GT(port, 0);
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));

  HostCache source;
  source.dtype = DType::kBF16;
  source.num_layers = 4;
  source.num_kv_heads = 2;
  source.head_dim = 32;
  source.num_tokens = kTokens;
  source.Allocate();
  std::mt19937 rng(testing::FreshSeed("cuda ipc source"));
  std::normal_distribution<float> normal;
  std::vector<char> packed(kSourceBytes);
  for (int l = 0; l < 4; ++l) {
    for (int64_t i = 0; i < source.layer_bytes() / 2; ++i) {
      StoreFromDouble(DType::kBF16, source.k[l].data(), i, normal(rng));
      StoreFromDouble(DType::kBF16, source.v[l].data(), i, normal(rng));
    }
    std::memcpy(packed.data() + 2 * l * source.layer_bytes(), source.k[l].data(),
                source.layer_bytes());
    std::memcpy(packed.data() + (2 * l + 1) * source.layer_bytes(), source.v[l].data(),
                source.layer_bytes());
  }
  v1::TranslateHeader inline_header;
  inline_header.set_mapper_id("demo-tiny");
  inline_header.set_position_offset(7);
  absl::StatusOr<TranslateResult> inline_result = client->Translate(inline_header, source);
  ASSERT_TRUE(inline_result.ok()) << inline_result.status();

  // The input inside a larger allocation, the output at its base and exactly its size.
  DeviceBuffer in(kSourceBytes, 4096), out(kTargetBytes, 0);
  ASSERT_TRUE(cuda::CopyToDevice(0, packed.data(), in.ptr, kSourceBytes).ok());
  ASSERT_TRUE(cuda::PoisonDeviceBuffer(out.ptr, kTargetBytes).ok());
  ASSERT_TRUE(client->RegisterCudaMemory("gpu-in", in.handle, 0, in.allocation_bytes).ok());
  ASSERT_TRUE(client->RegisterCudaMemory("gpu-out", out.handle, 0, kTargetBytes).ok());

  // Beyond the real allocation, and a device kvtd does not have.
  absl::Status too_big = client->RegisterCudaMemory("big", out.handle, 0, kTargetBytes + 512);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument) << too_big;
  EXPECT_THAT(std::string(too_big.message()), HasSubstr("cuMemGetAddressRange"));
  absl::Status bad_device = client->RegisterCudaMemory("dev", out.handle, *devices, 16);
  EXPECT_EQ(bad_device.code(), absl::StatusCode::kInvalidArgument) << bad_device;
  EXPECT_THAT(std::string(bad_device.message()), HasSubstr("device_id="));

  v1::TranslateHeader header;
  header.set_mapper_id("demo-tiny");
  header.set_dtype(v1::DTYPE_BF16);
  header.set_layout(v1::LAYOUT_HND);
  header.set_num_tokens(kTokens);
  header.set_position_offset(7);
  header.mutable_input()->mutable_region()->set_region("gpu-in");
  header.mutable_input()->mutable_region()->set_offset(in.offset);
  header.mutable_input()->mutable_region()->set_byte_size(kSourceBytes);
  header.mutable_output()->mutable_region()->set_region("gpu-out");
  header.mutable_output()->mutable_region()->set_byte_size(kTargetBytes);
  absl::StatusOr<TranslateResult> result = client->TranslateRegions(header);
  ASSERT_TRUE(result.ok()) << result.status();

  std::vector<char> back(kTargetBytes);
  ASSERT_TRUE(cuda::CopyToHost(0, out.ptr, back.data(), kTargetBytes).ok());
  const HostCache& expected = inline_result->target;
  for (int l = 0; l < 6; ++l) {
    EXPECT_EQ(std::memcmp(back.data() + 2 * l * expected.layer_bytes(), expected.k[l].data(),
                          expected.layer_bytes()),
              0)
        << "layer " << l << " K";
    EXPECT_EQ(std::memcmp(back.data() + (2 * l + 1) * expected.layer_bytes(),
                          expected.v[l].data(), expected.layer_bytes()),
              0)
        << "layer " << l << " V";
  }
  absl::StatusOr<v1::CudaMemoryStatusResponse> status = client->CudaMemoryStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->regions_size(), 2);
  EXPECT_TRUE(client->UnregisterCudaMemory("").ok());
  EXPECT_EQ(client->TranslateRegions(header).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvt
