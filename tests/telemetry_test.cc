// Telemetry end to end: kvtd as a real process with its metrics endpoint on a free port, real
// TranslateKV / ValidateKV traffic, `promtool check metrics` on the exposition, and a real
// Prometheus server (Debian's /usr/bin/prometheus) on loopback scraping it, read back through
// Prometheus' HTTP query API. Both processes are killed and reaped when the test ends.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/testing/http_get.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "mapper_store/synth.h"
#include "nlohmann/json.hpp"
#include "tests/kvtd_process.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;
using test::Clock;
using test::KvtdProcess;
using test::milliseconds;

constexpr char kPrometheus[] = "/usr/bin/prometheus";
constexpr char kPromtool[] = "/usr/bin/promtool";
constexpr int64_t kTokens = 64;

// A port nothing listens on right now (Prometheus cannot be told to pick one itself).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

HostCache RandomCache(int layers, int heads, int head_dim, uint64_t seed) {
  HostCache cache =
      HostCache::Zeros(DType::kBF16, Layout::kHND, layers, heads, head_dim, kTokens);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  for (int l = 0; l < layers; ++l) {
    for (int64_t i = 0; i < cache.layer_bytes() / 2; ++i) {
      StoreFromDouble(DType::kBF16, cache.k[l].data(), i, normal(rng));
      StoreFromDouble(DType::kBF16, cache.v[l].data(), i, normal(rng));
    }
  }
  return cache;
}

// The single value of an instant query, or nullopt while Prometheus has no such series yet.
std::optional<double> QueryValue(int port, const std::string& promql) {
  absl::StatusOr<testing::HttpResponse> response =
      testing::HttpGet("127.0.0.1", port, "/api/v1/query?query=" + testing::UrlEncode(promql));
  if (!response.ok() || response->status != 200) return std::nullopt;
  const nlohmann::json body = nlohmann::json::parse(response->body, nullptr, false);
  if (body.is_discarded() || body.value("status", "") != "success") return std::nullopt;
  const nlohmann::json& result = body["data"]["result"];
  if (!result.is_array() || result.size() != 1) return std::nullopt;
  return std::stod(result[0]["value"][1].get<std::string>());
}

// Polls until the query returns `want` (scrapes arrive every 500 ms); returns the last value.
std::optional<double> WaitForValue(int port, const std::string& promql, double want,
                                   milliseconds timeout = milliseconds(20000)) {
  const Clock::time_point end = Clock::now() + timeout;
  std::optional<double> value;
  do {
    value = QueryValue(port, promql);
    if (value.has_value() && std::abs(*value - want) < 1e-9) break;
    std::this_thread::sleep_for(milliseconds(200));
  } while (Clock::now() < end);
  return value;
}

TEST(TelemetryTest, PrometheusScrapesKvtdAndReadsBackWhatTheTrafficDid) {
  ASSERT_EQ(access(kPrometheus, X_OK), 0) << kPrometheus << " missing: run scripts/bootstrap.sh";
  const std::string dir = test::MakeDir("telemetry");
  absl::StatusOr<SynthOptions> preset = SynthPreset("demo-tiny");
  ASSERT_TRUE(preset.ok()) << preset.status();
  ASSERT_TRUE(WriteSynthMapper(dir + "/store/demo-tiny", *preset).ok());
  // The target model's re-prefill cost model, so every translation reports a speedup.
  const std::string config = test::WriteFile(
      dir + "/kvtd.yaml", absl::StrCat("metrics:\n  prefill_cost:\n    \"",
                                       preset->target.name, "\": {a: 50, b: 0.1, c: 0}\n"));
  KvtdProcess kvtd("kvtd", {"--config=" + config, "--listen_address=127.0.0.1:0",
                            "--metrics_listen_address=127.0.0.1:0",
                            "--mapper_store=" + dir + "/store", "--backend=cpu",
                            "--cpu_threads=2", "--drain_grace_seconds=0"});
  const int port = kvtd.WaitForPort();
  ASSERT_GT(port, 0);
  // Logged just after "listening": wait for it too.
  const std::optional<nlohmann::json> metrics_line = kvtd.WaitForLogLine("metrics listening");
  ASSERT_TRUE(metrics_line.has_value()) << kvtd.Stderr();
  const int metrics_port = metrics_line->value("port", 0);
  ASSERT_GT(metrics_port, 0);

  // Traffic: three translations, one refused pair, two validations at turn 2.
  std::unique_ptr<Client> client = Client::Create(absl::StrCat("127.0.0.1:", port));
  const ModelSpec& src = preset->source;
  const ModelSpec& tgt = preset->target;
  HostCache source = RandomCache(src.num_layers, src.num_kv_heads, src.head_dim, 1);
  v1::TranslateHeader header;
  header.set_mapper_id("demo-tiny");
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<TranslateResult> result = client->Translate(header, source);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_GT(result->trailer.speedup_estimate(), 0.0);
  }
  v1::TranslateHeader unknown;
  unknown.set_source_model("nobody/a");
  unknown.set_target_model("nobody/b");
  EXPECT_EQ(client->Translate(unknown, source).status().code(), absl::StatusCode::kNotFound);
  const HostCache truth = RandomCache(tgt.num_layers, tgt.num_kv_heads, tgt.head_dim, 2);
  const HostCache queries = RandomCache(tgt.num_layers, 2 * tgt.num_kv_heads, tgt.head_dim, 3);
  v1::ValidateHeader validate;
  validate.set_mapper_id("demo-tiny");
  validate.set_turn(2);
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<v1::ValidateKVResponse> quality =
        client->Validate(validate, source, truth, &queries);
    ASSERT_TRUE(quality.ok()) << quality.status();
    EXPECT_TRUE(quality->overall().has_attention_cosine());
  }

  // The exposition itself passes promtool's lint.
  absl::StatusOr<testing::HttpResponse> exposition =
      testing::HttpGet("127.0.0.1", metrics_port, "/metrics");
  ASSERT_TRUE(exposition.ok()) << exposition.status();
  const std::string exposition_path = test::WriteFile(dir + "/metrics.txt", exposition->body);
  {
    std::string output;
    FILE* pipe = popen(absl::StrCat(kPromtool, " check metrics < ", exposition_path, " 2>&1").c_str(),
                       "r");
    char buffer[4096];
    while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) output.append(buffer, n);
    EXPECT_EQ(pclose(pipe), 0) << "promtool check metrics:\n" << output;
  }

  // A real Prometheus scraping kvtd every 500 ms.
  const int prometheus_port = FreePort();
  const std::string prometheus_config = test::WriteFile(
      dir + "/prometheus.yml",
      absl::StrCat("global:\n  scrape_interval: 500ms\n  evaluation_interval: 1s\n"
                   "scrape_configs:\n  - job_name: kvtd\n    static_configs:\n"
                   "      - targets: ['127.0.0.1:",
                   metrics_port, "']\n"));
  KvtdProcess prometheus(
      "prometheus", kPrometheus,
      {"--config.file=" + prometheus_config, "--storage.tsdb.path=" + dir + "/tsdb",
       absl::StrCat("--web.listen-address=127.0.0.1:", prometheus_port), "--log.level=warn",
       "--storage.tsdb.retention.time=1h"});
  const Clock::time_point ready_by = Clock::now() + milliseconds(20000);
  bool ready = false;
  while (!ready && Clock::now() < ready_by && prometheus.Running()) {
    absl::StatusOr<testing::HttpResponse> response =
        testing::HttpGet("127.0.0.1", prometheus_port, "/-/ready");
    ready = response.ok() && response->status == 200;
    if (!ready) std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_TRUE(ready) << "Prometheus not ready; its stderr:\n" << prometheus.Stderr();

  EXPECT_EQ(WaitForValue(prometheus_port, R"(up{job="kvtd"})", 1), 1.0) << prometheus.Stderr();
  const std::string pair = absl::StrCat(R"(source=")", src.name, R"(",target=")", tgt.name, R"(")");
  EXPECT_EQ(WaitForValue(prometheus_port,
                         absl::StrCat("kvt_translate_requests_total{code=\"OK\",", pair, "}"), 3),
            3.0);
  EXPECT_EQ(WaitForValue(prometheus_port,
                         R"(kvt_translate_requests_total{code="NOT_FOUND",source="unknown",target="unknown"})",
                         1),
            1.0);
  EXPECT_EQ(WaitForValue(prometheus_port, absl::StrCat("kvt_translate_tokens_total{", pair, "}"),
                         3 * kTokens),
            3.0 * kTokens);
  EXPECT_EQ(WaitForValue(prometheus_port,
                         absl::StrCat("kvt_translate_duration_seconds_count{", pair,
                                      ",stage=\"compute\",device=\"cpu\"}"),
                         3),
            3.0);
  EXPECT_EQ(WaitForValue(prometheus_port,
                         absl::StrCat("kvt_translate_speedup_ratio_count{", pair, "}"), 3),
            3.0);
  EXPECT_EQ(WaitForValue(prometheus_port,
                         absl::StrCat("kvt_quality_attention_cosine_count{", pair, ",turn=\"2\"}"),
                         2),
            2.0);
  EXPECT_EQ(WaitForValue(prometheus_port,
                         absl::StrCat("sum(kvt_quality_kv_cosine_count{", pair, ",turn=\"2\"})"), 4),
            4.0);
  EXPECT_EQ(WaitForValue(prometheus_port,
                         absl::StrCat("kvt_validate_requests_total{code=\"OK\",", pair, "}"), 2),
            2.0);
  EXPECT_EQ(WaitForValue(prometheus_port, "kvt_inflight_requests", 0), 0.0);
  EXPECT_EQ(WaitForValue(prometheus_port, R"(kvt_backend_info{backend="cpu",requested="cpu"})", 1),
            1.0);
  const std::optional<double> resident = QueryValue(
      prometheus_port, R"(kvt_mapper_device_resident_bytes{mapper="demo-tiny",device="host"})");
  ASSERT_TRUE(resident.has_value());
  EXPECT_GT(*resident, 0.0);
  // A dashboard-style quantile over the scraped histogram.
  const std::optional<double> p50 = QueryValue(
      prometheus_port,
      "histogram_quantile(0.5, sum by (le) (kvt_translate_duration_seconds_bucket{stage=\"total\"}))");
  ASSERT_TRUE(p50.has_value());
  EXPECT_GT(*p50, 0.0);
  EXPECT_LT(*p50, 10.0);
}

}  // namespace
}  // namespace kvt
