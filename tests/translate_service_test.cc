// kvtd's gRPC surface end to end, in process: a real server on port 0, a real channel, real
// mapper directories on disk, results checked against the float64 reference.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/testing/http_get.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "host_cache/host_cache_testing.h"
#include "kernels/dtype.h"
#include "kernels/testing/reference.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "quality/quality_reference.h"
#include "quality/stats_testing.h"
#include "server/kvtd_server.h"
#include "tests/in_process_kvtd.h"
#include "tests/translation_case.h"
#include "transport/proto_convert.h"

namespace kvt {
namespace {

using ::kvt::testing::MakeTempDir;

using ::testing::HasSubstr;
using ::testing::Not;

// A running kvtd over a store directory, plus a client (null, and a test failure, if it does not
// start).
std::unique_ptr<InProcessKvtd> Serve(const std::string& store_dir,
                                     KvtdConfig config = KvtdConfig()) {
  InProcessKvtdOptions options;
  options.drain_grace_seconds = 0.3;
  return StartKvtdForTest(store_dir, std::move(config), std::move(options));
}

class TranslateServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    store_dir_ = new std::string(MakeTempDir("store"));
    // Matched shapes, and an unmatched pair (heads, head_dim, RoPE all differ).
    SynthOptions matched;
    matched.source = NeoxModelSpec("test/src", 3, 2, 16, 10000);
    matched.target = NeoxModelSpec("test/dst", 4, 2, 16, 10000);
    matched.k = 2;
    matched.dtype = DType::kFP32;
    matched.seed = 7;
    ASSERT_TRUE(WriteSynthMapper(*store_dir_ + "/matched", matched).ok());
    SynthOptions unmatched;
    unmatched.source = NeoxModelSpec("test/small", 2, 2, 8, 10000);
    unmatched.target = NeoxModelSpec("test/big", 3, 4, 16, 500000);
    unmatched.target.rope.rotary_dim = 8;  // partial rotary on the target
    unmatched.k = 0;
    unmatched.dtype = DType::kBF16;
    unmatched.seed = 8;
    ASSERT_TRUE(WriteSynthMapper(*store_dir_ + "/unmatched", unmatched).ok());
  }

  static std::unique_ptr<LoadedMapper> Local(const std::string& id) {
    absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper =
        LoadMapperDir(*store_dir_ + "/" + id);
    EXPECT_TRUE(mapper.ok()) << mapper.status();
    return std::move(*mapper);
  }

  static std::string* store_dir_;
};
std::string* TranslateServiceTest::store_dir_ = nullptr;

TEST_F(TranslateServiceTest, HealthIsServingAndReflectionListsTheService) {
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_);
  absl::StatusOr<std::string> health = kvtd->client().Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  absl::StatusOr<std::string> service_health = kvtd->client().Health("kvt.v1.KvTranslator");
  ASSERT_TRUE(service_health.ok());
  EXPECT_EQ(*service_health, "SERVING");

  auto reflection = grpc::reflection::v1alpha::ServerReflection::NewStub(kvtd->client().channel());
  grpc::ClientContext context;
  auto stream = reflection->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  stream->WritesDone();
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> services;
  for (const auto& service : response.list_services_response().service()) {
    services.push_back(service.name());
  }
  EXPECT_THAT(services, ::testing::Contains("kvt.v1.KvTranslator"));
  EXPECT_THAT(services, ::testing::Contains("grpc.health.v1.Health"));
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(TranslateServiceTest, ServesOnAUnixSocketToo) {
  KvtdConfig config;
  // Bazel's TEST_TMPDIR is longer than a unix socket path may be (107 characters).
  char dir_template[] = "/tmp/kvt-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  config.server.unix_socket = std::string(dir_template) + "/kvtd.sock";
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_, config);
  std::unique_ptr<Client> local = Client::Create("unix:" + config.server.unix_socket);
  absl::StatusOr<std::string> health = local->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  absl::StatusOr<v1::ListMappersResponse> list = local->ListMappers();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->mappers_size(), 2);
  std::remove(config.server.unix_socket.c_str());
  rmdir(dir_template);
}

TEST_F(TranslateServiceTest, ListMappersOnAnEmptyStore) {
  std::unique_ptr<InProcessKvtd> kvtd = Serve(MakeTempDir("empty_store"));
  absl::StatusOr<v1::ListMappersResponse> list = kvtd->client().ListMappers();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->mappers_size(), 0);
}

TEST_F(TranslateServiceTest, ListAndGetMappers) {
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_);
  absl::StatusOr<v1::ListMappersResponse> list = kvtd->client().ListMappers();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->mappers_size(), 2);
  absl::StatusOr<v1::MapperInfo> info = kvtd->client().GetMapper("unmatched");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->source_model(), "test/small");
  EXPECT_EQ(info->target_shape().num_kv_heads(), 4u);
  EXPECT_EQ(info->state(), v1::MAPPER_STATE_HOST_RESIDENT);
  EXPECT_TRUE(info->synthetic());
  EXPECT_EQ(kvtd->client().GetMapper("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TranslateServiceTest, UnknownPairIsNotFoundNamingThePair) {
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_);
  v1::TranslateHeader header;
  header.set_source_model("Qwen/Qwen3-14B");
  header.set_target_model("Qwen/Qwen3-32B");
  HostCache cache = testing::RandomHostCache(NeoxModelSpec("x", 1, 1, 8, 1e4), 4, DType::kBF16, Layout::kHND, 1);
  absl::StatusOr<TranslateResult> result = kvtd->client().Translate(header, cache);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(result.status().message()),
              HasSubstr("Qwen/Qwen3-14B -> Qwen/Qwen3-32B"));
}

TEST_F(TranslateServiceTest, TranslationsMatchTheFloat64Reference) {
  KvtdConfig config;
  config.limits.response_chunk_bytes = 4096;  // several response chunks per layer
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_, config);
  const std::vector<testing::TranslationCase> cases = {
      {"matched", DType::kFP32, Layout::kHND, DType::kFP32, Layout::kHND, 70, 0, false},
      {"matched", DType::kBF16, Layout::kNHD, DType::kBF16, Layout::kHND, 129, 1000, false},
      {"matched", DType::kFP16, Layout::kHND, DType::kFP32, Layout::kNHD, 33, 5, true},
      {"unmatched", DType::kBF16, Layout::kHND, DType::kBF16, Layout::kNHD, 257, 123456, false},
      {"unmatched", DType::kFP32, Layout::kNHD, DType::kFP16, Layout::kNHD, 17, 0, true},
  };
  for (const testing::TranslationCase& c : cases) {
    std::unique_ptr<LoadedMapper> mapper = Local(c.mapper);
    const double tolerance =
        (c.dtype == DType::kFP32 && c.output_dtype == DType::kFP32 &&
         mapper->manifest().weights_dtype == DType::kFP32)
            ? 1e-5
            : 1e-2;
    testing::ExpectTranslationMatchesReference(kvtd->client(), *mapper, c,
                                               testing::FreshSeed("service translate"),
                                               tolerance);
  }
}

// The raw stream, for malformed requests the client library would never send.
struct RawStream {
  explicit RawStream(Client& client, int deadline_ms = 10000) {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(deadline_ms));
    stream = client.stub()->TranslateKV(&context);
  }
  grpc::Status Finish() {
    stream->WritesDone();
    v1::TranslateKVResponse response;
    while (stream->Read(&response)) {
    }
    return stream->Finish();
  }
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::TranslateKVRequest, v1::TranslateKVResponse>>
      stream;
};

v1::TranslateKVRequest HeaderMessage(int tokens) {
  v1::TranslateKVRequest request;
  v1::TranslateHeader* header = request.mutable_header();
  header->set_mapper_id("matched");
  header->set_dtype(v1::DTYPE_FP32);
  header->set_layout(v1::LAYOUT_HND);
  header->set_num_tokens(tokens);
  return request;
}

v1::TranslateKVRequest ChunkMessage(int layer, v1::CacheKind kind, int start, int count,
                                    int bytes_per_token = 2 * 16 * 4) {
  v1::TranslateKVRequest request;
  v1::KVChunk* chunk = request.mutable_chunk();
  chunk->set_layer(layer);
  chunk->set_kind(kind);
  chunk->set_token_start(start);
  chunk->set_token_count(count);
  chunk->mutable_data()->assign(static_cast<size_t>(count) * bytes_per_token, '\0');
  return request;
}

TEST_F(TranslateServiceTest, MalformedStreamsGetClearErrorsAndTheServerKeepsServing) {
  KvtdConfig config;
  config.limits.max_tokens = 1000;
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_, config);
  struct Case {
    std::string name;
    std::vector<v1::TranslateKVRequest> messages;
    grpc::StatusCode code;
    std::string message_part;
  };
  auto header_with = [](auto&& edit) {
    v1::TranslateKVRequest request = HeaderMessage(8);
    edit(request.mutable_header());
    return request;
  };
  std::vector<v1::TranslateKVRequest> all_but_one;
  all_but_one.push_back(HeaderMessage(8));
  for (int layer = 0; layer < 3; ++layer) {
    all_but_one.push_back(ChunkMessage(layer, v1::CACHE_KIND_K, 0, 8));
    if (layer != 2) all_but_one.push_back(ChunkMessage(layer, v1::CACHE_KIND_V, 0, 8));
  }
  const std::vector<Case> cases = {
      {"no header", {}, grpc::StatusCode::INVALID_ARGUMENT, "before its header"},
      {"chunk first", {ChunkMessage(0, v1::CACHE_KIND_K, 0, 8)},
       grpc::StatusCode::INVALID_ARGUMENT, "first message must be a header"},
      {"second header", {HeaderMessage(8), HeaderMessage(8)}, grpc::StatusCode::INVALID_ARGUMENT,
       "second header"},
      {"dtype unset", {header_with([](v1::TranslateHeader* h) { h->clear_dtype(); })},
       grpc::StatusCode::INVALID_ARGUMENT, "header.dtype"},
      {"layout unset", {header_with([](v1::TranslateHeader* h) { h->clear_layout(); })},
       grpc::StatusCode::INVALID_ARGUMENT, "header.layout"},
      {"zero tokens", {HeaderMessage(0)}, grpc::StatusCode::INVALID_ARGUMENT,
       "header.num_tokens"},
      {"too many tokens", {HeaderMessage(1001)}, grpc::StatusCode::RESOURCE_EXHAUSTED,
       "limits.max_tokens"},
      {"positions count", {header_with([](v1::TranslateHeader* h) { h->add_positions(3); })},
       grpc::StatusCode::INVALID_ARGUMENT, "header.positions"},
      {"unknown mapper",
       {header_with([](v1::TranslateHeader* h) { h->set_mapper_id("missing"); })},
       grpc::StatusCode::NOT_FOUND, "missing"},
      {"mapper and pair disagree",
       {header_with([](v1::TranslateHeader* h) { h->set_source_model("test/small"); })},
       grpc::StatusCode::INVALID_ARGUMENT, "header.mapper_id"},
      {"shared memory input",
       {header_with([](v1::TranslateHeader* h) { h->mutable_input()->mutable_region(); })},
       grpc::StatusCode::FAILED_PRECONDITION, "header.input.region"},
      {"layer out of range", {HeaderMessage(8), ChunkMessage(3, v1::CACHE_KIND_K, 0, 8)},
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.layer=3"},
      {"kind unset", {HeaderMessage(8), ChunkMessage(0, v1::CACHE_KIND_UNSPECIFIED, 0, 8)},
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.kind"},
      {"tokens out of range", {HeaderMessage(8), ChunkMessage(0, v1::CACHE_KIND_K, 4, 8)},
       grpc::StatusCode::INVALID_ARGUMENT, "exceeds header.num_tokens"},
      {"empty chunk", {HeaderMessage(8), ChunkMessage(0, v1::CACHE_KIND_K, 0, 0)},
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.token_count"},
      {"wrong byte count", {HeaderMessage(8), ChunkMessage(0, v1::CACHE_KIND_K, 0, 8, 100)},
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.data has 800 bytes, expected 1024"},
      {"duplicate chunk",
       {HeaderMessage(8), ChunkMessage(0, v1::CACHE_KIND_K, 0, 8),
        ChunkMessage(0, v1::CACHE_KIND_K, 4, 2)},
       grpc::StatusCode::INVALID_ARGUMENT, "repeats token 4"},
      {"stream ends early", all_but_one, grpc::StatusCode::INVALID_ARGUMENT,
       "layer 2 V: tokens [0, 8) missing"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RawStream raw(kvtd->client());
    for (const v1::TranslateKVRequest& message : c.messages) {
      if (!raw.stream->Write(message)) break;
    }
    grpc::Status status = raw.Finish();
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message_part));
  }
  // Still serving, and the failed requests released their admission.
  std::unique_ptr<LoadedMapper> mapper = Local("matched");
  HostCache source = testing::RandomHostCache(mapper->view().source, 8, DType::kFP32, Layout::kHND, 3);
  v1::TranslateHeader header;
  header.set_mapper_id("matched");
  absl::StatusOr<TranslateResult> result = kvtd->client().Translate(header, source);
  EXPECT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(kvtd->server().service()->inflight_requests(), 0);
}

TEST_F(TranslateServiceTest, AdmissionLimitGivesResourceExhaustedAndDeadlinesFreeTheSlot) {
  KvtdConfig config;
  config.limits.max_inflight_requests = 1;
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_, config);
  {
    // Holds the only slot: header accepted, chunks never sent, deadline short.
    RawStream holder(kvtd->client(), 1500);
    ASSERT_TRUE(holder.stream->Write(HeaderMessage(8)));
    v1::TranslateKVResponse first;
    ASSERT_TRUE(holder.stream->Read(&first));  // response header: admitted
    ASSERT_TRUE(first.has_header());

    RawStream second(kvtd->client());
    second.stream->Write(HeaderMessage(8));
    grpc::Status busy = second.Finish();
    EXPECT_EQ(busy.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(busy.error_message(), HasSubstr("limits.max_inflight_requests"));

    v1::TranslateKVResponse response;
    while (holder.stream->Read(&response)) {
    }
    EXPECT_EQ(holder.stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // The expired request gave its slot back.
  for (int i = 0; i < 50 && kvtd->server().service()->inflight_requests() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::unique_ptr<LoadedMapper> mapper = Local("matched");
  HostCache source = testing::RandomHostCache(mapper->view().source, 8, DType::kFP32, Layout::kHND, 4);
  v1::TranslateHeader header;
  header.set_mapper_id("matched");
  EXPECT_TRUE(kvtd->client().Translate(header, source).ok());
}

TEST_F(TranslateServiceTest, ShutdownDrainsInFlightStreamsAndRefusesNewOnes) {
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_);
  std::unique_ptr<LoadedMapper> mapper = Local("matched");
  HostCache source = testing::RandomHostCache(mapper->view().source, 16, DType::kFP32, Layout::kHND, 5);

  RawStream inflight(kvtd->client());
  v1::TranslateKVRequest header = HeaderMessage(16);
  ASSERT_TRUE(inflight.stream->Write(header));
  v1::TranslateKVResponse response;
  ASSERT_TRUE(inflight.stream->Read(&response));

  std::thread stopper([&kvtd] { kvtd->server().Shutdown(); });
  // During the grace period: NOT_SERVING, and new translations are refused.
  std::string health;
  for (int i = 0; i < 100; ++i) {
    auto status = kvtd->client().Health();
    if (status.ok() && *status == "NOT_SERVING") {
      health = *status;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(health, "NOT_SERVING");
  {
    RawStream refused(kvtd->client());
    refused.stream->Write(HeaderMessage(16));
    grpc::Status status = refused.Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  }
  // The in-flight stream finishes normally.
  for (int layer = 0; layer < 3; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      v1::TranslateKVRequest chunk = ChunkMessage(
          layer, kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V, 0, 16);
      chunk.mutable_chunk()->set_data((kind == 0 ? source.k : source.v)[layer].data(),
                                      source.layer_bytes());
      ASSERT_TRUE(inflight.stream->Write(chunk));
    }
  }
  inflight.stream->WritesDone();
  bool trailer = false;
  while (inflight.stream->Read(&response)) trailer = trailer || response.has_trailer();
  EXPECT_TRUE(inflight.stream->Finish().ok());
  EXPECT_TRUE(trailer);
  stopper.join();
}

TEST_F(TranslateServiceTest, SharedMemoryAndCudaIpcAreOffByDefault) {
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_);
  grpc::ClientContext context;
  v1::RegisterSystemMemoryResponse response;
  grpc::Status status = kvtd->client().stub()->RegisterSystemMemory(
      &context, v1::RegisterSystemMemoryRequest(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("shared_memory.allow_client_regions"));
  grpc::ClientContext cuda_context;
  v1::RegisterCudaMemoryResponse cuda_response;
  EXPECT_EQ(kvtd->client()
                .stub()
                ->RegisterCudaMemory(&cuda_context, v1::RegisterCudaMemoryRequest(), &cuda_response)
                .error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

// --- ValidateKV and telemetry. ---

// One model's cache from [token][head][dim] doubles per layer and kind (fp32, HND).
HostCache FromDoubles(const ModelSpec& model, int64_t tokens, int heads,
                      const std::vector<std::vector<double>>& k,
                      const std::vector<std::vector<double>>& v) {
  HostCache cache = HostCache::Zeros(DType::kFP32, Layout::kHND, model.num_layers, heads,
                                     model.head_dim, tokens);
  for (int layer = 0; layer < model.num_layers; ++layer) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int h = 0; h < heads; ++h) {
        for (int d = 0; d < model.head_dim; ++d) {
          const int64_t at = CacheOffset(Layout::kHND, heads, tokens, model.head_dim, h, t, d);
          const size_t from = (t * heads + h) * model.head_dim + d;
          StoreFromDouble(DType::kFP32, cache.k[layer].data(), at, k[layer][from]);
          if (!v.empty()) StoreFromDouble(DType::kFP32, cache.v[layer].data(), at, v[layer][from]);
        }
      }
    }
  }
  return cache;
}

std::vector<double> Strip(const Rope& rope, std::vector<double> keys, const Positions& positions,
                          int64_t tokens, int heads, int dim) {
  for (int64_t t = 0; t < tokens; ++t) {
    for (int h = 0; h < heads; ++h) {
      testing::RotateDouble(rope, positions.at(t), true, &keys[(t * heads + h) * dim]);
    }
  }
  return keys;
}

void ExpectLayerNear(const v1::LayerQuality& got, const testing::QualityReference& want,
                     bool with_queries) {
  EXPECT_NEAR(got.r2_k(), want.r2_k, 1e-4);
  EXPECT_NEAR(got.r2_v(), want.r2_v, 1e-4);
  EXPECT_NEAR(got.cosine_k(), want.cosine_k, 1e-5);
  EXPECT_NEAR(got.cosine_v(), want.cosine_v, 1e-5);
  ASSERT_EQ(got.has_attention_cosine(), with_queries);
  if (!with_queries) return;
  EXPECT_NEAR(got.attention_cosine(), want.attention_cosine, 1e-4);
  EXPECT_NEAR(got.c_k(), want.c_k, 1e-3 * want.c_k);
  EXPECT_NEAR(got.c_v(), want.c_v, 1e-3 * want.c_v);
}

TEST_F(TranslateServiceTest, ValidateKvMatchesTheFloat64ReferenceAndFeedsTheQualityHistograms) {
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_);
  std::unique_ptr<LoadedMapper> mapper = Local("matched");
  const MapperView& view = mapper->view();
  const ModelSpec& target = view.target;
  const int64_t T = 24;
  const int heads = target.num_kv_heads, dim = target.head_dim, query_heads = 4;
  HostCache source = testing::RandomHostCache(view.source, T, DType::kFP32, Layout::kHND, 21);
  Positions positions;
  positions.offset = 300;
  // The target's "true" cache: the exact translation plus noise; random queries.
  std::mt19937_64 rng(22);
  std::normal_distribution<double> noise(0.0, 0.3);
  std::vector<std::vector<double>> mapped_k, mapped_v, true_k, true_v, queries;
  for (int layer = 0; layer < target.num_layers; ++layer) {
    mapped_k.push_back(testing::ReferenceTranslate(view, layer, testing::Kind::kK, source.view(),
                                                   positions));
    mapped_v.push_back(testing::ReferenceTranslate(view, layer, testing::Kind::kV, source.view(),
                                                   positions));
    true_k.push_back(mapped_k.back());
    true_v.push_back(mapped_v.back());
    for (double& x : true_k.back()) x = static_cast<float>(x + noise(rng));
    for (double& x : true_v.back()) x = static_cast<float>(x + noise(rng));
    queries.emplace_back(T * query_heads * dim);
    for (double& x : queries.back()) x = static_cast<float>(noise(rng) * 3);
  }
  const HostCache truth = FromDoubles(target, T, heads, true_k, true_v);
  const HostCache query_cache = FromDoubles(target, T, query_heads, queries, {});

  v1::ValidateHeader header;
  header.set_mapper_id("matched");
  header.set_position_offset(300);
  header.set_turn(3);
  header.set_request_id("validate-1");
  absl::StatusOr<v1::ValidateKVResponse> response =
      kvtd->client().Validate(header, source, truth, &query_cache);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->request_id(), "validate-1");
  EXPECT_EQ(response->mapper_id(), "matched");
  ASSERT_EQ(response->layers_size(), target.num_layers);
  const Rope rope = *Rope::Create(target.rope, dim);
  std::vector<uint64_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = positions.at(t);
  double attention_sum = 0;
  for (int layer = 0; layer < target.num_layers; ++layer) {
    SCOPED_TRACE(layer);
    const testing::QualityReference want = testing::RefQuality(
        mapped_k[layer], mapped_v[layer], true_k[layer], true_v[layer],
        Strip(rope, mapped_k[layer], positions, T, heads, dim),
        Strip(rope, true_k[layer], positions, T, heads, dim), queries[layer], pos, T, heads, dim,
        query_heads);
    EXPECT_EQ(response->layers(layer).layer(), static_cast<uint32_t>(layer));
    ExpectLayerNear(response->layers(layer), want, true);
    if (layer > 0) attention_sum += want.attention_cosine;
  }
  EXPECT_NEAR(response->overall_without_layer0().attention_cosine(),
              attention_sum / (target.num_layers - 1), 1e-4);
  EXPECT_GT(response->overall().r2_k(), 0.0);
  EXPECT_LT(response->overall().r2_k(), 1.0);

  // Without queries: no attention metrics. The true cache equal to the translation: 1 and 1.
  const HostCache exact = FromDoubles(target, T, heads, mapped_k, mapped_v);
  absl::StatusOr<v1::ValidateKVResponse> identical = kvtd->client().Validate(header, source, exact);
  ASSERT_TRUE(identical.ok()) << identical.status();
  EXPECT_NEAR(identical->overall().cosine_k(), 1.0, 1e-6);
  EXPECT_NEAR(identical->overall().cosine_v(), 1.0, 1e-6);
  EXPECT_NEAR(identical->overall().r2_k(), 1.0, 1e-6);
  EXPECT_NEAR(identical->overall().r2_v(), 1.0, 1e-6);
  EXPECT_FALSE(identical->overall().has_attention_cosine());

  const std::string metrics = kvtd->server().metrics()->Serialize();
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_validate_requests_total{code="OK",source="test/src",target="test/dst"} 2)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_quality_attention_cosine_count{source="test/src",target="test/dst",turn="3"} 1)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_quality_kv_cosine_count{kind="k",source="test/src",target="test/dst",turn="3"} 2)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_quality_r2_bucket{kind="v",source="test/src",target="test/dst",turn="3",le="1"} 2)"));
}

v1::ValidateKVRequest ValidateHeaderMessage(int tokens, int query_heads = 0) {
  v1::ValidateKVRequest request;
  v1::ValidateHeader* header = request.mutable_header();
  header->set_mapper_id("matched");
  header->set_dtype(v1::DTYPE_FP32);
  header->set_layout(v1::LAYOUT_HND);
  header->set_num_tokens(tokens);
  header->set_num_query_heads(query_heads);
  return request;
}

v1::ValidateKVRequest ValidateChunkMessage(v1::ValidateRole role, int layer, v1::CacheKind kind,
                                           int count, int heads = 2) {
  v1::ValidateKVRequest request;
  request.mutable_chunk()->set_role(role);
  *request.mutable_chunk()->mutable_chunk() =
      ChunkMessage(layer, kind, 0, count, heads * 16 * 4).chunk();
  return request;
}

TEST_F(TranslateServiceTest, ValidateKvRejectsMalformedStreamsNamingTheField) {
  KvtdConfig config;
  config.limits.max_tokens = 100;
  std::unique_ptr<InProcessKvtd> kvtd = Serve(*store_dir_, config);
  const auto S = v1::VALIDATE_ROLE_SOURCE, R = v1::VALIDATE_ROLE_TARGET_TRUE,
             Q = v1::VALIDATE_ROLE_TARGET_QUERY;
  std::vector<v1::ValidateKVRequest> missing_truth = {ValidateHeaderMessage(8)};
  for (int layer = 0; layer < 3; ++layer) {
    missing_truth.push_back(ValidateChunkMessage(S, layer, v1::CACHE_KIND_K, 8));
    missing_truth.push_back(ValidateChunkMessage(S, layer, v1::CACHE_KIND_V, 8));
  }
  struct Case {
    std::string name;
    std::vector<v1::ValidateKVRequest> messages;
    grpc::StatusCode code;
    std::string message_part;
  };
  const std::vector<Case> cases = {
      {"no header", {}, grpc::StatusCode::INVALID_ARGUMENT, "before its header"},
      {"too many tokens", {ValidateHeaderMessage(101)}, grpc::StatusCode::RESOURCE_EXHAUSTED,
       "limits.max_tokens"},
      {"query heads not a multiple", {ValidateHeaderMessage(8, 3)},
       grpc::StatusCode::INVALID_ARGUMENT, "header.num_query_heads=3"},
      {"role unset",
       {ValidateHeaderMessage(8),
        ValidateChunkMessage(v1::VALIDATE_ROLE_UNSPECIFIED, 0, v1::CACHE_KIND_K, 8)},
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.role"},
      {"queries not declared",
       {ValidateHeaderMessage(8), ValidateChunkMessage(Q, 0, v1::CACHE_KIND_K, 8)},
       grpc::StatusCode::INVALID_ARGUMENT, "header.num_query_heads=0"},
      {"query values",
       {ValidateHeaderMessage(8, 4), ValidateChunkMessage(Q, 0, v1::CACHE_KIND_V, 8, 4)},
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.chunk.kind must be CACHE_KIND_K"},
      {"query bytes",
       {ValidateHeaderMessage(8, 4), ValidateChunkMessage(Q, 0, v1::CACHE_KIND_K, 8, 2)},
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.chunk.data has 1024 bytes, expected 2048"},
      {"target layer out of range",
       {ValidateHeaderMessage(8), ValidateChunkMessage(R, 4, v1::CACHE_KIND_K, 8)},
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.chunk.layer=4 out of range: target model test/dst"},
      {"duplicate target chunk",
       {ValidateHeaderMessage(8), ValidateChunkMessage(R, 1, v1::CACHE_KIND_V, 8),
        ValidateChunkMessage(R, 1, v1::CACHE_KIND_V, 8)},
       grpc::StatusCode::INVALID_ARGUMENT, "TARGET_TRUE chunk layer=1 kind=V"},
      {"truth missing", missing_truth, grpc::StatusCode::INVALID_ARGUMENT,
       "before every TARGET_TRUE chunk arrived: layer 0 K: tokens [0, 8) missing"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ValidateKVResponse response;
    auto writer = kvtd->client().stub()->ValidateKV(&context, &response);
    for (const v1::ValidateKVRequest& message : c.messages) {
      if (!writer->Write(message)) break;
    }
    writer->WritesDone();
    grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message_part));
  }
  EXPECT_EQ(kvtd->server().service()->inflight_requests(), 0);
  const std::string metrics = kvtd->server().metrics()->Serialize();
  // Failures before the mapper is known count under the fixed "unknown" pair.
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_validate_requests_total{code="INVALID_ARGUMENT",source="unknown",target="unknown"} 1)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_validate_requests_total{code="INVALID_ARGUMENT",source="test/src",target="test/dst"} 8)"));
}

TEST_F(TranslateServiceTest, TrailerCarriesInputShiftAndSpeedupAndMetricsCountEveryOutcome) {
  // A store of its own: a mapper with calibration statistics N(0, 1) for every feature.
  const std::string store = MakeTempDir("shift-store");
  SynthOptions options;
  options.source = NeoxModelSpec("shift/src", 2, 2, 16, 10000);
  options.target = NeoxModelSpec("shift/dst", 2, 2, 16, 10000);
  options.k = 1;
  options.dtype = DType::kFP32;
  options.seed = 9;
  ASSERT_TRUE(testing::WriteSynthMapperWithStats(
                  store + "/with-stats", options,
                  [](int, bool, int, bool variance) { return variance ? 1.0 : 0.0; })
                  .ok());
  options.target.name = "shift/other";
  ASSERT_TRUE(WriteSynthMapper(store + "/no-stats", options).ok());
  KvtdConfig config;
  config.metrics.prefill_cost["shift/dst"] = {5000.0, 0.0, 0.0};  // 5 s, whatever the length
  config.metrics.listen_address = "127.0.0.1:0";
  std::unique_ptr<InProcessKvtd> kvtd = Serve(store, config);
  ASSERT_GT(kvtd->server().metrics_port(), 0);

  // Random N(0, 1) caches are in distribution: keys stay N(0, 1) in content space (a rotation
  // of an isotropic Gaussian). Three times the scale: about 9.
  HostCache source = testing::RandomHostCache(options.source, 300, DType::kFP32, Layout::kNHD, 31);
  v1::TranslateHeader header;
  header.set_mapper_id("with-stats");
  absl::StatusOr<TranslateResult> result = kvtd->client().Translate(header, source);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE(result->trailer.has_input_shift_score());
  EXPECT_NEAR(result->trailer.input_shift_score(), 1.0, 0.1);
  EXPECT_NEAR(result->trailer.speedup_estimate(),
              5000.0 / result->trailer.timings().total_ms(), 1e-6);
  for (std::vector<char>* layer : {&source.k[0], &source.k[1], &source.v[0], &source.v[1]}) {
    float* values = reinterpret_cast<float*>(layer->data());
    for (size_t i = 0; i < layer->size() / sizeof(float); ++i) values[i] *= 3;
  }
  header.set_reprefill_estimate_ms(1e6);  // the request's estimate wins over the config's
  result = kvtd->client().Translate(header, source);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_NEAR(result->trailer.input_shift_score(), 9.0, 1.0);
  EXPECT_NEAR(result->trailer.speedup_estimate(),
              1e6 / result->trailer.timings().total_ms(), 1e-3);

  // No statistics: no score; no cost model for shift/other: no speedup.
  header.Clear();
  header.set_mapper_id("no-stats");
  result = kvtd->client().Translate(header, source);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FALSE(result->trailer.has_input_shift_score());
  EXPECT_EQ(result->trailer.speedup_estimate(), 0.0);
  // A client-chosen pair name never becomes a label value.
  header.set_mapper_id("");
  header.set_source_model("attacker/label-1");
  header.set_target_model("attacker/label-2");
  EXPECT_EQ(kvtd->client().Translate(header, source).status().code(), absl::StatusCode::kNotFound);

  absl::StatusOr<testing::HttpResponse> scraped =
      testing::HttpGet("127.0.0.1", kvtd->server().metrics_port(), "/metrics");
  ASSERT_TRUE(scraped.ok()) << scraped.status();
  const std::string& text = scraped->body;
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_requests_total{code="OK",source="shift/src",target="shift/dst"} 2)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_requests_total{code="OK",source="shift/src",target="shift/other"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_requests_total{code="NOT_FOUND",source="unknown",target="unknown"} 1)"));
  EXPECT_THAT(text, Not(HasSubstr("attacker")));
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_tokens_total{source="shift/src",target="shift/dst"} 600)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_input_shift_score_count{source="shift/src",target="shift/dst"} 2)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_speedup_ratio_count{device="cpu",source="shift/src",target="shift/dst"} 2)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_duration_seconds_count{device="cpu",source="shift/src",stage="compute",target="shift/dst"} 2)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_backend_info{backend="cpu",device="cpu",requested="auto"} 1)"));
  EXPECT_THAT(text, HasSubstr("kvt_inflight_requests 0"));
}

}  // namespace
}  // namespace kvt
