// kvt-load's engine: drives TranslateKV against a kvtd in closed loop (N concurrent streams) or
// open loop (Poisson arrivals at a rate, latency measured from the scheduled arrival so a slow
// server cannot hide queueing), over a weighted mix of mappers and sequence lengths, and always
// stops by itself (duration and/or request budget). Optionally samples the server's RSS and open
// file descriptors for soak runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/types.h"
#include "loadtest/report.h"

namespace kvt {
namespace load {

struct WorkloadItem {
  std::string mapper_id;
  int64_t tokens = 512;
  double weight = 1.0;
};

// "demo-tiny:512:3,other:4096:1" -> items (weight defaults to 1). Errors name the bad entry.
absl::StatusOr<std::vector<WorkloadItem>> ParseMix(const std::string& mix);

enum class LoopMode { kClosed, kOpen };

struct LoadOptions {
  std::string server = "127.0.0.1:50051";
  LoopMode mode = LoopMode::kClosed;
  int concurrency = 4;       // closed: streams in flight; open: most requests outstanding
  double rate = 10;          // open loop: mean arrivals per second
  double duration_s = 10;    // stop issuing after this long (0 = only max_requests bounds)
  int64_t max_requests = 0;  // stop after this many (0 = only duration bounds)
  double warmup_s = 0;       // samples before this are run but not reported
  std::vector<WorkloadItem> mix;  // empty: every servable mapper at 512 tokens
  DType dtype = DType::kBF16;
  Layout layout = Layout::kHND;
  uint64_t seed = 1;
  int64_t chunk_bytes = 4 << 20;
  double request_timeout_s = 60;
  int server_pid = 0;  // > 0: sample /proc/<pid> RSS and fd count once a second
};

struct ResourcePoint {
  double t_s = 0;
  int64_t rss_kib = 0;
  int64_t open_fds = 0;
};

struct LoadResult {
  std::vector<Sample> samples;  // after warm-up
  double duration_s = 0;        // of the measured part
  std::vector<ResourcePoint> resources;
};

absl::StatusOr<LoadResult> RunLoad(const LoadOptions& options);

// Reads VmRSS (KiB) and the number of open fds of a process from /proc.
absl::StatusOr<ResourcePoint> SampleProcess(int pid);

}  // namespace load
}  // namespace kvt
