// The deploy/ artifacts stay usable: the Grafana dashboard parses and has the panels the
// operators rely on, every panel query is valid PromQL over metrics kvtd exports, and the
// Prometheus alert rules pass `promtool check rules` and `promtool test rules`.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/metrics.h"

namespace {

using ::testing::HasSubstr;

constexpr char kPromtool[] = "/usr/bin/promtool";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Runs `command`; returns its exit status and appends its output to `output`.
int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) output->append(buffer, n);
  return pclose(pipe);
}

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// Every metric family kvtd exports (kvt::Metrics::FamilyNames), with the suffixes Prometheus adds.
bool IsKvtdSeries(const std::string& name) {
  static const std::vector<std::string> families = kvt::Metrics("cpu").FamilyNames();
  for (const char* suffix : {"", "_bucket", "_sum", "_count"}) {
    for (const std::string& family : families) {
      if (name == family + suffix) return true;
    }
  }
  return false;
}

TEST(DeployTest, DashboardHasThePanelsAndValidQueries) {
  const std::string text = ReadFile("deploy/grafana/kvt-dashboard.json");
  ASSERT_FALSE(text.empty());
  const nlohmann::json dashboard = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(dashboard.is_discarded()) << "not valid JSON";
  EXPECT_EQ(dashboard.value("uid", ""), "kvt-overview");
  std::vector<std::string> titles;
  std::vector<std::string> queries;
  std::set<int> ids;
  for (const nlohmann::json& panel : dashboard.at("panels")) {
    titles.push_back(panel.at("title").get<std::string>());
    EXPECT_TRUE(ids.insert(panel.at("id").get<int>()).second) << "duplicate panel id";
    if (panel.at("type") == "row") continue;
    ASSERT_TRUE(panel.contains("gridPos")) << titles.back();
    ASSERT_FALSE(panel.at("targets").empty()) << titles.back();
    for (const nlohmann::json& target : panel.at("targets")) {
      queries.push_back(target.at("expr").get<std::string>());
    }
  }
  // The panels operators need (docs/TELEMETRY.md).
  const std::string all_titles = ::testing::PrintToString(titles);
  for (const char* wanted : {"Speedup", "Latency p50 / p95 / p99 by pair", "Latency p95 by stage",
                             "Tokens translated per second", "Requests by code",
                             "Attention-output cosine by turn", "Drift", "Input-shift score",
                             "Mapper residency", "page-ins", "evictions", "In-flight",
                             "Live verification", "Prefix lookups by result",
                             "Prefix cache memory", "Prefix digest"}) {
    EXPECT_THAT(all_titles, HasSubstr(wanted));
  }
  // Every series a query reads is one kvtd exports.
  const std::regex metric("kvt_[a-z0-9_]+");
  for (const std::string& query : queries) {
    for (std::sregex_iterator it(query.begin(), query.end(), metric), end; it != end; ++it) {
      EXPECT_TRUE(IsKvtdSeries(it->str())) << it->str() << " in " << query;
    }
  }
  // Every query parses: as recording rules (Grafana's variables replaced) for promtool.
  std::string rules = "groups:\n  - name: dashboard\n    rules:\n";
  for (size_t i = 0; i < queries.size(); ++i) {
    std::string expr = std::regex_replace(queries[i], std::regex("\\$__rate_interval"), "5m");
    expr = std::regex_replace(expr, std::regex("\\$(source|target)"), ".*");
    rules += "      - record: dashboard:query" + std::to_string(i) + "\n        expr: '" +
             std::regex_replace(expr, std::regex("'"), "''") + "'\n";
  }
  const std::string path = TempDir() + "/dashboard_rules.yaml";
  std::ofstream(path) << rules;
  std::string output;
  EXPECT_EQ(RunCommand(std::string(kPromtool) + " check rules " + path, &output), 0) << output;
}

TEST(DeployTest, AlertRulesPassPromtoolAndTheirUnitTests) {
  std::string output;
  EXPECT_EQ(RunCommand(std::string(kPromtool) + " check rules deploy/prometheus/alerts.yaml", &output), 0)
      << output;
  EXPECT_THAT(output, HasSubstr("SUCCESS"));
  // Every series a rule reads is one kvtd exports.
  const std::string alerts = ReadFile("deploy/prometheus/alerts.yaml");
  const std::regex metric("kvt_[a-z0-9_]+");
  for (std::sregex_iterator it(alerts.begin(), alerts.end(), metric), end; it != end; ++it) {
    EXPECT_TRUE(IsKvtdSeries(it->str())) << it->str() << " in alerts.yaml";
  }
  for (const char* alert : {"KvtLowAttentionCosine", "KvtTranslateErrorRate",
                            "KvtMapperPageInStorm", "KvtSaturated", "KvtMapperOutOfService"}) {
    EXPECT_THAT(ReadFile("deploy/prometheus/alerts.yaml"), HasSubstr("alert: " + std::string(alert)));
  }
  output.clear();
  // promtool resolves rule_files relative to the test file.
  EXPECT_EQ(RunCommand(std::string(kPromtool) + " test rules deploy/prometheus/alerts_test.yaml", &output),
            0)
      << output;
}

}  // namespace
