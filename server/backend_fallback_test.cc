// kvtd in process, backend.type auto, on a machine that reports one GPU whose engine fails its
// start-up self-check: the daemon starts on the CPU backend and /metrics says what happened.
#include <cstdlib>
#include <memory>
#include <string>

#include "common/testing/http_get.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "mapper_store/store.h"
#include "server/backend_select.h"
#include "server/config.h"
#include "server/faulty_backend.h"
#include "server/kvtd_server.h"

namespace kvt {
namespace {

using ::kvt::testing::Fault;
using ::kvt::testing::FaultyBackendOptions;
using ::kvt::testing::NewFaultyBackend;
using ::testing::HasSubstr;

TEST(BackendFallbackTest, AutoServesOnCpuAndExportsTheFailedSelfCheck) {
  KvtdConfig config;
  config.backend.type = "auto";
  config.backend.cpu_threads = 1;
  config.server.listen_address = "127.0.0.1:0";
  config.metrics.listen_address = "127.0.0.1:0";
  config.mapper_store.path = std::getenv("TEST_TMPDIR");
  config.shutdown.drain_grace_seconds = 0;
  config.shutdown.deadline_seconds = 1;

  BackendFactories factories;
  factories.device_count = [] { return absl::StatusOr<int>(1); };
  factories.new_cuda = [](const CudaBackendOptions&) {
    FaultyBackendOptions options;
    options.fault = Fault::kPerturb;  // a kernel that returns OK with a wrong number
    return absl::StatusOr<std::unique_ptr<Backend>>(
        NewFaultyBackend(NewCpuBackend(CpuBackendOptions{1, 512}), options));
  };
  absl::StatusOr<SelectedBackend> selected = SelectBackend(config.backend, factories);
  ASSERT_TRUE(selected.ok()) << selected.status();
  ASSERT_EQ(selected->backend->name(), "cpu");

  absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(config.mapper_store.path);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::unique_ptr<KvtdServer>> server =
      KvtdServer::Start(config, store->get(), selected->backend.get());
  ASSERT_TRUE(server.ok()) << server.status();
  ExportSelfChecks(selected->self_checks, (*server)->metrics());

  absl::StatusOr<kvt::testing::HttpResponse> scrape =
      kvt::testing::HttpGet("127.0.0.1", (*server)->metrics_port(), "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_EQ(scrape->status, 200);
  EXPECT_THAT(scrape->body,
              HasSubstr(R"(kvt_backend_info{backend="cpu",device="cpu",requested="auto"} 1)"));
  EXPECT_THAT(scrape->body,
              HasSubstr(R"(kvt_backend_self_check{backend="cpu",device="cpu",result="pass"} 1)"));
  EXPECT_THAT(
      scrape->body,
      HasSubstr(R"(kvt_backend_self_check{backend="cuda",device="cuda:0",result="mismatch"} 1)"));
  (*server)->Shutdown();
}

}  // namespace
}  // namespace kvt
