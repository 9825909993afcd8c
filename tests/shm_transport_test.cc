// Shared-memory transport end to end: kvtd runs as its own process, this test is the client
// process; caches pass through POSIX shm regions both ways and must equal the inline result
// bit for bit. Every bad-region case gets a clear error.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/types.h"
#include "mapper_store/synth.h"
#include "tests/kvtd_process.h"
#include "tests/shm_object.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

// demo-tiny: source 4 layers x 2 heads x 32, target 6 layers x 2 heads x 32.
constexpr int64_t kTokens = 100;
constexpr int64_t kSourceBytes = 2 * 4 * (2 * kTokens * 32) * 2;  // bf16
constexpr int64_t kTargetBytes = 2 * 6 * (2 * kTokens * 32) * 2;

using test::ShmObject;

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

  // `cache` packed layer-major (per layer K then V, no padding) at `dst`, as regions hold it.
  static void WritePacked(const HostCache& cache, char* dst) {
    for (int l = 0; l < cache.num_layers; ++l) {
      std::memcpy(dst + (2 * l) * cache.layer_bytes(), cache.k[l].data(), cache.layer_bytes());
      std::memcpy(dst + (2 * l + 1) * cache.layer_bytes(), cache.v[l].data(), cache.layer_bytes());
    }
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
  WritePacked(source, in_object.data() + 100);
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

  // header.region_layer_notices: one data-less chunk per target layer and kind (K then V of a
  // layer together; layers in any order), each sent once its bytes are in the region (checked
  // when the notice arrives), then the trailer.
  std::memset(out_object.data(), 0xff, kTargetBytes);
  v1::TranslateHeader noticed = RegionHeader("in", 100, kSourceBytes, "out");
  noticed.set_region_layer_notices(true);
  grpc::ClientContext context;
  auto stream = client->stub()->TranslateKV(&context);
  v1::TranslateKVRequest request;
  *request.mutable_header() = noticed;
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->WritesDone());
  v1::TranslateKVResponse response;
  int notices = 0;
  std::set<std::pair<uint32_t, int>> noticed_layers;
  bool header_seen = false, trailer_seen = false;
  while (stream->Read(&response)) {
    if (response.has_header()) header_seen = true;
    if (response.has_trailer()) trailer_seen = true;
    if (!response.has_chunk()) continue;
    EXPECT_TRUE(header_seen);
    EXPECT_FALSE(trailer_seen);
    const v1::KVChunk& chunk = response.chunk();
    const int kind = chunk.kind() == v1::CACHE_KIND_K ? 0 : 1;
    EXPECT_EQ(kind, notices % 2);
    ASSERT_LT(chunk.layer(), 6u);
    EXPECT_TRUE(noticed_layers.insert({chunk.layer(), kind}).second) << "a second notice";
    EXPECT_EQ(chunk.token_start(), 0u);
    EXPECT_EQ(chunk.token_count(), static_cast<uint32_t>(kTokens));
    EXPECT_TRUE(chunk.data().empty());
    const std::vector<char>& want =
        kind == 0 ? expected.k[chunk.layer()] : expected.v[chunk.layer()];
    EXPECT_EQ(std::memcmp(out_object.data() + (2 * chunk.layer() + kind) * expected.layer_bytes(),
                          want.data(), expected.layer_bytes()),
              0)
        << "layer " << chunk.layer() << " kind " << kind << " not in the region at its notice";
    ++notices;
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_TRUE(trailer_seen);
  EXPECT_EQ(notices, 12);
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
    std::atomic<bool> unregistered{false};
    std::thread unregister([&client, &unregistered] {
      EXPECT_TRUE(client->UnregisterSystemMemory("in").ok());
      unregistered = true;
    });
    // Time for the unregister RPC to reach kvtd and wait there: nothing over gRPC shows that
    // it waits (transport/shm_registry_test checks the wait itself without a sleep). Whether it
    // arrived or not, it cannot have returned while the request holds the region.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_FALSE(unregistered.load());
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

// vLLM's paged layout on both sides: HND blocks in, NHD blocks out, scattered block tables.
// The result must equal the inline translation bit for bit, in the request's slots only.
TEST_F(ShmTransportTest, PagedRegionsEqualInlineTranslation) {
  auto kvtd = StartKvtd(true);
  const int port = kvtd->WaitForPort();
  ASSERT_GT(port, 0);
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));
  const HostCache source = Source();  // HND
  v1::TranslateHeader inline_header;
  inline_header.set_mapper_id("demo-tiny");
  inline_header.set_position_offset(33);
  inline_header.set_output_layout(v1::LAYOUT_NHD);
  absl::StatusOr<TranslateResult> inline_result = client->Translate(inline_header, source);
  ASSERT_TRUE(inline_result.ok()) << inline_result.status();
  const HostCache& expected = inline_result->target;

  const std::vector<uint32_t> in_table = {11, 3, 7, 0, 5, 9, 2};  // 100 tokens, blocks of 16
  const std::vector<uint32_t> out_table = {4, 9, 0, 6, 1, 8, 3, 2};  // one spare entry
  const PagedLayout in_pages{Layout::kHND, 12, 16, 2, 32, 2};
  const PagedLayout out_pages{Layout::kNHD, 10, 16, 2, 32, 2};
  const int64_t in_bytes = 4 * in_pages.layer_bytes();
  const int64_t out_bytes = 6 * out_pages.layer_bytes();
  ShmObject in_object(in_bytes), out_object(out_bytes);
  std::memset(in_object.data(), 0x7f, in_bytes);
  std::memset(out_object.data(), 0x7f, out_bytes);
  const int64_t vector_bytes = 32 * 2;
  for (int l = 0; l < 4; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<char>& layer = (kind == 0 ? source.k : source.v)[l];
      for (int64_t t = 0; t < kTokens; ++t) {
        for (int h = 0; h < 2; ++h) {
          std::memcpy(in_object.data() + l * in_pages.layer_bytes() +
                          in_pages.ElementOffset(kind, in_table[t / 16], t % 16, h, 0),
                      layer.data() + CacheOffset(Layout::kHND, 2, kTokens, 32, h, t, 0) * 2,
                      vector_bytes);
        }
      }
    }
  }
  ASSERT_TRUE(client->RegisterSystemMemory("paged-in", in_object.key(), 0, in_bytes).ok());
  ASSERT_TRUE(client->RegisterSystemMemory("paged-out", out_object.key(), 0, out_bytes).ok());
  v1::TranslateHeader header = RegionHeader("paged-in", 0, in_bytes, "paged-out");
  header.set_output_layout(v1::LAYOUT_NHD);
  header.mutable_output()->mutable_region()->set_byte_size(out_bytes);
  v1::PagedBlocks* in_paged = header.mutable_input()->mutable_region()->mutable_paged();
  in_paged->set_num_blocks(12);
  in_paged->set_block_size(16);
  for (uint32_t b : in_table) in_paged->add_block_table(b);
  v1::PagedBlocks* out_paged = header.mutable_output()->mutable_region()->mutable_paged();
  out_paged->set_num_blocks(10);
  out_paged->set_block_size(16);
  for (uint32_t b : out_table) out_paged->add_block_table(b);
  absl::StatusOr<TranslateResult> paged = client->TranslateRegions(header);
  ASSERT_TRUE(paged.ok()) << paged.status();

  std::vector<bool> written(static_cast<size_t>(out_bytes), false);
  for (int l = 0; l < 6; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<char>& layer = (kind == 0 ? expected.k : expected.v)[l];
      for (int64_t t = 0; t < kTokens; ++t) {
        for (int h = 0; h < 2; ++h) {
          const int64_t at = l * out_pages.layer_bytes() +
                             out_pages.ElementOffset(kind, out_table[t / 16], t % 16, h, 0);
          ASSERT_EQ(std::memcmp(out_object.data() + at,
                                layer.data() + CacheOffset(Layout::kNHD, 2, kTokens, 32, h, t, 0) * 2,
                                vector_bytes),
                    0)
              << "layer " << l << " kind " << kind << " token " << t << " head " << h;
          std::fill_n(written.begin() + at, vector_bytes, true);
        }
      }
    }
  }
  // Every other byte (other blocks, the tail of the last block) is as it was.
  int64_t changed = 0;
  for (int64_t i = 0; i < out_bytes; ++i) changed += !written[i] && out_object.data()[i] != 0x7f;
  EXPECT_EQ(changed, 0);

  // Bad block tables name the field and entry.
  auto expect_error = [&](v1::TranslateHeader bad, const std::string& words) {
    absl::StatusOr<TranslateResult> result = client->TranslateRegions(bad);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << words;
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(words));
  };
  v1::TranslateHeader outside = header;
  outside.mutable_input()->mutable_region()->mutable_paged()->set_block_table(2, 12);
  expect_error(outside, "header.input.region.paged.block_table[2]=12 is outside num_blocks=12");
  v1::TranslateHeader too_short = header;
  too_short.mutable_output()->mutable_region()->mutable_paged()->mutable_block_table()->Truncate(6);
  expect_error(too_short,
               "header.output.region.paged.block_table has 6 entries; 100 tokens in blocks of 16 "
               "need 7");
  v1::TranslateHeader repeated = header;
  repeated.mutable_output()->mutable_region()->mutable_paged()->set_block_table(5, 4);
  expect_error(repeated, "header.output.region.paged.block_table[5]=4 repeats block_table[0]");
  v1::TranslateHeader no_size = header;
  no_size.mutable_input()->mutable_region()->mutable_paged()->set_block_size(0);
  expect_error(no_size, "header.input.region.paged.block_size must be > 0");
  v1::TranslateHeader wrong_bytes = header;
  wrong_bytes.mutable_input()->mutable_region()->mutable_paged()->set_num_blocks(13);
  expect_error(wrong_bytes, "header.input.region.byte_size=");
  EXPECT_TRUE(client->UnregisterSystemMemory("").ok());
}

// An engine's own block order (vLLM's CPU attention kernels, "vec" ISA: per block and head K
// transposed, [head_dim, block_size], then V, [block_size, head_dim]), layers apart with gaps, as
// the vLLM connector writes a translated prefix straight into the engine's cache; first_token
// leaves the request's first two blocks (the engine's own prefix hits) untouched.
TEST_F(ShmTransportTest, EngineOrderPagedOutputEqualsInlineTranslation) {
  auto kvtd = StartKvtd(true);
  const int port = kvtd->WaitForPort();
  ASSERT_GT(port, 0);
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));
  const HostCache source = Source();
  v1::TranslateHeader inline_header;
  inline_header.set_mapper_id("demo-tiny");
  inline_header.set_position_offset(33);
  inline_header.set_output_layout(v1::LAYOUT_NHD);
  absl::StatusOr<TranslateResult> inline_result = client->Translate(inline_header, source);
  ASSERT_TRUE(inline_result.ok()) << inline_result.status();
  const HostCache& expected = inline_result->target;

  constexpr int64_t kBlocks = 10, kBlockSize = 16, kHeads = 2, kDim = 32, kFirst = 32;
  const int64_t block_elements = kHeads * 2 * kBlockSize * kDim;
  const int64_t layer_bytes = kBlocks * block_elements * 2 + 96;  // 96 bytes of gap
  const int64_t out_bytes = 64 + 6 * layer_bytes;
  const std::vector<uint32_t> out_table = {4, 9, 0, 6, 1, 8, 3};
  ShmObject in_object(kSourceBytes), out_object(out_bytes);
  WritePacked(source, in_object.data());
  std::memset(out_object.data(), 0x7f, out_bytes);
  ASSERT_TRUE(client->RegisterSystemMemory("in", in_object.key(), 0, kSourceBytes).ok());
  ASSERT_TRUE(client->RegisterSystemMemory("engine", out_object.key(), 0, out_bytes).ok());
  v1::TranslateHeader header = RegionHeader("in", 0, kSourceBytes, "engine");
  header.set_output_layout(v1::LAYOUT_NHD);
  header.mutable_output()->mutable_region()->set_byte_size(out_bytes);
  v1::PagedBlocks* paged = header.mutable_output()->mutable_region()->mutable_paged();
  paged->set_num_blocks(kBlocks);
  paged->set_block_size(kBlockSize);
  paged->set_first_token(kFirst);
  for (uint32_t b : out_table) paged->add_block_table(b);
  v1::EngineBlockOrder* order = paged->mutable_engine_order();
  for (int l = 0; l < 6; ++l) order->add_layer_offsets(64 + l * layer_bytes);
  order->set_block_stride(block_elements);
  order->mutable_k()->set_slot_stride(1);
  order->mutable_k()->set_head_stride(2 * kBlockSize * kDim);
  order->mutable_k()->set_dim_stride(kBlockSize);
  order->mutable_v()->set_offset(kBlockSize * kDim);
  order->mutable_v()->set_slot_stride(kDim);
  order->mutable_v()->set_head_stride(2 * kBlockSize * kDim);
  order->mutable_v()->set_dim_stride(1);
  absl::StatusOr<TranslateResult> result = client->TranslateRegions(header);
  ASSERT_TRUE(result.ok()) << result.status();

  // The element of (layer, kind, token, head, dim), written out independently of PagedLayout.
  auto at = [&](int l, int kind, int64_t t, int64_t h, int64_t d) {
    const int64_t block = out_table[t / kBlockSize], slot = t % kBlockSize;
    const int64_t inner = kind == 0 ? d * kBlockSize + slot : kBlockSize * kDim + slot * kDim + d;
    return 64 + l * layer_bytes + (block * block_elements + h * 2 * kBlockSize * kDim + inner) * 2;
  };
  std::vector<bool> written(static_cast<size_t>(out_bytes), false);
  for (int l = 0; l < 6; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<char>& layer = (kind == 0 ? expected.k : expected.v)[l];
      for (int64_t t = kFirst; t < kTokens; ++t) {
        for (int64_t h = 0; h < kHeads; ++h) {
          for (int64_t d = 0; d < kDim; ++d) {
            const int64_t byte = at(l, kind, t, h, d);
            ASSERT_EQ(std::memcmp(out_object.data() + byte,
                                  layer.data() +
                                      CacheOffset(Layout::kNHD, kHeads, kTokens, kDim, h, t, d) * 2,
                                  2),
                      0)
                << "layer " << l << " kind " << kind << " token " << t << " head " << h;
            written[byte] = written[byte + 1] = true;
          }
        }
      }
    }
  }
  // Nothing else moved: the first two blocks, the other blocks, the gaps, the tail.
  int64_t changed = 0;
  for (int64_t i = 0; i < out_bytes; ++i) changed += !written[i] && out_object.data()[i] != 0x7f;
  EXPECT_EQ(changed, 0);

  auto expect_error = [&](v1::TranslateHeader bad, const std::string& words) {
    absl::StatusOr<TranslateResult> refused = client->TranslateRegions(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << words;
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr(words));
  };
  const auto bad_order = [&](const std::function<void(v1::EngineBlockOrder*)>& edit) {
    v1::TranslateHeader bad = header;
    edit(bad.mutable_output()->mutable_region()->mutable_paged()->mutable_engine_order());
    return bad;
  };
  expect_error(bad_order([](v1::EngineBlockOrder* o) { o->mutable_v()->set_offset(0); }),
               "header.output.region.paged.engine_order: v element (slot 0, head 0, dim 0) lands "
               "on another element of the block");
  expect_error(bad_order([&](v1::EngineBlockOrder* o) { o->set_layer_offsets(5, out_bytes - 100); }),
               "header.output.region.paged.engine_order.layer_offsets[5]=");
  expect_error(bad_order([&](v1::EngineBlockOrder* o) { o->set_layer_offsets(3, 64 + 2 * layer_bytes + 8); }),
               "overlaps layer 2");
  expect_error(bad_order([](v1::EngineBlockOrder* o) { o->set_block_stride(100); }),
               "header.output.region.paged.engine_order.block_stride=100 is shorter than one "
               "block's span of 2048 elements");
  expect_error(bad_order([](v1::EngineBlockOrder* o) { o->mutable_k()->set_dim_stride(uint64_t{1} << 50); }),
               "header.output.region.paged.engine_order.k.dim_stride=");
  expect_error(bad_order([](v1::EngineBlockOrder* o) { o->clear_layer_offsets(); }),
               "header.output.region.paged.engine_order.layer_offsets has 0 entries; the model "
               "has 6 layers");
  v1::TranslateHeader past_end = header;
  past_end.mutable_output()->mutable_region()->mutable_paged()->set_first_token(kTokens);
  expect_error(past_end, "header.output.region.paged: first_token=100, end_token=0 do not name "
                         "a non-empty token range inside the request's 100 tokens");
  // end_token: the block table need cover only [0, end_token); nothing past it is written.
  v1::TranslateHeader partial = header;
  v1::PagedBlocks* partial_paged = partial.mutable_output()->mutable_region()->mutable_paged();
  partial_paged->set_end_token(64);
  partial_paged->mutable_block_table()->Truncate(4);
  std::memset(out_object.data(), 0x7f, out_bytes);
  ASSERT_TRUE(client->TranslateRegions(partial).ok());
  for (int l = 0; l < 6; ++l) {
    for (int64_t t = 0; t < kTokens; ++t) {
      const int64_t byte = at(l, 1, t, 1, 7);
      if (t >= kFirst && t < 64) {
        EXPECT_EQ(std::memcmp(out_object.data() + byte,
                              expected.v[l].data() +
                                  CacheOffset(Layout::kNHD, kHeads, kTokens, kDim, 1, t, 7) * 2,
                              2),
                  0)
            << "layer " << l << " token " << t;
      } else {
        EXPECT_EQ(out_object.data()[byte], 0x7f) << "layer " << l << " token " << t
                                                 << " outside [first_token, end_token) written";
      }
    }
  }
  EXPECT_TRUE(client->UnregisterSystemMemory("").ok());
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
