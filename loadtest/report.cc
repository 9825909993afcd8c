#include "loadtest/report.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace kvt {
namespace load {

double Percentile(std::vector<double>* values, double percentile) {
  if (values->empty()) return 0;
  std::sort(values->begin(), values->end());
  const double rank = std::ceil(percentile / 100.0 * static_cast<double>(values->size()));
  const size_t index = static_cast<size_t>(std::max(1.0, rank)) - 1;
  return (*values)[std::min(index, values->size() - 1)];
}

Summary Summarize(const std::vector<Sample>& samples, double duration_s) {
  Summary summary;
  summary.duration_s = duration_s;
  summary.requests = static_cast<int64_t>(samples.size());
  std::vector<double> latencies;
  int64_t tokens = 0, bytes = 0;
  double total_ms = 0;
  for (const Sample& sample : samples) {
    if (sample.code != absl::StatusCode::kOk) {
      ++summary.errors_by_code[absl::StatusCodeToString(sample.code)];
      continue;
    }
    ++summary.ok;
    latencies.push_back(sample.latency_ms);
    total_ms += sample.latency_ms;
    tokens += sample.tokens;
    bytes += sample.bytes;
  }
  summary.p50_ms = Percentile(&latencies, 50);
  summary.p95_ms = Percentile(&latencies, 95);
  summary.p99_ms = Percentile(&latencies, 99);
  summary.max_ms = latencies.empty() ? 0 : latencies.back();
  summary.mean_ms = latencies.empty() ? 0 : total_ms / static_cast<double>(latencies.size());
  if (duration_s > 0) {
    summary.requests_per_s = static_cast<double>(summary.ok) / duration_s;
    summary.tokens_per_s = static_cast<double>(tokens) / duration_s;
    summary.gigabytes_per_s = static_cast<double>(bytes) / 1e9 / duration_s;
  }
  return summary;
}

std::string SummaryTable(const Summary& s) {
  std::string out = absl::StrFormat(
      "requests  %lld (%lld ok) in %.1f s\n"
      "latency   p50 %.2f ms  p95 %.2f ms  p99 %.2f ms  max %.2f ms  mean %.2f ms\n"
      "rate      %.1f req/s  %.0f tokens/s  %.3f GB/s\n",
      static_cast<long long>(s.requests), static_cast<long long>(s.ok), s.duration_s, s.p50_ms,
      s.p95_ms, s.p99_ms, s.max_ms, s.mean_ms, s.requests_per_s, s.tokens_per_s,
      s.gigabytes_per_s);
  if (s.errors_by_code.empty()) {
    absl::StrAppend(&out, "errors    none\n");
  } else {
    absl::StrAppend(&out, "errors   ");
    for (const auto& [code, count] : s.errors_by_code) {
      absl::StrAppend(&out, " ", code, "=", count);
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

std::string SummaryJson(const Summary& s, const std::vector<Sample>& samples,
                        const std::map<std::string, std::string>& settings) {
  nlohmann::json json;
  json["settings"] = settings;
  json["duration_s"] = s.duration_s;
  json["requests"] = s.requests;
  json["ok"] = s.ok;
  json["errors_by_code"] = s.errors_by_code;
  json["latency_ms"] = {{"p50", s.p50_ms}, {"p95", s.p95_ms}, {"p99", s.p99_ms},
                        {"max", s.max_ms}, {"mean", s.mean_ms}};
  json["requests_per_s"] = s.requests_per_s;
  json["tokens_per_s"] = s.tokens_per_s;
  json["gigabytes_per_s"] = s.gigabytes_per_s;
  nlohmann::json per_request = nlohmann::json::array();
  for (const Sample& sample : samples) {
    per_request.push_back({{"start_s", sample.start_s},
                           {"latency_ms", sample.latency_ms},
                           {"mapper", sample.mapper_id},
                           {"tokens", sample.tokens},
                           {"code", absl::StatusCodeToString(sample.code)}});
  }
  json["samples"] = per_request;
  return json.dump(2);
}

std::string LatencySvg(const std::vector<Sample>& samples, const std::string& title) {
  const double width = 800, height = 400, left = 70, right = 20, top = 40, bottom = 50;
  double max_t = 1e-3, min_ms = 1e9, max_ms = 1e-3;
  for (const Sample& s : samples) {
    max_t = std::max(max_t, s.start_s);
    min_ms = std::min(min_ms, std::max(s.latency_ms, 1e-3));
    max_ms = std::max(max_ms, s.latency_ms);
  }
  if (samples.empty()) min_ms = 0.1;
  const double log_lo = std::floor(std::log10(min_ms)), log_hi = std::ceil(std::log10(max_ms));
  const double span = std::max(1.0, log_hi - log_lo);
  auto x = [&](double t) { return left + (width - left - right) * t / max_t; };
  auto y = [&](double ms) {
    return top + (height - top - bottom) *
                     (1.0 - (std::log10(std::max(ms, 1e-3)) - log_lo) / span);
  };
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%.0f\" y=\"22\" font-size=\"15\">%s</text>\n",
      width, height, left, title);
  for (double decade = log_lo; decade <= log_lo + span + 1e-9; decade += 1) {
    const double ms = std::pow(10.0, decade);
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g ms</text>\n",
                          left, y(ms), width - right, y(ms), left - 6, y(ms) + 4, ms);
  }
  for (int tick = 0; tick <= 5; ++tick) {
    const double t = max_t * tick / 5;
    absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.1f s</text>\n",
                          x(t), height - bottom + 18, t);
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">time since start</text>\n",
                        (left + width - right) / 2, height - 10);
  for (const Sample& s : samples) {
    const bool ok = s.code == absl::StatusCode::kOk;
    absl::StrAppendFormat(&svg, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2\" fill=\"%s\"/>\n",
                          x(s.start_s), ok ? y(s.latency_ms) : top, ok ? "#1f77b4" : "#d62728");
  }
  absl::StrAppend(&svg, "</svg>\n");
  return svg;
}

}  // namespace load
}  // namespace kvt
