#include "server/config.h"

#include <algorithm>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

std::string ReadShippedFile() {
  std::ifstream in("server/kvtd.yaml");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string SectionOf(const std::string& path) { return path.substr(0, path.find('.')); }
std::string NameOf(const std::string& path) { return path.substr(path.find('.') + 1); }

// ---- The schema against the shipped kvtd.yaml: fails when they drift apart ----

TEST(ConfigSchemaTest, KeysAreUniqueAndEachIsRendered) {
  std::set<std::string> paths;
  for (const KvtdConfigKey& key : KvtdConfigKeys()) {
    EXPECT_TRUE(paths.insert(key.path).second) << "twice in the schema: " << key.path;
    EXPECT_EQ(std::count(key.path.begin(), key.path.end(), '.'), 1) << key.path;
    EXPECT_EQ(key.flag.empty(), key.flag_help.empty()) << key.path << ": a flag needs its help";
  }
  const nlohmann::json rendered = nlohmann::json::parse(KvtdConfigToJson(KvtdConfig()));
  size_t rendered_keys = 0;
  for (const auto& [section, keys] : rendered.items()) {
    for (const auto& [name, value] : keys.items()) {
      EXPECT_TRUE(paths.count(section + "." + name)) << section << "." << name;
      ++rendered_keys;
    }
  }
  EXPECT_EQ(rendered_keys, paths.size());
}

TEST(ConfigSchemaTest, ShippedFileHoldsEveryKeyWithItsDefault) {
  const YAML::Node shipped = YAML::Load(ReadShippedFile());
  absl::StatusOr<KvtdConfig> parsed = ParseKvtdConfig(ReadShippedFile(), "server/kvtd.yaml");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const nlohmann::json from_file = nlohmann::json::parse(KvtdConfigToJson(*parsed));
  const nlohmann::json defaults = nlohmann::json::parse(KvtdConfigToJson(KvtdConfig()));
  for (const KvtdConfigKey& key : KvtdConfigKeys()) {
    const std::string section = SectionOf(key.path);
    const std::string name = NameOf(key.path);
    EXPECT_TRUE(shipped[section][name].IsDefined())
        << key.path << " is not documented in server/kvtd.yaml";
    EXPECT_EQ(from_file[section][name], defaults[section][name])
        << key.path << ": server/kvtd.yaml shows another value than the default in config.h";
  }
}

// The comment above a key in kvtd.yaml (keys listed one under another share the comment above
// the first).
std::string CommentAbove(const std::vector<std::string>& lines, const std::string& path) {
  const std::string section_line = SectionOf(path) + ":";
  const std::string key_line = "  " + NameOf(path) + ":";
  size_t at = 0;
  while (at < lines.size() && lines[at] != section_line) ++at;
  while (at < lines.size() && lines[at].rfind(key_line, 0) != 0) ++at;
  if (at == lines.size()) return "";
  while (at > 0 && lines[at - 1].rfind("  #", 0) != 0 && lines[at - 1].rfind("  ", 0) == 0) {
    --at;  // the keys above that share the comment
  }
  std::string comment;
  while (at > 0 && lines[at - 1].rfind("  #", 0) == 0) comment = lines[--at] + "\n" + comment;
  return comment;
}

TEST(ConfigSchemaTest, ShippedFileNamesEveryOverrideFlag) {
  std::vector<std::string> lines;
  std::istringstream text(ReadShippedFile());
  for (std::string line; std::getline(text, line);) lines.push_back(line);
  std::set<std::string> flags = {"config", "helpfull"};  // kvtd's own, not keys'
  for (const KvtdConfigKey& key : KvtdConfigKeys()) {
    if (key.flag.empty()) continue;
    flags.insert(key.flag);
    EXPECT_THAT(CommentAbove(lines, key.path), HasSubstr("--" + key.flag))
        << "server/kvtd.yaml's comment on " << key.path << " should say \"Flag: --" << key.flag
        << "\"";
  }
  // And no flag named there that is not one.
  const std::string all = ReadShippedFile();
  const std::regex flag_pattern("--([a-z_]+)");
  for (auto it = std::sregex_iterator(all.begin(), all.end(), flag_pattern);
       it != std::sregex_iterator(); ++it) {
    EXPECT_TRUE(flags.count((*it)[1])) << "server/kvtd.yaml names --" << (*it)[1]
                                      << ", which overrides no key";
  }
}

TEST(ConfigSchemaTest, UnknownKeysOfEverySectionAreRefusedByName) {
  std::set<std::string> sections;
  for (const KvtdConfigKey& key : KvtdConfigKeys()) sections.insert(SectionOf(key.path));
  for (const std::string& section : sections) {
    absl::StatusOr<KvtdConfig> config =
        ParseKvtdConfig(section + ":\n  no_such_key: 1\n", "u.yaml");
    ASSERT_FALSE(config.ok()) << section;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(config.status().message()), HasSubstr("u.yaml:2"));
    EXPECT_THAT(std::string(config.status().message()),
                HasSubstr("unknown key '" + section + ".no_such_key'"));
  }
}

TEST(ConfigSchemaTest, JsonIsNestedLikeTheFile) {
  KvtdConfig config;
  config.limits.max_tokens = 4096;
  config.logging.level = LogLevel::kDebug;
  config.mapper_store.preload = {"a-to-b"};
  config.prefix_cache.pair_min_quality["a->b"] = 0.5;
  config.metrics.prefill_cost["m"] = {1, 2, 3};
  const nlohmann::json json = nlohmann::json::parse(KvtdConfigToJson(config));
  EXPECT_EQ(json["limits"]["max_tokens"], 4096);
  EXPECT_EQ(json["logging"]["level"], "debug");
  EXPECT_EQ(json["server"]["listen_address"], "0.0.0.0:50051");
  EXPECT_EQ(json["mapper_store"]["preload"], nlohmann::json({"a-to-b"}));
  EXPECT_EQ(json["mapper_store"]["load_on_scan"], true);
  EXPECT_EQ(json["prefix_cache"]["pair_min_quality"]["a->b"], 0.5);
  EXPECT_EQ(json["metrics"]["prefill_cost"]["m"], nlohmann::json({{"a", 1}, {"b", 2}, {"c", 3}}));
}

TEST(ConfigSchemaTest, TextIsReadLikeTheSameValueInTheFile) {
  KvtdConfig config;
  ASSERT_TRUE(SetKvtdConfigKey("limits.max_tokens", "4096", "--max_tokens=4096", &config).ok());
  EXPECT_EQ(config.limits.max_tokens, 4096);
  ASSERT_TRUE(SetKvtdConfigKey("limits.allow_non_finite", "true", "--x", &config).ok());
  EXPECT_TRUE(config.limits.allow_non_finite);
  ASSERT_TRUE(SetKvtdConfigKey("logging.level", "error", "--x", &config).ok());
  EXPECT_EQ(config.logging.level, LogLevel::kError);
  // A string stays a string, whatever YAML would make of it.
  ASSERT_TRUE(SetKvtdConfigKey("server.unix_socket", "[a: b", "--x", &config).ok());
  EXPECT_EQ(config.server.unix_socket, "[a: b");

  absl::Status bad = SetKvtdConfigKey("limits.max_tokens", "lots", "--max_tokens=lots", &config);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("--max_tokens=lots"));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("limits.max_tokens"));
  EXPECT_EQ(config.limits.max_tokens, 4096);  // a failed read changes nothing
  bad = SetKvtdConfigKey("logging.level", "loud", "--log_level=loud", &config);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("logging.level"));
  bad = SetKvtdConfigKey("limits.max_tokenz", "1", "--x", &config);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("unknown key 'limits.max_tokenz'"));
}

// Whatever a key is set to, an error it causes names it: values of every kind, out of every
// range, for every key of the schema.
TEST(ConfigSchemaTest, EveryErrorNamesTheKeyThatCausedIt) {
  int refused = 0;
  for (const KvtdConfigKey& key : KvtdConfigKeys()) {
    for (const char* text : {"-1", "0", "1e30", "nonsense", "[1, 2]"}) {
      KvtdConfig config;
      absl::Status status = SetKvtdConfigKey(key.path, text, "--test", &config);
      if (status.ok()) status = ValidateKvtdConfig(config);
      if (status.ok()) continue;
      ++refused;
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << key.path << " = " << text;
      EXPECT_THAT(std::string(status.message()), HasSubstr("'" + key.path))
          << key.path << " = " << text;
    }
  }
  EXPECT_GT(refused, static_cast<int>(KvtdConfigKeys().size()));
}

// ---- The parser and its rules ----

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
  min_benefit_recovered: 0.3
  pair_min_benefit: {"a->b": 0.6}
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
  EXPECT_EQ(prefix.min_benefit_recovered, 0.3);
  EXPECT_EQ(prefix.pair_min_benefit.at("a->b"), 0.6);
  // The shipped file documents the defaults: off.
  absl::StatusOr<KvtdConfig> shipped = LoadKvtdConfigFile("server/kvtd.yaml");
  ASSERT_TRUE(shipped.ok()) << shipped.status();
  EXPECT_FALSE(shipped->prefix_cache.enabled);
  EXPECT_EQ(shipped->prefix_cache.max_bytes, KvtdConfig().prefix_cache.max_bytes);
  EXPECT_EQ(shipped->prefix_cache.block_tokens, KvtdConfig().prefix_cache.block_tokens);
  EXPECT_EQ(shipped->prefix_cache.min_mapper_quality,
            KvtdConfig().prefix_cache.min_mapper_quality);
  EXPECT_EQ(shipped->prefix_cache.min_r2_heldout, KvtdConfig().prefix_cache.min_r2_heldout);
  // The benefit gate is on by default: a mapper must record a measured benefit.
  EXPECT_EQ(shipped->prefix_cache.min_benefit_recovered, 0.5);
  EXPECT_EQ(KvtdConfig().prefix_cache.min_benefit_recovered, 0.5);
}

TEST(ConfigTest, BenefitFloorsMustBeInZeroToOne) {
  for (const char* bad : {"1.5", "-0.1"}) {
    absl::StatusOr<KvtdConfig> config = ParseKvtdConfig(
        absl::StrCat("prefix_cache:\n  min_benefit_recovered: ", bad, "\n"), "x.yaml");
    ASSERT_FALSE(config.ok()) << bad;
    EXPECT_THAT(config.status().message(),
                HasSubstr("key 'prefix_cache.min_benefit_recovered'"));
    EXPECT_THAT(config.status().message(), HasSubstr("must be in [0, 1] (0: off)"));
  }
  absl::StatusOr<KvtdConfig> off =
      ParseKvtdConfig("prefix_cache:\n  min_benefit_recovered: 0\n", "x.yaml");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->prefix_cache.min_benefit_recovered, 0);
  absl::StatusOr<KvtdConfig> bad_floor =
      ParseKvtdConfig("prefix_cache:\n  pair_min_benefit: {\"a->b\": 2}\n", "x.yaml");
  ASSERT_FALSE(bad_floor.ok());
  EXPECT_THAT(bad_floor.status().message(), HasSubstr("key 'prefix_cache.pair_min_benefit'"));
  EXPECT_THAT(bad_floor.status().message(), HasSubstr("'a->b' must be in [0, 1]"));
  absl::StatusOr<KvtdConfig> bad_pair =
      ParseKvtdConfig("prefix_cache:\n  pair_min_benefit: {ab: 0.5}\n", "x.yaml");
  ASSERT_FALSE(bad_pair.ok());
  EXPECT_THAT(bad_pair.status().message(), HasSubstr("prefix_cache.pair_min_benefit.ab"));
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
