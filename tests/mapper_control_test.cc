// Model control and paging through kvtd's gRPC surface, in process: a real server on port 0
// with a store set up as kvtd sets it up (budgets, the CPU backend as device, polling), real
// mapper directories, bearer tokens for the admin role, translations checked against the
// float64 reference (also for a request that was in flight across a hot reload).
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

namespace kvt {
namespace {

using ::testing::HasSubstr;

constexpr char kAdmin[] = "admin-token-abcdefghijk";
constexpr char kRouter[] = "router-token-0123456789";

SynthOptions Pair(const std::string& source, const std::string& target, uint64_t seed) {
  SynthOptions o;
  o.source = NeoxModelSpec(source, 3, 2, 16);
  o.target = NeoxModelSpec(target, 2, 2, 16);
  o.k = 2;
  o.dtype = DType::kBF16;
  o.seed = seed;
  return o;
}

// An fp32 NHD cache of `model`'s shape (what these tests send).
HostCache RandomCache(const ModelSpec& model, int64_t tokens, uint64_t seed) {
  return testing::RandomHostCache(model, tokens, DType::kFP32, Layout::kNHD, seed);
}

// Max relative error of `target` against the float64 reference of the mapper in `dir`.
double ErrorAgainst(const std::string& dir, const HostCache& source, const HostCache& target,
                    uint64_t offset) {
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(dir);
  EXPECT_TRUE(mapper.ok()) << mapper.status();
  return testing::MaxErrorAgainstReference((*mapper)->view(), source.view(), target.view(),
                                           Positions{offset});
}

class MapperControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("control");
    store_dir_ = JoinPath(dir_, "store");
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(store_dir_, "ab"), Pair("m/a", "m/b", 1)));
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(store_dir_, "cd"), Pair("m/c", "m/d", 2)));
    KVT_ASSERT_OK(WriteStringToFile(JoinPath(dir_, "tokens"),
                                    absl::StrCat(kRouter, " client\n", kAdmin, " admin\n")));
  }

  // Starts kvtd the way kvtd_main does: store options from the config, polling, the server.
  void Start(KvtdConfig config) {
    config.security.auth_token_file = JoinPath(dir_, "tokens");
    InProcessKvtdOptions options;
    // The sgemm path, so versions compare against the float64 reference at 1e-5 (the oneDNN
    // bf16 path's 1e-2 is tested in kernels/cpu_backend_test).
    options.backend = NewCpuBackend(CpuBackendOptions{1, 64, CpuGemmPath::kSgemm});
    options.store_as_kvtd_main = true;
    options.client.bearer_token = kRouter;
    kvtd_ = StartKvtdForTest(store_dir_, config, std::move(options));
    ASSERT_NE(kvtd_, nullptr);
    ClientOptions admin;
    admin.bearer_token = kAdmin;
    admin_ = kvtd_->NewClient(admin);
    router_ = &kvtd_->client();
  }

  grpc::Status Load(Client& client, const std::string& id, const std::string& device,
                    v1::MapperInfo* info = nullptr) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", &client == admin_.get()
                                                                     ? kAdmin
                                                                     : kRouter));
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::LoadMapperRequest request;
    request.set_mapper_id(id);
    request.set_device(device);
    v1::LoadMapperResponse response;
    grpc::Status status = client.stub()->LoadMapper(&context, request, &response);
    if (info != nullptr) *info = response.mapper();
    return status;
  }
  grpc::Status Unload(Client& client, const std::string& id, const std::string& device,
                      v1::MapperInfo* info = nullptr,
                      std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", &client == admin_.get()
                                                                     ? kAdmin
                                                                     : kRouter));
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    v1::UnloadMapperRequest request;
    request.set_mapper_id(id);
    request.set_device(device);
    v1::UnloadMapperResponse response;
    grpc::Status status = client.stub()->UnloadMapper(&context, request, &response);
    if (info != nullptr) *info = response.mapper();
    return status;
  }
  v1::MapperInfo Get(const std::string& id) {
    absl::StatusOr<v1::MapperInfo> info = router_->GetMapper(id);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : v1::MapperInfo();
  }
  absl::StatusOr<TranslateResult> Translate(const std::string& source, const std::string& target,
                                            const HostCache& cache) {
    v1::TranslateHeader header;
    header.set_source_model(source);
    header.set_target_model(target);
    header.set_position_offset(5);
    return router_->Translate(header, cache);
  }

  std::string dir_, store_dir_;
  std::unique_ptr<InProcessKvtd> kvtd_;
  std::unique_ptr<Client> admin_;
  Client* router_ = nullptr;  // kvtd_'s client
};

TEST_F(MapperControlTest, LoadUnloadAndGetMapperReportStateResidencyAndCounters) {
  KvtdConfig config;
  config.mapper_store.load_on_scan = false;
  config.mapper_store.reload_interval_seconds = 0;
  Start(config);

  EXPECT_EQ(Get("ab").state(), v1::MAPPER_STATE_DISCOVERED);
  EXPECT_GT(Get("ab").weight_bytes(), 0u);  // what a load will take
  // Admin only.
  EXPECT_EQ(Load(*router_, "ab", "").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Unload(*router_, "ab", "").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // Bad requests name the field.
  grpc::Status bad = Load(*admin_, "", "");
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("mapper_id"));
  bad = Load(*admin_, "ab", "cuda:9");
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("device='cuda:9' is not a device of this server"));
  EXPECT_EQ(Load(*admin_, "zz", "").error_code(), grpc::StatusCode::NOT_FOUND);

  v1::MapperInfo info;
  ASSERT_TRUE(Load(*admin_, "ab", "host", &info).ok());
  EXPECT_EQ(info.state(), v1::MAPPER_STATE_HOST_RESIDENT);
  EXPECT_EQ(info.loads(), 1u);
  ASSERT_EQ(info.residency_size(), 1);
  EXPECT_EQ(info.residency(0).device(), "host");
  EXPECT_EQ(info.residency(0).bytes(), info.weight_bytes());
  EXPECT_EQ(info.generation(), 1);

  ASSERT_TRUE(Load(*admin_, "ab", "cpu", &info).ok());
  EXPECT_EQ(info.state(), v1::MAPPER_STATE_DEVICE_RESIDENT);
  EXPECT_THAT(info.devices(), ::testing::ElementsAre("host", "cpu"));
  ASSERT_EQ(info.residency_size(), 2);
  EXPECT_EQ(info.residency(1).bytes(), 2 * info.weight_bytes());  // bf16 -> fp32
  EXPECT_TRUE(info.residency(1).ready());
  EXPECT_EQ(info.page_ins(), 1u);

  // A translation uses the resident copy: a hit, no new page-in, reference-exact.
  const HostCache source = RandomCache(NeoxModelSpec("m/a", 3, 2, 16), 9,
                                       testing::FreshSeed("control translate"));
  absl::StatusOr<TranslateResult> result = Translate("m/a", "m/b", source);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->header.device(), "cpu");
  EXPECT_LE(ErrorAgainst(JoinPath(store_dir_, "ab"), source, result->target, 5),
            testing::TranslationTolerance(DType::kFP32));
  info = Get("ab");
  EXPECT_EQ(info.page_ins(), 1u);
  EXPECT_EQ(info.hits(), 3u);  // two loads and the translation
  EXPECT_GT(info.last_used_unix_ms(), 0);

  ASSERT_TRUE(Unload(*admin_, "ab", "cpu", &info).ok());
  EXPECT_EQ(info.state(), v1::MAPPER_STATE_HOST_RESIDENT);
  ASSERT_TRUE(Unload(*admin_, "ab", "", &info).ok());
  EXPECT_EQ(info.state(), v1::MAPPER_STATE_DISCOVERED);
  EXPECT_EQ(info.residency_size(), 0);

  // A request for an unloaded mapper loads it again (a miss), and still translates exactly.
  result = Translate("m/a", "m/b", source);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LE(ErrorAgainst(JoinPath(store_dir_, "ab"), source, result->target, 5),
            testing::TranslationTolerance(DType::kFP32));
  EXPECT_EQ(Get("ab").loads(), 2u);
  EXPECT_EQ(Get("ab").page_ins(), 2u);

  const std::string metrics = kvtd_->server().metrics()->Serialize();
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_mapper_page_ins_total{device="cpu",source="m/a",target="m/b"} 2)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_mapper_page_ins_total{device="host",source="m/a",target="m/b"} 2)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_mapper_acquisitions_total{device="cpu",result="hit",source="m/a",target="m/b"} 1)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_mapper_acquisitions_total{device="cpu",result="miss",source="m/a",target="m/b"} 2)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_mapper_page_in_duration_seconds_count{device="cpu",source="m/a",target="m/b"} 2)"));
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_mapper_tier_bytes{device="cpu",kind="used"} )"));
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat(
                           R"(kvt_mapper_device_resident_bytes{device="cpu",mapper="ab",source="m/a",target="m/b"} )",
                           2 * Get("ab").weight_bytes())));
}

TEST_F(MapperControlTest, AnInFlightRequestFinishesOnItsVersionAcrossAHotReload) {
  KvtdConfig config;
  config.mapper_store.reload_interval_seconds = 0.02;
  Start(config);
  const std::string ab = JoinPath(store_dir_, "ab");
  const std::string old_copy = JoinPath(dir_, "ab-v1");
  KVT_ASSERT_OK(WriteSynthMapper(old_copy, Pair("m/a", "m/b", 1)));  // the reference of v1

  const HostCache source = RandomCache(NeoxModelSpec("m/a", 3, 2, 16), 7,
                                       testing::FreshSeed("in-flight reload"));
  v1::TranslateHeader header;
  header.set_mapper_id("ab");
  header.set_position_offset(5);
  absl::StatusOr<std::unique_ptr<TranslateStream>> stream = router_->StartTranslate(header, source);
  ASSERT_TRUE(stream.ok()) << stream.status();
  // The server has the header (and pinned version 1) once the copy shows this request's pin
  // alone: while the page-in worker runs, it holds a second pin of its own.
  for (int i = 0; i < 1000 && (Get("ab").residency_size() == 0 || Get("ab").residency(0).pins() != 1);
       ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(Get("ab").residency(0).pins(), 1u);

  // The directory changes; the poller loads version 2 beside version 1 and swaps it in.
  WriteOptions overwrite;
  overwrite.overwrite = true;
  KVT_ASSERT_OK(WriteSynthMapper(ab, Pair("m/a", "m/b", 77), overwrite));
  for (int i = 0; i < 1000 && Get("ab").generation() < 2; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(Get("ab").generation(), 2);

  // A new request gets version 2 ...
  absl::StatusOr<TranslateResult> fresh = Translate("m/a", "m/b", source);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_LE(ErrorAgainst(ab, source, fresh->target, 5),
            testing::TranslationTolerance(DType::kFP32));
  EXPECT_GT(ErrorAgainst(old_copy, source, fresh->target, 5), 0.1);

  // ... and the one in flight finishes on version 1.
  for (int l = 0; l < source.num_layers; ++l) {
    KVT_ASSERT_OK((*stream)->PushLayer(l, source.k[l].data(), source.v[l].data()));
  }
  absl::StatusOr<TranslateResult> in_flight = (*stream)->Finish();
  ASSERT_TRUE(in_flight.ok()) << in_flight.status();
  EXPECT_LE(ErrorAgainst(old_copy, source, in_flight->target, 5),
            testing::TranslationTolerance(DType::kFP32));
  EXPECT_GT(ErrorAgainst(ab, source, in_flight->target, 5), 0.1);

  // Corrupt: FAILED with the reason over gRPC, and requests are refused, not served stale.
  {
    const std::string weights = JoinPath(ab, kDefaultWeightsFileName);
    std::string bytes = *ReadFileToString(weights);
    bytes[bytes.size() / 2] ^= 0x01;
    // Replaced in one step (staged outside the store, then renamed over it): written in place,
    // the poller could see the truncated file first, fail on it, then reload on the final
    // write, and the state would pass through LOADING after the wait below saw FAILED.
    const std::string staged = store_dir_ + ".corrupt-weights";
    KVT_ASSERT_OK(WriteStringToFile(staged, bytes));
    ASSERT_EQ(std::rename(staged.c_str(), weights.c_str()), 0) << std::strerror(errno);
  }
  for (int i = 0; i < 1000 && Get("ab").state() != v1::MAPPER_STATE_FAILED; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Get("ab").state(), v1::MAPPER_STATE_FAILED);
  EXPECT_THAT(Get("ab").state_reason(), HasSubstr("checksum mismatch"));
  absl::StatusOr<TranslateResult> refused = Translate("m/a", "m/b", source);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("mapper 'ab' for this pair FAILED"));

  // Removed: gone from the listing.
  KVT_ASSERT_OK(RemoveTree(JoinPath(store_dir_, "cd")));
  for (int i = 0; i < 1000 && router_->GetMapper("cd").ok(); ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(router_->GetMapper("cd").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(MapperControlTest, PinnedMappersFillingTheHostBudgetGiveResourceExhaustedAfterTheWait) {
  KvtdConfig config;
  config.mapper_store.reload_interval_seconds = 0;
  config.mapper_store.load_on_scan = false;
  absl::StatusOr<std::unique_ptr<LoadedMapper>> probe = LoadMapperDir(JoinPath(store_dir_, "ab"));
  ASSERT_TRUE(probe.ok());
  config.mapper_store.host_budget_bytes = (*probe)->weight_bytes() * 3 / 2;  // one mapper
  config.mapper_store.device_budget_bytes = int64_t{1} << 30;
  config.mapper_store.acquire_timeout_seconds = 0.2;
  Start(config);

  const HostCache source = RandomCache(NeoxModelSpec("m/a", 3, 2, 16), 4, 1);
  v1::TranslateHeader header;
  header.set_mapper_id("ab");
  absl::StatusOr<std::unique_ptr<TranslateStream>> stream = router_->StartTranslate(header, source);
  ASSERT_TRUE(stream.ok());
  for (int i = 0; i < 1000 && (Get("ab").residency_size() == 0 || Get("ab").residency(0).pins() == 0);
       ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const HostCache other = RandomCache(NeoxModelSpec("m/c", 3, 2, 16), 4, 2);
  const absl::Time before = absl::Now();
  absl::StatusOr<TranslateResult> refused = Translate("m/c", "m/d", other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("mapper_store.host_budget_bytes"));
  EXPECT_GE(absl::Now() - before, absl::Milliseconds(190));

  // Unload of the pinned mapper waits for the stream, bounded by the call's deadline.
  grpc::Status pinned = Unload(*admin_, "ab", "", nullptr, std::chrono::milliseconds(100));
  EXPECT_EQ(pinned.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  for (int l = 0; l < source.num_layers; ++l) {
    KVT_ASSERT_OK((*stream)->PushLayer(l, source.k[l].data(), source.v[l].data()));
  }
  ASSERT_TRUE((*stream)->Finish().ok());
  // The pin is gone (and ab was unloaded): cd fits now.
  absl::StatusOr<TranslateResult> served = Translate("m/c", "m/d", other);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_LE(ErrorAgainst(JoinPath(store_dir_, "cd"), other, served->target, 5),
            testing::TranslationTolerance(DType::kFP32));
}

}  // namespace
}  // namespace kvt
