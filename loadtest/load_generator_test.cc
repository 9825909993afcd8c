#include "loadtest/load_generator.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "server/kvtd_server.h"

namespace kvt {
namespace load {
namespace {

class LoadGeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    store_dir_ = absl::StrCat(tmp ? tmp : "/tmp", "/load_store");
    ASSERT_EQ(std::system(("rm -rf " + store_dir_ + " && mkdir -p " + store_dir_).c_str()), 0);
    absl::StatusOr<SynthOptions> preset = SynthPreset("demo-tiny");
    ASSERT_TRUE(preset.ok());
    ASSERT_TRUE(WriteSynthMapper(store_dir_ + "/demo-tiny", *preset).ok());
    absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(store_dir_);
    ASSERT_TRUE(store.ok());
    store_ = std::move(*store);
    backend_ = NewCpuBackend();
    KvtdConfig config;
    config.server.listen_address = "127.0.0.1:0";
    config.shutdown.drain_grace_seconds = 0;
    config.limits.max_inflight_requests = 2;
    absl::StatusOr<std::unique_ptr<KvtdServer>> server =
        KvtdServer::Start(config, store_.get(), backend_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", server_->port()); }

  std::string store_dir_;
  std::unique_ptr<MapperStore> store_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<KvtdServer> server_;
};

TEST_F(LoadGeneratorTest, ClosedLoopHonoursTheRequestBudget) {
  LoadOptions options;
  options.server = address();
  options.concurrency = 2;
  options.duration_s = 0;
  options.max_requests = 20;
  options.mix = {{"demo-tiny", 64, 1.0}, {"demo-tiny", 300, 1.0}};
  options.server_pid = getpid();  // the server runs in this process
  absl::StatusOr<LoadResult> result = RunLoad(options);
  ASSERT_TRUE(result.ok()) << result.status();
  const Summary summary = Summarize(result->samples, result->duration_s);
  EXPECT_EQ(summary.requests, 20);
  EXPECT_EQ(summary.ok, 20) << SummaryTable(summary);
  EXPECT_GT(summary.p50_ms, 0);
  EXPECT_LE(summary.p50_ms, summary.p99_ms);
  EXPECT_GT(summary.tokens_per_s, 0);
  ASSERT_FALSE(result->resources.empty());
  EXPECT_GT(result->resources.front().rss_kib, 0);
  EXPECT_GT(result->resources.front().open_fds, 0);
}

TEST_F(LoadGeneratorTest, OpenLoopOverloadIsReportedByCode) {
  LoadOptions options;
  options.server = address();
  options.mode = LoopMode::kOpen;
  options.rate = 400;      // far above what 2 admitted requests at a time can serve
  options.concurrency = 8; // so requests beyond the admission limit get RESOURCE_EXHAUSTED
  options.duration_s = 0.5;
  options.mix = {{"demo-tiny", 2048, 1.0}};
  absl::StatusOr<LoadResult> result = RunLoad(options);
  ASSERT_TRUE(result.ok()) << result.status();
  const Summary summary = Summarize(result->samples, result->duration_s);
  EXPECT_GT(summary.requests, 50);
  EXPECT_GT(summary.ok, 0);
  for (const auto& [code, count] : summary.errors_by_code) {
    EXPECT_EQ(code, "RESOURCE_EXHAUSTED") << count;
  }
}

TEST(ParseMixTest, EntriesAndErrors) {
  absl::StatusOr<std::vector<WorkloadItem>> mix = ParseMix("a:128:3,b:4096,c");
  ASSERT_TRUE(mix.ok());
  ASSERT_EQ(mix->size(), 3u);
  EXPECT_EQ((*mix)[0].tokens, 128);
  EXPECT_EQ((*mix)[0].weight, 3);
  EXPECT_EQ((*mix)[1].tokens, 4096);
  EXPECT_EQ((*mix)[2].tokens, 512);
  EXPECT_FALSE(ParseMix("a:zero").ok());
  EXPECT_FALSE(ParseMix("a:1:-2").ok());
  EXPECT_FALSE(ParseMix(":5").ok());
}

TEST_F(LoadGeneratorTest, UnknownMapperInMixIsNotFound) {
  LoadOptions options;
  options.server = address();
  options.max_requests = 1;
  options.mix = {{"nope", 64, 1.0}};
  EXPECT_EQ(RunLoad(options).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace load
}  // namespace kvt
