// MLP mappers (kind: mlp) served end to end, in process: a real kvtd on port 0 over a store of
// `kvt synth --kind mlp` directories, the CPU backend as its device, requests through the real
// client inline and through POSIX shared memory, every result checked against the float64
// reference; host and device paging account the MLP's bytes.
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "host_cache/host_cache_testing.h"
#include "kernels/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/testing/reference.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "server/kvtd_server.h"
#include "tests/in_process_kvtd.h"
#include "tests/shm_object.h"
#include "tests/translation_case.h"
#include "transport/proto_convert.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

constexpr char kAdmin[] = "admin-token-abcdefghijk";

// Three mappers of three pairs: an MLP per layer (bf16 weights, unmatched shapes and RoPE), an
// MLP per head (fp32) and the ridge mapper of the first pair's shapes, for contrast.
SynthOptions PerLayer() {
  SynthOptions o;
  o.source = NeoxModelSpec("mlp/src", 3, 2, 16, 10000);
  o.target = NeoxModelSpec("mlp/dst", 4, 4, 8, 500000);
  o.target.rope.rotary_dim = 4;  // partial rotary on the target
  o.k = 2;
  o.dtype = DType::kBF16;
  o.seed = 21;
  o.mlp = MlpConfig{48, MlpGranularity::kPerLayer};
  return o;
}

SynthOptions PerHead() {
  SynthOptions o;
  o.source = NeoxModelSpec("head/src", 2, 2, 16, 10000);
  o.target = NeoxModelSpec("head/dst", 3, 2, 16, 10000);
  o.k = 0;  // all
  o.dtype = DType::kFP32;
  o.seed = 22;
  o.mlp = MlpConfig{24, MlpGranularity::kPerHead};
  return o;
}

SynthOptions Ridge() {
  SynthOptions o = PerLayer();
  o.source.name = "ridge/src";
  o.target.name = "ridge/dst";
  o.mlp.reset();
  return o;
}

class MlpServingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("mlp_serving");
    store_dir_ = JoinPath(dir_, "store");
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(store_dir_, "per-layer"), PerLayer()));
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(store_dir_, "per-head"), PerHead()));
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(store_dir_, "ridge"), Ridge()));
    KVT_ASSERT_OK(WriteStringToFile(JoinPath(dir_, "tokens"), absl::StrCat(kAdmin, " admin\n")));
  }

  // Starts kvtd the way kvtd_main does (store options from the config, the CPU backend as its
  // device), with client shm regions allowed.
  void Start(KvtdConfig config = KvtdConfig()) {
    config.mapper_store.reload_interval_seconds = 0;
    config.security.auth_token_file = JoinPath(dir_, "tokens");
    config.shared_memory.allow_client_regions = true;
    config.limits.response_chunk_bytes = 4096;  // several response chunks per layer
    InProcessKvtdOptions options;
    options.backend = NewCpuBackend(CpuBackendOptions{2, 32});  // pieces of 32 tokens: chunked
    options.store_as_kvtd_main = true;
    options.client.bearer_token = kAdmin;
    kvtd_ = StartKvtdForTest(store_dir_, config, std::move(options));
    ASSERT_NE(kvtd_, nullptr);
  }

  std::unique_ptr<LoadedMapper> Local(const std::string& id) {
    absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(JoinPath(store_dir_, id));
    EXPECT_TRUE(mapper.ok()) << mapper.status();
    return mapper.ok() ? std::move(*mapper) : nullptr;
  }

  // SPEC 3's tolerance for `mapper` on the backend as it starts here: the output dtype's, or at
  // least bf16's 1e-2 where a bf16 / fp16 mapper runs on the oneDNN bf16 path.
  double Tolerance(const LoadedMapper& mapper, DType output) const {
    const auto* cpu = dynamic_cast<const CpuBackend*>(&kvtd_->backend());
    const bool bf16 = cpu != nullptr && cpu->gemm_path() == CpuGemmPath::kOnednnBf16 &&
                      mapper.manifest().weights_dtype != DType::kFP32;
    const double tolerance = testing::TranslationTolerance(output);
    return bf16 ? std::max(tolerance, testing::TranslationTolerance(DType::kBF16)) : tolerance;
  }

  grpc::Status Load(const std::string& id, const std::string& device, v1::MapperInfo* info) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kAdmin));
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::LoadMapperRequest request;
    request.set_mapper_id(id);
    request.set_device(device);
    v1::LoadMapperResponse response;
    grpc::Status status = kvtd_->client().stub()->LoadMapper(&context, request, &response);
    *info = response.mapper();
    return status;
  }

  std::string dir_, store_dir_;
  std::unique_ptr<InProcessKvtd> kvtd_;
};

TEST_F(MlpServingTest, InlineTranslationsMatchTheFloat64Reference) {
  Start();
  const std::vector<testing::TranslationCase> cases = {
      {"per-layer", DType::kFP32, Layout::kHND, DType::kFP32, Layout::kHND, 70, 0, false},
      {"per-layer", DType::kBF16, Layout::kNHD, DType::kBF16, Layout::kHND, 129, 1000, false},
      {"per-layer", DType::kFP16, Layout::kHND, DType::kFP32, Layout::kNHD, 33, 5, true},
      {"per-head", DType::kFP32, Layout::kNHD, DType::kFP32, Layout::kNHD, 97, 123456, false},
      {"per-head", DType::kBF16, Layout::kHND, DType::kFP16, Layout::kHND, 17, 0, true},
      {"ridge", DType::kFP32, Layout::kHND, DType::kFP32, Layout::kHND, 40, 7, false},
  };
  for (const testing::TranslationCase& c : cases) {
    std::unique_ptr<LoadedMapper> mapper = Local(c.mapper);
    ASSERT_NE(mapper, nullptr);
    EXPECT_EQ(mapper->view().kind, c.mapper == "ridge" ? MapKind::kRidge : MapKind::kMlp);
    // SPEC 3's tolerance, or on the oneDNN bf16 path bf16's 1e-2.
    testing::ExpectTranslationMatchesReference(kvtd_->client(), *mapper, c,
                                               testing::FreshSeed("mlp serving inline"),
                                               Tolerance(*mapper, c.output_dtype));
  }
  // The MLP is really served as one: GetMapper reports the kind.
  absl::StatusOr<v1::MapperInfo> info = kvtd_->client().GetMapper("per-head");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->kind(), "mlp");
}

TEST_F(MlpServingTest, SharedMemoryEqualsInlineAndTheReference) {
  Start();
  const std::unique_ptr<LoadedMapper> mapper = Local("per-layer");
  ASSERT_NE(mapper, nullptr);
  const ModelSpec& src = mapper->view().source;
  const ModelSpec& dst = mapper->view().target;
  const int64_t tokens = 75;
  const HostCache source = testing::RandomHostCache(src, tokens, DType::kBF16, Layout::kHND,
                                       testing::FreshSeed("mlp serving shm"));
  v1::TranslateHeader inline_header;
  inline_header.set_mapper_id("per-layer");
  inline_header.set_position_offset(33);
  absl::StatusOr<TranslateResult> inline_result = kvtd_->client().Translate(inline_header, source);
  ASSERT_TRUE(inline_result.ok()) << inline_result.status();

  // Regions laid out [layer][K, V], each layer contiguous, as the transport defines them.
  const int64_t in_bytes = 2 * src.num_layers * source.layer_bytes();
  const int64_t out_layer = tokens * dst.num_kv_heads * dst.head_dim * 2;  // bf16
  const int64_t out_bytes = 2 * dst.num_layers * out_layer;
  test::ShmObject in_object(in_bytes), out_object(out_bytes);
  for (int l = 0; l < src.num_layers; ++l) {
    std::memcpy(in_object.data() + (2 * l) * source.layer_bytes(), source.k[l].data(),
                source.layer_bytes());
    std::memcpy(in_object.data() + (2 * l + 1) * source.layer_bytes(), source.v[l].data(),
                source.layer_bytes());
  }
  std::memset(out_object.data(), 0xff, out_bytes);  // NaN wherever nothing is written
  KVT_ASSERT_OK(kvtd_->client().RegisterSystemMemory("in", in_object.key(), 0, in_bytes));
  KVT_ASSERT_OK(kvtd_->client().RegisterSystemMemory("out", out_object.key(), 0, out_bytes));
  v1::TranslateHeader header;
  header.set_mapper_id("per-layer");
  header.set_dtype(v1::DTYPE_BF16);
  header.set_layout(v1::LAYOUT_HND);
  header.set_num_tokens(tokens);
  header.set_position_offset(33);
  header.mutable_input()->mutable_region()->set_region("in");
  header.mutable_input()->mutable_region()->set_byte_size(in_bytes);
  header.mutable_output()->mutable_region()->set_region("out");
  header.mutable_output()->mutable_region()->set_byte_size(out_bytes);
  absl::StatusOr<TranslateResult> shm_result = kvtd_->client().TranslateRegions(header);
  ASSERT_TRUE(shm_result.ok()) << shm_result.status();
  EXPECT_EQ(shm_result->trailer.output_bytes(), static_cast<uint64_t>(out_bytes));

  const HostCache& expected = inline_result->target;
  ASSERT_EQ(expected.layer_bytes(), out_layer);
  CacheView shm_view;
  shm_view.dtype = DType::kBF16;
  shm_view.layout = Layout::kHND;
  shm_view.num_kv_heads = dst.num_kv_heads;
  shm_view.head_dim = dst.head_dim;
  shm_view.num_tokens = tokens;
  for (int l = 0; l < dst.num_layers; ++l) {
    const char* k = out_object.data() + (2 * l) * out_layer;
    const char* v = out_object.data() + (2 * l + 1) * out_layer;
    EXPECT_EQ(std::memcmp(k, expected.k[l].data(), out_layer), 0) << "layer " << l << " K";
    EXPECT_EQ(std::memcmp(v, expected.v[l].data(), out_layer), 0) << "layer " << l << " V";
    shm_view.k.push_back(k);
    shm_view.v.push_back(v);
  }
  Positions positions;
  positions.offset = 33;
  EXPECT_LE(testing::MaxErrorAgainstReference(mapper->view(), source.view(), shm_view, positions),
            testing::TranslationTolerance(DType::kBF16));
  KVT_EXPECT_OK(kvtd_->client().UnregisterSystemMemory(""));
}

// Paging accounts an MLP by its real size: the host copy is the weights file's data, the CPU
// device copy the fp32 conversion of all six tensors of every chain (sgemm path) or the packed
// bf16 matrices and fp32 biases (oneDNN bf16 path). A budget one byte short of either refuses
// the mapper with the budget's name; the exact size serves it.
TEST_F(MlpServingTest, PagingCountsTheMlpBytes) {
  const std::unique_ptr<LoadedMapper> mapper = Local("per-layer");
  ASSERT_NE(mapper, nullptr);
  const int64_t params = mapper->num_params();
  const uint64_t host_bytes = MapperWeightBytes(mapper->manifest());
  EXPECT_EQ(host_bytes, static_cast<uint64_t>(params) * 2);  // bf16
  EXPECT_EQ(mapper->weight_bytes(), host_bytes);
  CpuBackend cpu{CpuBackendOptions()};
  const uint64_t device_bytes = cpu.PreparedBytesEstimate(mapper->view());
  if (cpu.gemm_path() == CpuGemmPath::kOnednnBf16) {
    EXPECT_EQ(device_bytes, cpu.Prepare(mapper->view()).value()->bytes());
  } else {
    EXPECT_EQ(device_bytes, static_cast<uint64_t>(params) * 4);  // every tensor as fp32
  }

  {
    KvtdConfig config;
    config.mapper_store.load_on_scan = false;
    config.mapper_store.host_budget_bytes = static_cast<int64_t>(host_bytes);
    config.mapper_store.device_budget_bytes = static_cast<int64_t>(device_bytes);
    Start(config);
    v1::MapperInfo info;
    ASSERT_TRUE(Load("per-layer", "host", &info).ok());
    EXPECT_EQ(info.kind(), "mlp");
    EXPECT_EQ(info.weight_bytes(), host_bytes);
    ASSERT_EQ(info.residency_size(), 1);
    EXPECT_EQ(info.residency(0).bytes(), host_bytes);
    ASSERT_TRUE(Load("per-layer", "cpu", &info).ok());
    ASSERT_EQ(info.residency_size(), 2);
    EXPECT_EQ(info.residency(1).device(), "cpu");
    EXPECT_EQ(info.residency(1).bytes(), device_bytes);
    kvtd_.reset();
  }
  for (const bool host_short : {true, false}) {
    SCOPED_TRACE(host_short ? "host budget short" : "device budget short");
    KvtdConfig config;
    config.mapper_store.load_on_scan = false;
    config.mapper_store.host_budget_bytes = static_cast<int64_t>(host_bytes) - host_short;
    config.mapper_store.device_budget_bytes = static_cast<int64_t>(device_bytes) - !host_short;
    config.mapper_store.acquire_timeout_seconds = 0.1;
    Start(config);
    const HostCache source =
        testing::RandomHostCache(mapper->view().source, 8, DType::kFP32, Layout::kHND, 1);
    v1::TranslateHeader header;
    header.set_mapper_id("per-layer");
    absl::StatusOr<TranslateResult> refused = kvtd_->client().Translate(header, source);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr(host_short ? "mapper_store.host_budget_bytes"
                                     : "mapper_store.device_budget_bytes"));
    kvtd_.reset();
  }
}

}  // namespace
}  // namespace kvt
