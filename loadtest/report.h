// Load-test results: per-request samples, then latency percentiles, throughput, errors by code,
// as a text table, JSON, and an SVG plot of latency over time.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace kvt {
namespace load {

struct Sample {
  double start_s = 0;     // since the run began (open loop: the scheduled arrival time)
  double latency_ms = 0;  // arrival (or send) to the last byte of the result
  std::string mapper_id;
  int64_t tokens = 0;
  int64_t bytes = 0;  // source + target cache bytes moved
  absl::StatusCode code = absl::StatusCode::kOk;
};

struct Summary {
  double duration_s = 0;
  int64_t requests = 0;
  int64_t ok = 0;
  std::map<std::string, int64_t> errors_by_code;  // canonical code name -> count
  double p50_ms = 0, p95_ms = 0, p99_ms = 0, max_ms = 0, mean_ms = 0;
  double requests_per_s = 0;
  double tokens_per_s = 0;
  double gigabytes_per_s = 0;
};

// Percentiles over successful requests (nearest-rank); throughput over `duration_s`.
Summary Summarize(const std::vector<Sample>& samples, double duration_s);

// Percentile by nearest rank of `values` (sorted in place); 0 when empty.
double Percentile(std::vector<double>* values, double percentile);

std::string SummaryTable(const Summary& summary);
std::string SummaryJson(const Summary& summary, const std::vector<Sample>& samples,
                        const std::map<std::string, std::string>& settings);
// Latency (ms, log scale) against time (s), one dot per request, errors in red.
std::string LatencySvg(const std::vector<Sample>& samples, const std::string& title);

}  // namespace load
}  // namespace kvt
