// kvt-load: load generator for kvtd. Closed loop (--mode=closed, --concurrency streams) or open
// loop (--mode=open, Poisson arrivals at --rate); stops after --duration_s and/or --requests.
// Prints p50/p95/p99/max latency, req/s, tokens/s, GB/s and errors by code; writes JSON and an
// SVG latency plot; in soak runs (--server_pid) checks RSS and fd growth after warm-up.
#include <cstdio>
#include <algorithm>
#include <fstream>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "loadtest/load_generator.h"
#include "loadtest/report.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvtd address (host:port or unix:/path).");
ABSL_FLAG(std::string, mode, "closed", "closed (N streams back to back) | open (Poisson).");
ABSL_FLAG(int32_t, concurrency, 4, "closed: streams in flight; open: most outstanding.");
ABSL_FLAG(double, rate, 10, "open loop: mean requests per second.");
ABSL_FLAG(double, duration_s, 10, "stop issuing after this many seconds (0: --requests only).");
ABSL_FLAG(int64_t, requests, 0, "stop after this many requests (0: --duration_s only).");
ABSL_FLAG(double, warmup_s, 0, "requests started before this are not reported.");
ABSL_FLAG(std::string, mix, "",
          "MAPPER[:TOKENS[:WEIGHT]],... (default: every servable mapper at 512 tokens).");
ABSL_FLAG(std::string, dtype, "bf16", "source cache dtype: bf16 | fp16 | fp32.");
ABSL_FLAG(std::string, layout, "HND", "source cache layout: HND | NHD.");
ABSL_FLAG(uint64_t, seed, 1, "random seed (cache contents, mix picks, arrivals).");
ABSL_FLAG(std::string, json_out, "", "write the summary and every sample as JSON here.");
ABSL_FLAG(std::string, svg_out, "", "write an SVG plot of latency over time here.");
ABSL_FLAG(int32_t, server_pid, 0, "soak: sample this kvtd's RSS and open fds once a second.");
ABSL_FLAG(double, max_rss_growth_pct, -1,
          "soak: fail if the RSS floor (lowest sample) of the last third of the run after warm-up "
          "exceeds that of the first third by more than this (percent), or open fds grew.");
ABSL_FLAG(bool, fail_on_error, false, "exit non-zero when any request failed.");

namespace kvt {
namespace load {
namespace {

bool WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  return static_cast<bool>(out);
}

int Main() {
  LoadOptions options;
  options.server = absl::GetFlag(FLAGS_server);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "closed" && mode != "open") {
    std::fprintf(stderr, "kvt-load: --mode must be closed or open\n");
    return 1;
  }
  options.mode = mode == "open" ? LoopMode::kOpen : LoopMode::kClosed;
  options.concurrency = absl::GetFlag(FLAGS_concurrency);
  options.rate = absl::GetFlag(FLAGS_rate);
  options.duration_s = absl::GetFlag(FLAGS_duration_s);
  options.max_requests = absl::GetFlag(FLAGS_requests);
  options.warmup_s = absl::GetFlag(FLAGS_warmup_s);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.server_pid = absl::GetFlag(FLAGS_server_pid);
  absl::StatusOr<std::vector<WorkloadItem>> mix = ParseMix(absl::GetFlag(FLAGS_mix));
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  absl::StatusOr<Layout> layout = ParseLayout(absl::GetFlag(FLAGS_layout));
  for (const absl::Status& status : {mix.status(), dtype.status(), layout.status()}) {
    if (!status.ok()) {
      std::fprintf(stderr, "kvt-load: %s\n", std::string(status.message()).c_str());
      return 1;
    }
  }
  options.mix = *mix;
  options.dtype = *dtype;
  options.layout = *layout;

  absl::StatusOr<LoadResult> result = RunLoad(options);
  if (!result.ok()) {
    std::fprintf(stderr, "kvt-load: %s\n", result.status().ToString().c_str());
    return 2;
  }
  const Summary summary = Summarize(result->samples, result->duration_s);
  std::printf("kvt-load %s loop against %s, concurrency %d%s\n%s", mode.c_str(),
              options.server.c_str(), options.concurrency,
              options.mode == LoopMode::kOpen ? absl::StrCat(", ", options.rate, " req/s").c_str()
                                              : "",
              SummaryTable(summary).c_str());

  int exit_code = 0;
  if (absl::GetFlag(FLAGS_fail_on_error) && summary.ok != summary.requests) exit_code = 3;
  if (!result->resources.empty()) {
    // Steady-state growth: the lowest RSS of the last third of the samples after warm-up against
    // the lowest of the first third. Single samples swing by 10-20% with whatever requests are
    // in flight at that instant (several MB each); a leak raises the floor, in-flight work does
    // not.
    std::vector<const ResourcePoint*> steady;
    for (const ResourcePoint& point : result->resources) {
      if (point.t_s >= options.warmup_s) steady.push_back(&point);
    }
    if (steady.empty()) steady.push_back(&result->resources.back());
    const size_t third = std::max<size_t>(1, steady.size() / 3);
    auto floor_rss = [](std::vector<const ResourcePoint*> points) {
      int64_t lowest = points.front()->rss_kib;
      for (const ResourcePoint* point : points) lowest = std::min(lowest, point->rss_kib);
      return static_cast<double>(lowest);
    };
    const double early = floor_rss({steady.begin(), steady.begin() + third});
    const double late = floor_rss({steady.end() - third, steady.end()});
    const ResourcePoint* first = steady.front();
    const ResourcePoint& last = *steady.back();
    const double growth = early > 0 ? 100.0 * (late - early) / early : 0;
    std::printf("server    RSS floor %.1f MiB -> %.1f MiB (%+.2f%%, first vs last third after "
                "warm-up, %zu samples), fds %lld -> %lld\n",
                early / 1024.0, late / 1024.0, growth, steady.size(),
                static_cast<long long>(first->open_fds), static_cast<long long>(last.open_fds));
    const double limit = absl::GetFlag(FLAGS_max_rss_growth_pct);
    if (limit >= 0 && growth > limit) {
      std::printf("FAIL: RSS grew %.2f%% > %.2f%%\n", growth, limit);
      exit_code = 3;
    }
    if (limit >= 0 && last.open_fds > first->open_fds) {
      std::printf("FAIL: open fds grew %lld -> %lld\n", static_cast<long long>(first->open_fds),
                  static_cast<long long>(last.open_fds));
      exit_code = 3;
    }
  }
  std::map<std::string, std::string> settings = {
      {"server", options.server},
      {"mode", mode},
      {"concurrency", absl::StrCat(options.concurrency)},
      {"rate", absl::StrCat(options.rate)},
      {"duration_s", absl::StrCat(options.duration_s)},
      {"requests", absl::StrCat(options.max_requests)},
      {"mix", absl::GetFlag(FLAGS_mix)},
      {"dtype", absl::GetFlag(FLAGS_dtype)},
      {"layout", absl::GetFlag(FLAGS_layout)}};
  if (!absl::GetFlag(FLAGS_json_out).empty() &&
      !WriteFile(absl::GetFlag(FLAGS_json_out), SummaryJson(summary, result->samples, settings))) {
    std::fprintf(stderr, "kvt-load: cannot write %s\n", absl::GetFlag(FLAGS_json_out).c_str());
    return 2;
  }
  if (!absl::GetFlag(FLAGS_svg_out).empty() &&
      !WriteFile(absl::GetFlag(FLAGS_svg_out),
                 LatencySvg(result->samples,
                            absl::StrCat("kvt-load: ", mode, " loop, ", summary.ok,
                                         " requests, p99 ", summary.p99_ms, " ms")))) {
    std::fprintf(stderr, "kvt-load: cannot write %s\n", absl::GetFlag(FLAGS_svg_out).c_str());
    return 2;
  }
  return exit_code;
}

}  // namespace
}  // namespace load
}  // namespace kvt

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "load generator for kvtd.\n\n"
      "  kvt-load --server=127.0.0.1:50051 --mode=closed --concurrency=4 --duration_s=30\n"
      "  kvt-load --mode=open --rate=50 --mix=demo-tiny:512:3,demo-tiny:4096:1 --requests=1000\n"
      "It always stops by itself (--duration_s and/or --requests).");
  absl::ParseCommandLine(argc, argv);
  return kvt::load::Main();
}
