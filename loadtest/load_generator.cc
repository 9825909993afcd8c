#include "loadtest/load_generator.h"

#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "common/mutex.h"
#include "kernels/dtype.h"

namespace kvt {
namespace load {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// One prepared request kind: a source cache of the mapper's source shape.
struct PreparedWorkload {
  WorkloadItem item;
  HostCache source;
  int64_t source_bytes = 0;
};

absl::StatusOr<std::vector<PreparedWorkload>> Prepare(const LoadOptions& options) {
  std::unique_ptr<Client> client = Client::Create(options.server);
  absl::StatusOr<v1::ListMappersResponse> list = client->ListMappers();
  if (!list.ok()) return list.status();
  std::map<std::string, v1::MapperInfo> servable;
  for (const v1::MapperInfo& info : list->mappers()) {
    if (info.state() == v1::MAPPER_STATE_HOST_RESIDENT ||
        info.state() == v1::MAPPER_STATE_DEVICE_RESIDENT) {
      servable[info.mapper_id()] = info;
    }
  }
  std::vector<WorkloadItem> mix = options.mix;
  if (mix.empty()) {
    for (const auto& [id, info] : servable) mix.push_back({id, 512, 1.0});
  }
  if (mix.empty()) return absl::FailedPreconditionError("the server has no servable mapper");
  std::vector<PreparedWorkload> prepared;
  std::mt19937_64 rng(options.seed);
  std::normal_distribution<double> normal;
  for (const WorkloadItem& item : mix) {
    auto it = servable.find(item.mapper_id);
    if (it == servable.end()) {
      return absl::NotFoundError(
          absl::StrCat("mix names mapper '", item.mapper_id, "', which the server does not serve"));
    }
    PreparedWorkload workload;
    workload.item = item;
    HostCache& cache = workload.source;
    cache.dtype = options.dtype;
    cache.layout = options.layout;
    cache.num_layers = static_cast<int>(it->second.source_shape().num_layers());
    cache.num_kv_heads = static_cast<int>(it->second.source_shape().num_kv_heads());
    cache.head_dim = static_cast<int>(it->second.source_shape().head_dim());
    cache.num_tokens = item.tokens;
    cache.Allocate();
    // Unit-variance values: the scale of real caches. Generated once, sent many times.
    const int64_t elements = cache.layer_bytes() / static_cast<int64_t>(DTypeSize(cache.dtype));
    for (int layer = 0; layer < cache.num_layers; ++layer) {
      for (int64_t i = 0; i < elements; ++i) {
        StoreFromDouble(cache.dtype, cache.k[layer].data(), i, normal(rng));
        StoreFromDouble(cache.dtype, cache.v[layer].data(), i, normal(rng));
      }
    }
    workload.source_bytes = 2 * cache.num_layers * cache.layer_bytes();
    prepared.push_back(std::move(workload));
  }
  return prepared;
}

}  // namespace

absl::StatusOr<std::vector<WorkloadItem>> ParseMix(const std::string& mix) {
  std::vector<WorkloadItem> items;
  if (mix.empty()) return items;
  for (absl::string_view entry : absl::StrSplit(mix, ',', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(entry, ':');
    WorkloadItem item;
    if (parts.empty() || parts.size() > 3 || parts[0].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--mix entry '", entry, "': expected MAPPER[:TOKENS[:WEIGHT]]"));
    }
    item.mapper_id = parts[0];
    if (parts.size() >= 2 && (!absl::SimpleAtoi(parts[1], &item.tokens) || item.tokens <= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--mix entry '", entry, "': tokens must be a positive integer"));
    }
    if (parts.size() == 3 && (!absl::SimpleAtod(parts[2], &item.weight) || item.weight <= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--mix entry '", entry, "': weight must be a positive number"));
    }
    items.push_back(item);
  }
  return items;
}

absl::StatusOr<ResourcePoint> SampleProcess(int pid) {
  ResourcePoint point;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  if (!status) return absl::NotFoundError(absl::StrCat("no process ", pid));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      std::istringstream fields(line.substr(6));
      fields >> point.rss_kib;
    }
  }
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return absl::PermissionDeniedError(absl::StrCat("cannot list fds of ", pid));
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++point.open_fds;
  }
  closedir(dir);
  return point;
}

absl::StatusOr<LoadResult> RunLoad(const LoadOptions& options) {
  if (options.duration_s <= 0 && options.max_requests <= 0) {
    return absl::InvalidArgumentError("set a duration or a request budget: kvt-load always stops");
  }
  if (options.concurrency < 1) return absl::InvalidArgumentError("concurrency must be >= 1");
  if (options.mode == LoopMode::kOpen && options.rate <= 0) {
    return absl::InvalidArgumentError("open loop needs --rate > 0");
  }
  absl::StatusOr<std::vector<PreparedWorkload>> workloads = Prepare(options);
  if (!workloads.ok()) return workloads.status();
  std::vector<double> weights;
  for (const PreparedWorkload& w : *workloads) weights.push_back(w.item.weight);

  // Open loop: the whole arrival schedule up front, so it does not depend on how the server does.
  std::vector<double> arrivals;
  if (options.mode == LoopMode::kOpen) {
    std::mt19937_64 rng(options.seed ^ 0x5eedull);
    std::exponential_distribution<double> gap(options.rate);
    double t = 0;
    while (true) {
      t += gap(rng);
      if (options.duration_s > 0 && t > options.duration_s) break;
      if (options.max_requests > 0 && static_cast<int64_t>(arrivals.size()) >= options.max_requests) {
        break;
      }
      arrivals.push_back(t);
    }
  }

  const Clock::time_point start = Clock::now();
  std::atomic<int64_t> issued{0};
  std::atomic<bool> stop_sampling{false};
  Mutex samples_mutex;
  std::vector<Sample> samples;
  LoadResult result;

  std::thread sampler;
  if (options.server_pid > 0) {
    sampler = std::thread([&] {
      while (!stop_sampling.load()) {
        absl::StatusOr<ResourcePoint> point = SampleProcess(options.server_pid);
        if (point.ok()) {
          point->t_s = SecondsSince(start);
          MutexLock lock(&samples_mutex);
          result.resources.push_back(*point);
        }
        for (int i = 0; i < 10 && !stop_sampling.load(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
    });
  }

  auto worker = [&](int index) {
    ClientOptions client_options;
    client_options.chunk_bytes = options.chunk_bytes;
    client_options.timeout =
        std::chrono::milliseconds(static_cast<int64_t>(options.request_timeout_s * 1000));
    std::unique_ptr<Client> client = Client::Create(options.server, client_options);
    std::mt19937_64 rng(options.seed + 1000 + index);
    std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
    std::vector<Sample> local;
    // Each result is written into the previous one's buffers: fresh ones would cost this
    // worker a page fault per 4 KiB, on the cores the measured server may share.
    HostCache recycled;
    while (true) {
      const int64_t n = issued.fetch_add(1);
      double scheduled;
      if (options.mode == LoopMode::kOpen) {
        if (n >= static_cast<int64_t>(arrivals.size())) break;
        scheduled = arrivals[n];
        const double wait = scheduled - SecondsSince(start);
        if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      } else {
        if (options.max_requests > 0 && n >= options.max_requests) break;
        scheduled = SecondsSince(start);
        if (options.duration_s > 0 && scheduled > options.duration_s) break;
      }
      const PreparedWorkload& workload = (*workloads)[pick(rng)];
      v1::TranslateHeader header;
      header.set_mapper_id(workload.item.mapper_id);
      header.set_request_id(absl::StrCat("kvt-load-", n));
      TranslateStreamOptions stream_options;
      stream_options.recycled_target = std::move(recycled);
      absl::StatusOr<TranslateResult> translated =
          client->Translate(header, workload.source, std::move(stream_options));
      Sample sample;
      sample.start_s = scheduled;
      sample.latency_ms = (SecondsSince(start) - scheduled) * 1000.0;
      sample.mapper_id = workload.item.mapper_id;
      sample.tokens = workload.item.tokens;
      sample.code = translated.status().code();
      if (translated.ok()) {
        sample.bytes = workload.source_bytes +
                       static_cast<int64_t>(translated->trailer.output_bytes());
        recycled = std::move(translated->target);
      }
      local.push_back(sample);
    }
    MutexLock lock(&samples_mutex);
    samples.insert(samples.end(), local.begin(), local.end());
  };
  std::vector<std::thread> workers;
  for (int i = 0; i < options.concurrency; ++i) workers.emplace_back(worker, i);
  for (std::thread& thread : workers) thread.join();
  const double elapsed = SecondsSince(start);
  stop_sampling.store(true);
  if (sampler.joinable()) sampler.join();

  std::sort(samples.begin(), samples.end(),
            [](const Sample& a, const Sample& b) { return a.start_s < b.start_s; });
  for (const Sample& sample : samples) {
    if (sample.start_s >= options.warmup_s) result.samples.push_back(sample);
  }
  result.duration_s = std::max(1e-9, elapsed - std::min(options.warmup_s, elapsed));
  return result;
}

}  // namespace load
}  // namespace kvt
