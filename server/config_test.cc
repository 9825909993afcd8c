#include "server/config.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

TEST(ConfigTest, ExampleFileParsesToTheDefaults) {
  absl::StatusOr<KvtdConfig> config = LoadKvtdConfigFile("server/kvtd.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  const KvtdConfig defaults;
  EXPECT_EQ(config->server.listen_address, defaults.server.listen_address);
  EXPECT_EQ(config->server.max_message_bytes, defaults.server.max_message_bytes);
  EXPECT_EQ(config->mapper_store.path, defaults.mapper_store.path);
  EXPECT_EQ(config->backend.type, defaults.backend.type);
  EXPECT_EQ(config->backend.cpu_gemm, defaults.backend.cpu_gemm);
  EXPECT_EQ(config->limits.max_tokens, defaults.limits.max_tokens);
  EXPECT_EQ(config->limits.max_request_bytes, defaults.limits.max_request_bytes);
  EXPECT_EQ(config->limits.max_inflight_bytes, defaults.limits.max_inflight_bytes);
  EXPECT_EQ(config->limits.allow_non_finite, defaults.limits.allow_non_finite);
  EXPECT_FALSE(defaults.limits.allow_non_finite);  // refused unless a caller needs them
  EXPECT_EQ(config->shutdown.deadline_seconds, defaults.shutdown.deadline_seconds);
  EXPECT_EQ(config->logging.level, defaults.logging.level);
}

TEST(ConfigTest, PrefixCacheKeys) {
  absl::StatusOr<KvtdConfig> config = ParseKvtdConfig(R"(
prefix_cache:
  enabled: true
  max_bytes: 1048576
  ttl_seconds: 60
  block_tokens: 32
  lease_seconds: 5
  min_mapper_quality: 0.4
  pair_min_quality: {"a->b": 0.7}
  max_input_shift: 3.5
)", "x.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  const KvtdConfig::PrefixCache& prefix = config->prefix_cache;
  EXPECT_TRUE(prefix.enabled);
  EXPECT_EQ(prefix.max_bytes, 1048576);
  EXPECT_EQ(prefix.ttl_seconds, 60);
  EXPECT_EQ(prefix.block_tokens, 32);
  EXPECT_EQ(prefix.lease_seconds, 5);
  EXPECT_EQ(prefix.min_mapper_quality, 0.4);
  EXPECT_EQ(prefix.pair_min_quality.at("a->b"), 0.7);
  EXPECT_EQ(prefix.max_input_shift, 3.5);
  // The shipped file documents the defaults: off.
  absl::StatusOr<KvtdConfig> shipped = LoadKvtdConfigFile("server/kvtd.yaml");
  ASSERT_TRUE(shipped.ok()) << shipped.status();
  EXPECT_FALSE(shipped->prefix_cache.enabled);
  EXPECT_EQ(shipped->prefix_cache.max_bytes, KvtdConfig().prefix_cache.max_bytes);
  EXPECT_EQ(shipped->prefix_cache.block_tokens, KvtdConfig().prefix_cache.block_tokens);
  EXPECT_EQ(shipped->prefix_cache.min_mapper_quality,
            KvtdConfig().prefix_cache.min_mapper_quality);
  EXPECT_EQ(shipped->prefix_cache.min_r2_heldout, KvtdConfig().prefix_cache.min_r2_heldout);
}

TEST(ConfigTest, PrefixCacheErrorsNameTheKey) {
  absl::StatusOr<KvtdConfig> bad_pair =
      ParseKvtdConfig("prefix_cache:\n  pair_min_quality: {ab: 0.5}\n", "x.yaml");
  ASSERT_FALSE(bad_pair.ok());
  EXPECT_THAT(bad_pair.status().message(), HasSubstr("prefix_cache.pair_min_quality.ab"));
  absl::StatusOr<KvtdConfig> bad_block =
      ParseKvtdConfig("prefix_cache:\n  block_tokens: 0\n", "x.yaml");
  ASSERT_FALSE(bad_block.ok());
  EXPECT_THAT(bad_block.status().message(), HasSubstr("prefix_cache.block_tokens"));
  absl::StatusOr<KvtdConfig> bad_ttl =
      ParseKvtdConfig("prefix_cache:\n  ttl_seconds: -1\n", "x.yaml");
  ASSERT_FALSE(bad_ttl.ok());
  EXPECT_THAT(bad_ttl.status().message(), HasSubstr("prefix_cache.ttl_seconds"));
}

TEST(ConfigTest, EmptyFileMeansDefaults) {
  absl::StatusOr<KvtdConfig> config = ParseKvtdConfig("", "empty.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->server.listen_address, "0.0.0.0:50051");
}

TEST(ConfigTest, ValuesAreRead) {
  absl::StatusOr<KvtdConfig> config = ParseKvtdConfig(R"(
server:
  listen_address: "127.0.0.1:0"
  unix_socket: /tmp/kvt.sock
backend:
  type: cpu
  cpu_threads: 2
  cpu_gemm: bf16
limits:
  max_tokens: 4096
  allow_non_finite: true
logging:
  level: debug
)", "x.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->server.listen_address, "127.0.0.1:0");
  EXPECT_EQ(config->server.unix_socket, "/tmp/kvt.sock");
  EXPECT_EQ(config->backend.type, "cpu");
  EXPECT_EQ(config->backend.cpu_threads, 2);
  EXPECT_EQ(config->backend.cpu_gemm, "bf16");
  EXPECT_EQ(config->limits.max_tokens, 4096);
  EXPECT_TRUE(config->limits.allow_non_finite);
  EXPECT_EQ(config->logging.level, LogLevel::kDebug);
}

TEST(ConfigTest, MapperStoreKeys) {
  absl::StatusOr<KvtdConfig> config = ParseKvtdConfig(R"(
mapper_store:
  path: /m
  host_budget_bytes: 1000000
  device_budget_bytes: 2000
  reload_interval_seconds: 0.5
  acquire_timeout_seconds: 0
  load_on_scan: false
  preload: [a-to-b, c-to-d]
)", "m.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->mapper_store.host_budget_bytes, 1000000);
  EXPECT_EQ(config->mapper_store.device_budget_bytes, 2000);
  EXPECT_EQ(config->mapper_store.reload_interval_seconds, 0.5);
  EXPECT_EQ(config->mapper_store.acquire_timeout_seconds, 0);
  EXPECT_FALSE(config->mapper_store.load_on_scan);
  EXPECT_EQ(config->mapper_store.preload, (std::vector<std::string>{"a-to-b", "c-to-d"}));
  const KvtdConfig defaults;
  EXPECT_EQ(defaults.mapper_store.reload_interval_seconds, 10);
  EXPECT_TRUE(defaults.mapper_store.preload.empty());

  for (const auto& [yaml, needle] : std::vector<std::pair<std::string, std::string>>{
           {"mapper_store:\n  host_budget_bytes: -1\n", "mapper_store.host_budget_bytes"},
           {"mapper_store:\n  preload: a\n", "'mapper_store.preload' must be a list"},
           {"mapper_store:\n  preload: [\"../x\"]\n", "mapper_store.preload"},
           {"mapper_store:\n  reload_interval_seconds: -2\n",
            "mapper_store.reload_interval_seconds"},
           {"mapper_store:\n  load_on_scan: maybe\n", "mapper_store.load_on_scan"},
       }) {
    absl::StatusOr<KvtdConfig> bad = ParseKvtdConfig(yaml, "b.yaml");
    ASSERT_FALSE(bad.ok()) << yaml;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr(needle)) << yaml;
  }
}

TEST(ConfigTest, BadYamlNamesTheLine) {
  absl::StatusOr<KvtdConfig> config = ParseKvtdConfig("server:\n  listen_address: [1, 2\n", "bad.yaml");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("bad.yaml:"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("invalid YAML"));
}

TEST(ConfigTest, UnknownKeyNamesKeyAndLine) {
  absl::StatusOr<KvtdConfig> config =
      ParseKvtdConfig("server:\n  listen_address: \"x:1\"\n  listen_adress: \"y:2\"\n", "k.yaml");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("k.yaml:3"));
  EXPECT_THAT(std::string(config.status().message()),
              HasSubstr("unknown key 'server.listen_adress'"));
}

TEST(ConfigTest, UnknownSectionIsNamed) {
  absl::StatusOr<KvtdConfig> config = ParseKvtdConfig("\n\nmetricz:\n  port: 1\n", "s.yaml");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("s.yaml:3"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("unknown key 'metricz'"));
}

TEST(ConfigTest, BadValueTypeNamesKeyAndLine) {
  absl::StatusOr<KvtdConfig> config =
      ParseKvtdConfig("limits:\n  max_tokens: lots\n", "v.yaml");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("v.yaml:2"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("limits.max_tokens"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("'lots'"));
}

TEST(ConfigTest, OutOfRangeValuesAreNamed) {
  struct Case {
    const char* yaml;
    const char* key;
  } cases[] = {
      {"backend:\n  type: tpu\n", "backend.type"},
      {"backend:\n  cpu_gemm: fp16\n", "backend.cpu_gemm"},
      {"limits:\n  max_tokens: 0\n", "limits.max_tokens"},
      {"server:\n  listen_address: nocolon\n", "server.listen_address"},
      {"shutdown:\n  deadline_seconds: -1\n", "shutdown.deadline_seconds"},
      {"logging:\n  level: loud\n", "logging.level"},
      {"server:\n  max_message_bytes: 10\n", "server.max_message_bytes"},
      {"limits:\n  max_inflight_bytes: 1\n", "limits.max_inflight_bytes"},
      {"server:\n  unix_socket: /tmp/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n",
       "server.unix_socket"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<KvtdConfig> config = ParseKvtdConfig(c.yaml, "r.yaml");
    ASSERT_FALSE(config.ok()) << c.yaml;
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(c.key)) << c.yaml;
  }
}

TEST(ConfigTest, DuplicateKeysAreNamed) {
  absl::StatusOr<KvtdConfig> config =
      ParseKvtdConfig("limits:\n  max_tokens: 5\n  max_tokens: 6\n", "d.yaml");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("d.yaml:3"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("duplicate key 'limits.max_tokens'"));
  config = ParseKvtdConfig("limits: {}\nlimits: {}\n", "d.yaml");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("duplicate key 'limits'"));
}

TEST(ConfigTest, MissingFileIsNotFound) {
  absl::StatusOr<KvtdConfig> config = LoadKvtdConfigFile("/nonexistent/kvtd.yaml");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
}

TEST(ConfigTest, MetricsSectionReadsTheEndpointAndPrefillCostModels) {
  absl::StatusOr<KvtdConfig> config = ParseKvtdConfig(R"(
metrics:
  listen_address: "127.0.0.1:0"
  prefill_cost:
    "Qwen/Qwen3-32B": {a: 54.7, b: 0.1086, c: 3.13e-6}
    test/dst:
      a: 1
      b: 0
      c: 0
)", "m.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->metrics.listen_address, "127.0.0.1:0");
  ASSERT_EQ(config->metrics.prefill_cost.size(), 2u);
  const KvtdConfig::Metrics::PrefillCost& qwen = config->metrics.prefill_cost.at("Qwen/Qwen3-32B");
  // The paper's 8K-token re-prefill of Qwen3-32B: 1154.8 ms.
  EXPECT_NEAR(qwen.Ms(8192), 1154.8, 1.0);
  EXPECT_EQ(config->metrics.prefill_cost.at("test/dst").Ms(100), 1.0);
  EXPECT_TRUE(KvtdConfig().metrics.listen_address.empty());  // off unless configured
}

TEST(ConfigTest, BadMetricsKeysAreNamed) {
  const struct {
    const char* yaml;
    const char* message;
  } cases[] = {
      {"metrics:\n  listen_address: nonsense\n", "metrics.listen_address"},
      {"metrics:\n  prefill_cost: [1, 2]\n", "'metrics.prefill_cost' must be a map"},
      {"metrics:\n  prefill_cost:\n    m: {a: 1, b: 2}\n",
       "missing required key 'metrics.prefill_cost.m.c'"},
      {"metrics:\n  prefill_cost:\n    m: {a: 1, b: 2, c: 3, d: 4}\n",
       "unknown key 'metrics.prefill_cost.m.d'"},
      {"metrics:\n  prefill_cost:\n    m: {a: 1, b: x, c: 3}\n",
       "'metrics.prefill_cost.m.b' must be a number"},
      {"metrics:\n  prefill_cost:\n    m: {a: -1, b: 2, c: 3}\n", "must be >= 0"},
      {"metrics:\n  prefill_cost:\n    m: {a: 0, b: 0, c: 0}\n", "at least one"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.yaml);
    absl::StatusOr<KvtdConfig> config = ParseKvtdConfig(c.yaml, "m.yaml");
    ASSERT_FALSE(config.ok());
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(c.message));
    EXPECT_THAT(std::string(config.status().message()), HasSubstr("m.yaml"));
  }
}

}  // namespace
}  // namespace kvt
