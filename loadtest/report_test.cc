#include "loadtest/report.h"

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace kvt {
namespace load {
namespace {

TEST(ReportTest, PercentilesByNearestRank) {
  std::vector<double> values;
  for (int i = 100; i >= 1; --i) values.push_back(i);
  EXPECT_EQ(Percentile(&values, 50), 50);
  EXPECT_EQ(Percentile(&values, 95), 95);
  EXPECT_EQ(Percentile(&values, 99), 99);
  EXPECT_EQ(Percentile(&values, 100), 100);
  std::vector<double> empty;
  EXPECT_EQ(Percentile(&empty, 50), 0);
}

TEST(ReportTest, SummaryCountsErrorsApartFromLatencies) {
  std::vector<Sample> samples;
  for (int i = 0; i < 10; ++i) {
    Sample sample;
    sample.start_s = i * 0.1;
    sample.latency_ms = 10 + i;
    sample.tokens = 100;
    sample.bytes = 1000000;
    samples.push_back(sample);
  }
  Sample error;
  error.latency_ms = 5000;
  error.code = absl::StatusCode::kResourceExhausted;
  samples.push_back(error);
  const Summary summary = Summarize(samples, 2.0);
  EXPECT_EQ(summary.requests, 11);
  EXPECT_EQ(summary.ok, 10);
  EXPECT_EQ(summary.errors_by_code.at("RESOURCE_EXHAUSTED"), 1);
  EXPECT_EQ(summary.max_ms, 19);  // the failed request's latency is not a latency sample
  EXPECT_DOUBLE_EQ(summary.requests_per_s, 5);
  EXPECT_DOUBLE_EQ(summary.tokens_per_s, 500);
  EXPECT_DOUBLE_EQ(summary.gigabytes_per_s, 0.005);
  const nlohmann::json json = nlohmann::json::parse(SummaryJson(summary, samples, {{"mode", "x"}}));
  EXPECT_EQ(json["ok"], 10);
  EXPECT_EQ(json["samples"].size(), 11u);
  EXPECT_EQ(json["settings"]["mode"], "x");
  const std::string svg = LatencySvg(samples, "t");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("#d62728"), std::string::npos);  // the error dot
}

}  // namespace
}  // namespace load
}  // namespace kvt
