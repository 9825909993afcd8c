// Shared-memory transport end to end: kvtd runs as its own process, this test is the client
// process; caches pass through POSIX shm regions both ways and must equal the inline result
// bit for bit. Every bad-region case gets a clear error.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "mapper_store/synth.h"
#include "tests/kvtd_process.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

// demo-tiny: source 4 layers x 2 heads x 32, target 6 layers x 2 heads x 32.
constexpr int64_t kTokens = 100;
constexpr int64_t kSourceBytes = 2 * 4 * (2 * kTokens * 32) * 2;  // bf16
constexpr int64_t kTargetBytes = 2 * 6 * (2 * kTokens * 32) * 2;

class ShmObject {
 public:
  explicit ShmObject(size_t size)
      : key_(absl::StrCat("/kvt-shm-test-", getpid(), "-", std::random_device{}())), size_(size) {
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    data_ = static_cast<char*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~ShmObject() {
    munmap(data_, size_);
    shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  char* data() { return data_; }

 private:
  std::string key_;
  size_t size_;
  char* data_;
};

class ShmTransportTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    store_ = new std::string(test::TestTmpDir() + "/shm_store");
    std::filesystem::remove_all(*store_);
    std::filesystem::create_directories(*store_);
    absl::StatusOr<SynthOptions> preset = SynthPreset("demo-tiny");
    ASSERT_TRUE(preset.ok());
    preset->dtype = DType::kBF16;
    ASSERT_TRUE(WriteSynthMapper(*store_ + "/demo-tiny", *preset).ok());
    test::WriteFile(test::TestTmpDir() + "/shm.yaml", "shared_memory:\n  allow_client_regions: true\n");
  }

  static std::unique_ptr<test::KvtdProcess> StartKvtd(bool allow_shm) {
    std::vector<std::string> flags = {"--listen_address=127.0.0.1:0", "--mapper_store=" + *store_,
                                      "--backend=cpu", "--drain_grace_seconds=0"};
    if (allow_shm) flags.push_back("--config=" + test::TestTmpDir() + "/shm.yaml");
    return std::make_unique<test::KvtdProcess>(allow_shm ? "shm" : "noshm", flags);
  }

  // A source cache: in host memory for the inline path and copied into `region`.
  static HostCache Source() {
    HostCache cache;
    cache.dtype = DType::kBF16;
    cache.num_layers = 4;
    cache.num_kv_heads = 2;
    cache.head_dim = 32;
    cache.num_tokens = kTokens;
    cache.Allocate();
    std::mt19937 rng(9);
    std::normal_distribution<float> normal;
    for (int l = 0; l < 4; ++l) {
      for (int64_t i = 0; i < cache.layer_bytes() / 2; ++i) {
        StoreFromDouble(DType::kBF16, cache.k[l].data(), i, normal(rng));
        StoreFromDouble(DType::kBF16, cache.v[l].data(), i, normal(rng));
      }
    }
    return cache;
  }

  static v1::TranslateHeader RegionHeader(const std::string& in, uint64_t in_offset,
                                          uint64_t in_size, const std::string& out) {
    v1::TranslateHeader header;
    header.set_mapper_id("demo-tiny");
    header.set_dtype(v1::DTYPE_BF16);
    header.set_layout(v1::LAYOUT_HND);
    header.set_num_tokens(kTokens);
    header.set_position_offset(33);
    header.mutable_input()->mutable_region()->set_region(in);
    header.mutable_input()->mutable_region()->set_offset(in_offset);
    header.mutable_input()->mutable_region()->set_byte_size(in_size);
    header.mutable_output()->mutable_region()->set_region(out);
    header.mutable_output()->mutable_region()->set_byte_size(kTargetBytes);
    return header;
  }

  static std::string* store_;
};
std::string* ShmTransportTest::store_ = nullptr;

TEST_F(ShmTransportTest, RoundTripEqualsInlineTranslation) {
  auto kvtd = StartKvtd(true);
  const int port = kvtd->WaitForPort();
  ASSERT_GT(port, 0);
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));

  const HostCache source = Source();
  v1::TranslateHeader inline_header;
  inline_header.set_mapper_id("demo-tiny");
  inline_header.set_position_offset(33);
  absl::StatusOr<TranslateResult> inline_result = client->Translate(inline_header, source);
  ASSERT_TRUE(inline_result.ok()) << inline_result.status();

  // The input region starts 100 bytes into its object (not page aligned).
  ShmObject in_object(kSourceBytes + 100), out_object(kTargetBytes);
  for (int l = 0; l < 4; ++l) {
    std::memcpy(in_object.data() + 100 + (2 * l) * source.layer_bytes(), source.k[l].data(),
                source.layer_bytes());
    std::memcpy(in_object.data() + 100 + (2 * l + 1) * source.layer_bytes(), source.v[l].data(),
                source.layer_bytes());
  }
  std::memset(out_object.data(), 0xff, kTargetBytes);
  ASSERT_TRUE(client->RegisterSystemMemory("in", in_object.key(), 0, kSourceBytes + 100).ok());
  ASSERT_TRUE(client->RegisterSystemMemory("out", out_object.key(), 0, kTargetBytes).ok());
  absl::StatusOr<TranslateResult> shm_result =
      client->TranslateRegions(RegionHeader("in", 100, kSourceBytes, "out"));
  ASSERT_TRUE(shm_result.ok()) << shm_result.status();
  EXPECT_EQ(shm_result->trailer.output_bytes(), static_cast<uint64_t>(kTargetBytes));
  const HostCache& expected = inline_result->target;
  for (int l = 0; l < 6; ++l) {
    EXPECT_EQ(std::memcmp(out_object.data() + (2 * l) * expected.layer_bytes(),
                          expected.k[l].data(), expected.layer_bytes()),
              0)
        << "layer " << l << " K";
    EXPECT_EQ(std::memcmp(out_object.data() + (2 * l + 1) * expected.layer_bytes(),
                          expected.v[l].data(), expected.layer_bytes()),
              0)
        << "layer " << l << " V";
  }
  EXPECT_TRUE(client->UnregisterSystemMemory("").ok());
}

TEST_F(ShmTransportTest, BadRegionsGetClearErrors) {
  auto kvtd = StartKvtd(true);
  const int port = kvtd->WaitForPort();
  ASSERT_GT(port, 0);
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));
  ShmObject in_object(kSourceBytes), out_object(kTargetBytes);
  ASSERT_TRUE(client->RegisterSystemMemory("in", in_object.key(), 0, kSourceBytes).ok());
  ASSERT_TRUE(client->RegisterSystemMemory("out", out_object.key(), 0, kTargetBytes).ok());

  EXPECT_EQ(client->RegisterSystemMemory("in", in_object.key(), 0, 10).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client->RegisterSystemMemory("big", in_object.key(), 0, kSourceBytes + 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->RegisterSystemMemory("x", "/kvt-no-such-object", 0, 10).code(),
            absl::StatusCode::kNotFound);

  absl::StatusOr<TranslateResult> unknown =
      client->TranslateRegions(RegionHeader("nope", 0, kSourceBytes, "out"));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("header.input.region"));
  absl::StatusOr<TranslateResult> wrong_size =
      client->TranslateRegions(RegionHeader("in", 0, kSourceBytes - 2, "out"));
  EXPECT_EQ(wrong_size.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong_size.status().message()),
              HasSubstr("header.input.region.byte_size"));
  absl::StatusOr<TranslateResult> outside =
      client->TranslateRegions(RegionHeader("in", 8, kSourceBytes, "out"));
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("outside region 'in'"));

  // Unregister while a request holds the region: it waits for the request.
  {
    grpc::ClientContext context;
    auto stream = client->stub()->TranslateKV(&context);
    v1::TranslateKVRequest request;
    *request.mutable_header() = RegionHeader("in", 0, kSourceBytes, "out");
    ASSERT_TRUE(stream->Write(request));
    v1::TranslateKVResponse response;
    ASSERT_TRUE(stream->Read(&response));  // admitted, region leased; input not closed yet
    std::thread unregister([&client] {
      EXPECT_TRUE(client->UnregisterSystemMemory("in").ok());
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    stream->WritesDone();
    bool trailer = false;
    while (stream->Read(&response)) trailer = trailer || response.has_trailer();
    EXPECT_TRUE(stream->Finish().ok());
    EXPECT_TRUE(trailer);
    unregister.join();
  }
  absl::StatusOr<TranslateResult> gone =
      client->TranslateRegions(RegionHeader("in", 0, kSourceBytes, "out"));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);

  // Chunks are refused when the input comes from a region.
  ASSERT_TRUE(client->RegisterSystemMemory("in", in_object.key(), 0, kSourceBytes).ok());
  grpc::ClientContext context;
  auto stream = client->stub()->TranslateKV(&context);
  v1::TranslateKVRequest request;
  *request.mutable_header() = RegionHeader("in", 0, kSourceBytes, "out");
  stream->Write(request);
  v1::TranslateKVRequest chunk;
  chunk.mutable_chunk()->set_layer(0);
  chunk.mutable_chunk()->set_kind(v1::CACHE_KIND_K);
  chunk.mutable_chunk()->set_token_count(1);
  stream->Write(chunk);
  stream->WritesDone();
  v1::TranslateKVResponse response;
  while (stream->Read(&response)) {
  }
  grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("must carry no chunks"));
}

TEST_F(ShmTransportTest, DisabledUnlessConfigured) {
  auto kvtd = StartKvtd(false);
  const int port = kvtd->WaitForPort();
  ASSERT_GT(port, 0);
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));
  ShmObject object(4096);
  absl::Status registered = client->RegisterSystemMemory("in", object.key(), 0, 4096);
  EXPECT_EQ(registered.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(registered.message()), HasSubstr("allow_client_regions"));
  absl::StatusOr<TranslateResult> result =
      client->TranslateRegions(RegionHeader("in", 0, kSourceBytes, "out"));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvt
