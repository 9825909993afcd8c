// What a hostile or broken client can send, against a real kvtd on port 0: paged geometries
// whose byte size wraps an int64 (input region, Publish region, output region), block counts
// that would size allocations, narrowing wire integers, a shm object truncated under its
// registration, a lease used for another mapper than the one the gate passed, NaN / Inf
// caches, out-of-range enums, 100 KB echoed names, and an unregister that times out. Each gets
// its canonical code and a message naming the field, and kvtd translates correctly after.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "mapper_store/synth.h"
#include "proto/kvt/v1/prefix_cache.grpc.pb.h"
#include "proto/kvt/v1/service.grpc.pb.h"
#include "tests/in_process_kvtd.h"
#include "tests/shm_object.h"
#include "transport/kv_chunks.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Source 3 layers x 2 heads x 32 (fp32): 1536 x num_blocks x block_size bytes paged, and the
// same for the first target (4 x 3 x 16).
constexpr int kLayers = 3, kHeads = 2, kDim = 32;
constexpr int64_t kTokens = 32;
constexpr int64_t kSourceBytes = 2 * kLayers * kHeads * kTokens * kDim * 4;
constexpr int64_t kTargetBytes = 2 * 4 * 3 * kTokens * 16 * 4;
// 1536 * 245532353 * 48912491 = 2^64 + 512: an int64 size computation wraps to 512 bytes, which
// the region then declares, and the V half sits 2^63 bytes away.
constexpr uint32_t kWrapBlocks = 245532353, kWrapBlockSize = 48912491;
constexpr uint64_t kWrapBytes = 512;

std::string StoreDir() {
  static const std::string* dir = [] {
    const char* root = std::getenv("TEST_TMPDIR");
    auto* path = new std::string(absl::StrCat(root ? root : "/tmp", "/hardening_store"));
    SynthOptions options;
    options.source = NeoxModelSpec("test/src", kLayers, kHeads, kDim, 10000);
    options.target = NeoxModelSpec("test/dst", 4, 3, 16, 500000);
    options.k = 2;
    options.dtype = DType::kFP32;
    options.seed = 5;
    EXPECT_TRUE(WriteSynthMapper(*path + "/m", options).ok());
    options.target = NeoxModelSpec("test/other", 2, 2, 16, 500000);
    options.seed = 6;
    EXPECT_TRUE(WriteSynthMapper(*path + "/m2", options).ok());
    return path;
  }();
  return *dir;
}

HostCache Source(int64_t tokens, uint32_t seed, Layout layout = Layout::kNHD) {
  HostCache cache =
      HostCache::Zeros(DType::kFP32, layout, kLayers, kHeads, kDim, tokens);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (int l = 0; l < cache.num_layers; ++l) {
    for (std::vector<char>* buffer : {&cache.k[l], &cache.v[l]}) {
      float* x = reinterpret_cast<float*>(buffer->data());
      for (size_t i = 0; i < buffer->size() / sizeof(float); ++i) x[i] = normal(rng);
    }
  }
  return cache;
}

std::vector<uint32_t> Tokens(int n) {
  std::vector<uint32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = static_cast<uint32_t>(i * 7 % 251);
  return tokens;
}

int64_t RssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

class HardeningTest : public ::testing::Test {
 protected:
  void Start(KvtdConfig config) {
    config.shared_memory.allow_client_regions = true;
    config.prefix_cache.enabled = true;
    config.prefix_cache.min_benefit_recovered = 0;  // records no benefit; not under test
    config.prefix_cache.block_tokens = 16;
    kvtd_ = StartKvtdForTest(StoreDir(), config);
    ASSERT_NE(kvtd_, nullptr);
    auto channel = grpc::CreateChannel(kvtd_->address(), grpc::InsecureChannelCredentials());
    prefix_ = v1::KvPrefixCache::NewStub(channel);
    translator_ = v1::KvTranslator::NewStub(channel);
  }
  void SetUp() override { Start(KvtdConfig()); }

  Client& client() { return kvtd_->client(); }

  // kvtd is alive and still translates: an inline translation of fresh data succeeds.
  void ExpectHealthy() {
    v1::TranslateHeader header;
    header.set_mapper_id("m");
    absl::StatusOr<TranslateResult> result = client().Translate(header, Source(kTokens, 99));
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->target.num_layers, 4);
  }

  v1::TranslateHeader RegionHeader(const std::string& in, uint64_t in_bytes,
                                   const std::string& out, uint64_t out_bytes) {
    v1::TranslateHeader header;
    header.set_mapper_id("m");
    header.set_dtype(v1::DTYPE_FP32);
    header.set_layout(v1::LAYOUT_NHD);
    header.set_num_tokens(kTokens);
    header.mutable_input()->mutable_region()->set_region(in);
    header.mutable_input()->mutable_region()->set_byte_size(in_bytes);
    header.mutable_output()->mutable_region()->set_region(out);
    header.mutable_output()->mutable_region()->set_byte_size(out_bytes);
    return header;
  }

  static void SetPaged(v1::RegionRef* ref, uint32_t blocks, uint32_t block_size) {
    ref->mutable_paged()->set_num_blocks(blocks);
    ref->mutable_paged()->set_block_size(block_size);
    ref->mutable_paged()->add_block_table(0);
  }

  grpc::Status PublishHeaderOnly(const v1::PublishHeader& header) {
    grpc::ClientContext context;
    v1::PublishResponse response;
    auto stream = prefix_->Publish(&context, &response);
    v1::PublishRequest request;
    *request.mutable_header() = header;
    stream->Write(request);
    stream->WritesDone();
    return stream->Finish();
  }

  static v1::PublishHeader PublishHeader(const std::string& model, int64_t tokens) {
    v1::PublishHeader header;
    header.set_model(model);
    for (uint32_t t : Tokens(static_cast<int>(tokens))) header.add_token_ids(t);
    header.set_dtype(v1::DTYPE_FP32);
    header.set_layout(v1::LAYOUT_NHD);
    header.mutable_shape()->set_num_layers(kLayers);
    header.mutable_shape()->set_num_kv_heads(kHeads);
    header.mutable_shape()->set_head_dim(kDim);
    return header;
  }

  // Publishes `cache` inline (one chunk per layer and kind).
  grpc::Status Publish(const HostCache& cache) {
    grpc::ClientContext context;
    v1::PublishResponse response;
    auto stream = prefix_->Publish(&context, &response);
    v1::PublishRequest request;
    *request.mutable_header() = PublishHeader("test/src", cache.num_tokens);
    stream->Write(request);
    for (int l = 0; l < cache.num_layers; ++l) {
      for (int kind = 0; kind < 2; ++kind) {
        v1::KVChunk* chunk = request.mutable_chunk();
        chunk->set_layer(l);
        chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
        chunk->set_token_start(0);
        chunk->set_token_count(static_cast<uint32_t>(cache.num_tokens));
        const std::vector<char>& data = (kind == 0 ? cache.k : cache.v)[l];
        chunk->set_data(data.data(), data.size());
        stream->Write(request);
      }
    }
    stream->WritesDone();
    return stream->Finish();
  }

  v1::LookupPrefixResponse Lookup(const std::string& target, v1::ReusePolicy policy,
                                  grpc::Status* status) {
    grpc::ClientContext context;
    v1::LookupPrefixRequest request;
    request.set_target_model(target);
    for (uint32_t t : Tokens(kTokens)) request.add_token_ids(t);
    request.set_policy(policy);
    v1::LookupPrefixResponse response;
    *status = prefix_->LookupPrefix(&context, request, &response);
    return response;
  }

  std::unique_ptr<InProcessKvtd> kvtd_;
  std::unique_ptr<v1::KvPrefixCache::Stub> prefix_;
  std::unique_ptr<v1::KvTranslator::Stub> translator_;
};

// The three geometries that used to crash kvtd (SIGSEGV) are refused, naming the field.
TEST_F(HardeningTest, PagedGeometryWrappingTheRegionSizeIsRefusedEverywhere) {
  test::ShmObject in(kSourceBytes), out(kTargetBytes);
  ASSERT_TRUE(client().RegisterSystemMemory("in", in.key(), 0, kSourceBytes).ok());
  ASSERT_TRUE(client().RegisterSystemMemory("out", out.key(), 0, kTargetBytes).ok());

  v1::TranslateHeader paged_in = RegionHeader("in", kWrapBytes, "out", kTargetBytes);
  SetPaged(paged_in.mutable_input()->mutable_region(), kWrapBlocks, kWrapBlockSize);
  absl::Status input = client().TranslateRegions(paged_in).status();
  EXPECT_EQ(input.code(), absl::StatusCode::kInvalidArgument) << input;
  EXPECT_THAT(std::string(input.message()),
              HasSubstr("header.input.region.byte_size=512 but the paged cache is over 2^63"));

  v1::TranslateHeader paged_out = RegionHeader("in", kSourceBytes, "out", kWrapBytes);
  SetPaged(paged_out.mutable_output()->mutable_region(), kWrapBlocks, kWrapBlockSize);
  const int64_t rss = RssBytes();
  absl::Status output = client().TranslateRegions(paged_out).status();
  EXPECT_EQ(output.code(), absl::StatusCode::kInvalidArgument) << output;
  EXPECT_THAT(std::string(output.message()),
              HasSubstr("header.output.region.byte_size=512 but the paged cache is over 2^63"));
  EXPECT_LT(RssBytes() - rss, int64_t{64} << 20);  // nothing sized by the geometry

  v1::PublishHeader publish = PublishHeader("test/src", kTokens);
  publish.mutable_input()->mutable_region()->set_region("in");
  publish.mutable_input()->mutable_region()->set_byte_size(kWrapBytes);
  SetPaged(publish.mutable_input()->mutable_region(), kWrapBlocks, kWrapBlockSize);
  grpc::Status published = PublishHeaderOnly(publish);
  EXPECT_EQ(published.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(published.error_message(),
              HasSubstr("header.input.region.byte_size=512 but the paged cache is over 2^63"));

  // The engine order shares the bounds check: strides whose extent overflows are refused too.
  v1::TranslateHeader engine = RegionHeader("in", kSourceBytes, "out", kTargetBytes);
  v1::RegionRef* ref = engine.mutable_input()->mutable_region();
  SetPaged(ref, 4, 16);
  v1::EngineBlockOrder* order = ref->mutable_paged()->mutable_engine_order();
  for (int l = 0; l < kLayers; ++l) order->add_layer_offsets(std::numeric_limits<uint64_t>::max());
  order->set_block_stride(uint64_t{1} << 62);
  absl::Status engine_status = client().TranslateRegions(engine).status();
  EXPECT_EQ(engine_status.code(), absl::StatusCode::kInvalidArgument) << engine_status;
  EXPECT_THAT(std::string(engine_status.message()), HasSubstr("header.input.region.paged"));
  ExpectHealthy();
}

// num_blocks = 2^32 - 1 with a one-entry table: refused before anything is sized by it.
TEST_F(HardeningTest, DeclaredBlockCountsAllocateNothing) {
  test::ShmObject in(kSourceBytes), out(kTargetBytes);
  ASSERT_TRUE(client().RegisterSystemMemory("in", in.key(), 0, kSourceBytes).ok());
  ASSERT_TRUE(client().RegisterSystemMemory("out", out.key(), 0, kTargetBytes).ok());
  for (const uint32_t blocks : {4294967295u, 1u << 26}) {
    v1::TranslateHeader header = RegionHeader("in", kSourceBytes, "out", kTargetBytes);
    SetPaged(header.mutable_output()->mutable_region(), blocks, 16);
    header.mutable_output()->mutable_region()->mutable_paged()->add_block_table(1);
    const int64_t rss = RssBytes();
    absl::Status status = client().TranslateRegions(header).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("header.output.region.byte_size="));
    EXPECT_LT(RssBytes() - rss, int64_t{64} << 20) << blocks << " blocks";
  }
  ExpectHealthy();
}

// 4294967293 must not become -3 (a multiple of the 3 target heads) before it is checked.
TEST_F(HardeningTest, ValidateKVChecksQueryHeadsBeforeNarrowing) {
  grpc::ClientContext context;
  v1::ValidateKVResponse response;
  auto stream = translator_->ValidateKV(&context, &response);
  v1::ValidateKVRequest request;
  v1::ValidateHeader* header = request.mutable_header();
  header->set_mapper_id("m");
  header->set_dtype(v1::DTYPE_FP32);
  header->set_layout(v1::LAYOUT_NHD);
  header->set_num_tokens(kTokens);
  header->set_num_query_heads(4294967293u);
  stream->Write(request);
  stream->WritesDone();
  grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("header.num_query_heads=4294967293"));
  ExpectHealthy();
}

// A client truncates its registered object: the next request that reads it fails by name
// (it used to kill kvtd with SIGBUS).
TEST_F(HardeningTest, TruncatedRegionIsANamedError) {
  test::ShmObject in(kSourceBytes), out(kTargetBytes);
  ASSERT_TRUE(client().RegisterSystemMemory("in", in.key(), 0, kSourceBytes).ok());
  ASSERT_TRUE(client().RegisterSystemMemory("out", out.key(), 0, kTargetBytes).ok());
  const int fd = shm_open(in.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  absl::Status status =
      client().TranslateRegions(RegionHeader("in", kSourceBytes, "out", kTargetBytes)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("header.input.region: region 'in' no longer holds the client's bytes"));
  ExpectHealthy();
}

// A lease from a lookup into test/dst (gate passed for mapper m) cannot be spent on mapper m2
// into test/other, whose pair the gate refuses.
TEST_F(HardeningTest, LeaseIsBoundToTheMapperTheGateChecked) {
  KvtdConfig config;
  config.prefix_cache.pair_min_quality["test/src->test/other"] = 0.9;  // synth records none
  kvtd_.reset();
  Start(config);
  ASSERT_TRUE(Publish(Source(kTokens, 3)).ok());
  grpc::Status status;
  v1::LookupPrefixResponse refused = Lookup("test/other", v1::REUSE_POLICY_AUTO, &status);
  ASSERT_TRUE(status.ok());
  EXPECT_FALSE(refused.hit());
  v1::LookupPrefixResponse hit = Lookup("test/dst", v1::REUSE_POLICY_AUTO, &status);
  ASSERT_TRUE(hit.hit()) << hit.detail();
  ASSERT_EQ(hit.mapper_id(), "m");
  v1::TranslateHeader header;
  header.set_mapper_id("m2");
  header.set_dtype(hit.dtype());
  header.set_layout(hit.layout());
  header.set_num_tokens(hit.matched_tokens());
  header.mutable_input()->mutable_cached()->set_lease_id(hit.lease_id());
  absl::Status misuse = client().TranslateCached(header).status();
  EXPECT_EQ(misuse.code(), absl::StatusCode::kInvalidArgument) << misuse;
  EXPECT_THAT(std::string(misuse.message()),
              HasSubstr("header.target_model: the lease was issued for target 'test/dst'"));
  // Used as issued, a lease works.
  hit = Lookup("test/dst", v1::REUSE_POLICY_AUTO, &status);
  header.set_mapper_id("m");
  header.mutable_input()->mutable_cached()->set_lease_id(hit.lease_id());
  EXPECT_TRUE(client().TranslateCached(header).ok());
}

// NaN and Inf are refused by Publish and TranslateKV, naming layer, kind and element.
TEST_F(HardeningTest, NonFiniteCachesAreRefusedByDefault) {
  HostCache bad = Source(kTokens, 4);
  reinterpret_cast<float*>(bad.v[1].data())[5 * kHeads * kDim + 1 * kDim + 7] =
      std::numeric_limits<float>::quiet_NaN();
  grpc::Status published = Publish(bad);
  EXPECT_EQ(published.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(published.error_message(),
              HasSubstr("chunk: layer 1 V element 359 (token 5, head 1, dim 7) is NaN"));
  grpc::Status status;
  EXPECT_FALSE(Lookup("test/dst", v1::REUSE_POLICY_AUTO, &status).hit());  // nothing stored

  HostCache inf = Source(kTokens, 5);
  reinterpret_cast<float*>(inf.k[0].data())[3] = std::numeric_limits<float>::infinity();
  v1::TranslateHeader header;
  header.set_mapper_id("m");
  absl::Status translated = client().Translate(header, inf).status();
  EXPECT_EQ(translated.code(), absl::StatusCode::kInvalidArgument) << translated;
  EXPECT_THAT(std::string(translated.message()),
              HasSubstr("chunk: layer 0 K element 3 (token 0, head 0, dim 3) is +Inf"));
  ExpectHealthy();
}

TEST_F(HardeningTest, NonFiniteCachesPassWhenAllowed) {
  KvtdConfig config;
  config.limits.allow_non_finite = true;
  kvtd_.reset();
  Start(config);
  HostCache bad = Source(kTokens, 4);
  reinterpret_cast<float*>(bad.v[1].data())[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(Publish(bad).ok());
}

TEST_F(HardeningTest, OutOfRangePolicyIsRefused) {
  ASSERT_TRUE(Publish(Source(kTokens, 6)).ok());
  grpc::Status status;
  Lookup("test/dst", static_cast<v1::ReusePolicy>(99), &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("policy must be"));
  EXPECT_THAT(status.error_message(), HasSubstr("got 99"));
}

// 100 KB names echoed in full made the trailer exceed gRPC's metadata limit (the caller saw
// RESOURCE_EXHAUSTED); now the real code arrives with a bounded echo.
TEST_F(HardeningTest, HugeEchoedValuesKeepTheRealStatus) {
  const std::string huge(100000, 'x');
  grpc::Status published = PublishHeaderOnly(PublishHeader(huge, kTokens));
  EXPECT_EQ(published.error_code(), grpc::StatusCode::NOT_FOUND) << published.error_message();
  EXPECT_THAT(published.error_message(), HasSubstr("...(100000 bytes)"));
  EXPECT_LT(published.error_message().size(), 4200u);

  v1::TranslateHeader header;
  header.set_mapper_id(huge);
  absl::Status mapper = client().Translate(header, Source(kTokens, 7)).status();
  EXPECT_EQ(mapper.code(), absl::StatusCode::kNotFound) << mapper.message().substr(0, 200);

  v1::TranslateHeader cached;
  cached.set_mapper_id("m");
  cached.set_dtype(v1::DTYPE_FP32);
  cached.set_layout(v1::LAYOUT_NHD);
  cached.set_num_tokens(16);
  cached.mutable_input()->mutable_cached()->set_lease_id(huge);
  absl::Status lease = client().TranslateCached(cached).status();
  EXPECT_EQ(lease.code(), absl::StatusCode::kNotFound) << lease.message().substr(0, 200);
  ExpectHealthy();
}

// UnregisterSystemMemory times out while a request holds the region; when the request ends the
// region goes and its name can be registered again.
TEST_F(HardeningTest, TimedOutUnregisterCompletesWhenTheRequestEnds) {
  test::ShmObject out(kTargetBytes);
  ASSERT_TRUE(client().RegisterSystemMemory("out", out.key(), 0, kTargetBytes).ok());
  v1::TranslateHeader header;
  header.set_mapper_id("m");
  header.mutable_output()->mutable_region()->set_region("out");
  header.mutable_output()->mutable_region()->set_byte_size(kTargetBytes);
  const HostCache source = Source(kTokens, 8);
  absl::StatusOr<std::unique_ptr<TranslateStream>> stream =
      client().StartTranslate(header, source);
  ASSERT_TRUE(stream.ok()) << stream.status();
  // The header is leased once kvtd has read it: wait until the region is in use.
  v1::SystemMemoryStatusResponse listed;
  for (int i = 0; i < 200; ++i) {
    grpc::ClientContext context;
    v1::SystemMemoryStatusRequest request;
    listed.Clear();
    ASSERT_TRUE(translator_->SystemMemoryStatus(&context, request, &listed).ok());
    if (listed.regions_size() == 1 && listed.regions(0).in_use() == 1) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(listed.regions(0).in_use(), 1u);
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    v1::UnregisterSystemMemoryRequest request;
    request.set_name("out");
    v1::UnregisterSystemMemoryResponse response;
    EXPECT_EQ(translator_->UnregisterSystemMemory(&context, request, &response).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  EXPECT_EQ(client().RegisterSystemMemory("out", out.key(), 0, kTargetBytes).code(),
            absl::StatusCode::kAlreadyExists);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE((*stream)->PushLayer(l, source.k[l].data(), source.v[l].data()).ok());
  }
  // kvtd's status was OK: the streaming client reports only that no inline target came back
  // (the target is in the region), which it checks after the server's status.
  absl::StatusOr<TranslateResult> finished = (*stream)->Finish();
  EXPECT_THAT(std::string(finished.status().message()),
              HasSubstr("server ended the stream without a complete result"));
  absl::Status again = absl::UnknownError("not tried");
  for (int i = 0; i < 200 && !again.ok(); ++i) {
    again = client().RegisterSystemMemory("out", out.key(), 0, kTargetBytes);
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(again.ok()) << again;
  ExpectHealthy();
}

}  // namespace
}  // namespace kvt
