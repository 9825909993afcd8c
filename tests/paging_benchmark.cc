// Cold vs warm translate latency through the mapper store, and page-in bandwidth. Not a test:
//
//   bazel run -c opt //tests:paging_benchmark -- [--preset=NAME] [--backend=auto|cpu|cuda]
//       [--tokens=N] [--benchmark_repetitions=...]
//
// Warm: the mapper's copy is resident on the compute device; a request acquires it and
// translates every layer. Cold (device): the device copy was dropped; the request pages it in
// (streamed per layer where the backend supports it) and computes meanwhile. Cold (disk): the
// mapper was unloaded from every tier and its files dropped from the kernel's page cache
// (fdatasync + posix_fadvise(POSIX_FADV_DONTNEED), checked with mincore before timing: a run
// where pages stay resident says so in its label and on stderr); the request reads and
// verifies it from the disk first. Cold (page cache): the same with the files left in the page
// cache, i.e. read + verify from memory.
// PageIn: the device page-in alone, reported as bytes/s; with CUDA the same run also times a
// plain cudaMemcpy of the same bytes from pinned memory (PinnedMemcpy), the ceiling.
// Default mapper: a mid-size synthetic pair (16 -> 20 layers, 4 x 128 heads, k = 4, bf16:
// 84 MB); --preset takes a `kvt synth` preset (e.g. qwen3-14b-to-32b, 2.1 GB) for GPU boxes.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "benchmark/benchmark.h"
#include "common/file_util.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "mapper_store/pinned_memory.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "server/backend_select.h"

namespace kvt {
namespace {

struct Env {
  std::string dir;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<MapperStore> store;
  ModelSpec source_model, target_model;
  int64_t tokens = 1024;
  DType dtype = DType::kBF16;
  std::vector<std::vector<char>> source_k, source_v, target_k, target_v;
  CacheView source;
  MutableCacheView target;
  uint64_t prepared_bytes = 0;
  uint64_t host_bytes = 0;
  double last_page_in_seconds = 0;
};
Env* env = nullptr;

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(status.message()).c_str());
    std::exit(1);
  }
}

std::vector<std::vector<char>> Layers(const ModelSpec& model, int64_t tokens, DType dtype,
                                      std::mt19937_64* rng) {
  const int64_t elements = int64_t{model.num_kv_heads} * model.head_dim * tokens;
  std::vector<std::vector<char>> layers(model.num_layers,
                                        std::vector<char>(elements * DTypeSize(dtype)));
  std::normal_distribution<double> normal;
  if (rng == nullptr) return layers;
  for (auto& layer : layers) {
    for (int64_t i = 0; i < elements; ++i) StoreFromDouble(dtype, layer.data(), i, normal(*rng));
  }
  return layers;
}

void Setup(const std::string& preset, const std::string& backend_type, int64_t tokens) {
  env = new Env();
  const char* tmp = std::getenv("TMPDIR");
  env->dir = absl::StrCat(tmp ? tmp : "/tmp", "/kvt_paging_benchmark_", getpid());
  SynthOptions options;
  if (preset.empty()) {
    options.source = NeoxModelSpec("bench/source", 16, 4, 128);
    options.target = NeoxModelSpec("bench/target", 20, 4, 128);
    options.k = 4;
    options.dtype = DType::kBF16;
  } else {
    absl::StatusOr<SynthOptions> found = SynthPreset(preset);
    Check(found.status(), "--preset");
    options = *found;
  }
  Check(WriteSynthMapper(JoinPath(env->dir, "m"), options), "writing the mapper");
  KvtdConfig::Backend backend_config;
  backend_config.type = backend_type;
  absl::StatusOr<SelectedBackend> selected = SelectBackend(backend_config);
  Check(selected.status(), "--backend");
  env->backend = std::move(selected->backend);
  StoreOptions store_options;
  store_options.devices = {{env->backend.get(), 0}};
  store_options.events.page_in = [](const LoadedMapper&, const std::string& place,
                                    double seconds) {
    if (place != "host") env->last_page_in_seconds = seconds;
  };
  absl::StatusOr<std::unique_ptr<MapperStore>> store =
      MapperStore::Open(env->dir, store_options);
  Check(store.status(), "opening the store");
  env->store = std::move(*store);
  absl::StatusOr<MapperInfo> info = env->store->Load("m", "any", absl::InfiniteFuture());
  Check(info.status(), "loading the mapper");
  env->host_bytes = info->weight_bytes;
  env->prepared_bytes = info->placements.back().bytes;
  env->source_model = options.source;
  env->target_model = options.target;
  env->tokens = tokens;
  std::mt19937_64 rng(1);
  env->source_k = Layers(options.source, tokens, env->dtype, &rng);
  env->source_v = Layers(options.source, tokens, env->dtype, &rng);
  env->target_k = Layers(options.target, tokens, env->dtype, nullptr);
  env->target_v = Layers(options.target, tokens, env->dtype, nullptr);
  CacheView& s = env->source;
  s.dtype = env->dtype;
  s.layout = Layout::kNHD;
  s.num_kv_heads = options.source.num_kv_heads;
  s.head_dim = options.source.head_dim;
  s.num_tokens = tokens;
  for (int l = 0; l < options.source.num_layers; ++l) {
    s.k.push_back(env->source_k[l].data());
    s.v.push_back(env->source_v[l].data());
  }
  MutableCacheView& t = env->target;
  t.dtype = env->dtype;
  t.layout = Layout::kNHD;
  t.num_kv_heads = options.target.num_kv_heads;
  t.head_dim = options.target.head_dim;
  t.num_tokens = tokens;
  for (int l = 0; l < options.target.num_layers; ++l) {
    t.k.push_back(env->target_k[l].data());
    t.v.push_back(env->target_v[l].data());
  }
  std::fprintf(stderr,
               "mapper: %s -> %s, %lld host bytes, %lld prepared bytes on %s; %lld tokens\n",
               options.source.name.c_str(), options.target.name.c_str(),
               static_cast<long long>(env->host_bytes),
               static_cast<long long>(env->prepared_bytes), env->backend->device().c_str(),
               static_cast<long long>(tokens));
}

// One request: acquire (paging in what is missing), translate every layer as it arrives.
void Request() {
  AcquireOptions options;
  options.device = "any";
  absl::StatusOr<MapperHandle> handle = env->store->Acquire("m", options);
  Check(handle.status(), "acquire");
  for (int l = 0; l < env->target_model.num_layers; ++l) {
    Check(handle->WaitLayerReady(l, absl::InfiniteFuture()), "layer wait");
    Check(handle->backend()->TranslateLayer(*handle->prepared(), l, env->source, Positions{0},
                                            TranslateOptions(), &env->target),
          "translate");
  }
}

void Report(benchmark::State& state) {
  state.counters["tokens"] = static_cast<double>(env->tokens);
  state.counters["mapper_MB"] = static_cast<double>(env->host_bytes) / 1e6;
}

void BM_TranslateWarm(benchmark::State& state) {
  env->store->Load("m", "any", absl::InfiniteFuture()).IgnoreError();
  for (auto _ : state) Request();
  Report(state);
}

void BM_TranslateColdDevice(benchmark::State& state) {
  for (auto _ : state) {
    state.PauseTiming();
    Check(env->store->Unload("m", env->backend->device(), absl::InfiniteFuture()).status(),
          "unload device");
    state.ResumeTiming();
    Request();
  }
  Report(state);
}

// Pages of the mapper's files: in total, and still in the page cache.
struct Residency {
  int64_t pages = 0;
  int64_t resident = 0;
  std::string error;  // the first refusal (fdatasync, fadvise, mmap or mincore), if any
};

// Every regular file under the mapper directory: written back (dirty pages cannot be dropped),
// dropped from the page cache, then counted page by page with mincore (which does not fault
// pages in).
Residency DropFromPageCache(const std::string& dir) {
  Residency r;
  const int64_t page = sysconf(_SC_PAGESIZE);
  auto refuse = [&](const std::string& what, const std::string& path) {
    if (r.error.empty()) r.error = absl::StrCat(what, " ", path, ": ", std::strerror(errno));
  };
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string path = entry.path().string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      refuse("open", path);
      continue;
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || st.st_size == 0) {
      ::close(fd);
      continue;
    }
    if (::fdatasync(fd) != 0) refuse("fdatasync", path);
    if (const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED); rc != 0) {
      errno = rc;
      refuse("posix_fadvise(DONTNEED)", path);
    }
    const int64_t pages = (st.st_size + page - 1) / page;
    r.pages += pages;
    void* map = ::mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
      refuse("mmap", path);
      r.resident += pages;  // unknown: count it as not cold
    } else {
      std::vector<unsigned char> in_core(pages);
      if (::mincore(map, st.st_size, in_core.data()) != 0) {
        refuse("mincore", path);
        r.resident += pages;
      } else {
        for (unsigned char c : in_core) r.resident += c & 1;
      }
      ::munmap(map, st.st_size);
    }
    ::close(fd);
  }
  return r;
}

// `drop_page_cache`: the files are evicted from the page cache before each request (cold
// disk); otherwise they stay there from the previous request's read (cold page cache).
void TranslateFromDisk(benchmark::State& state, bool drop_page_cache) {
  int64_t resident = 0, pages = 0, not_cold = 0;
  std::string error;
  for (auto _ : state) {
    state.PauseTiming();
    Check(env->store->Unload("m", "", absl::InfiniteFuture()).status(), "unload");
    if (drop_page_cache) {
      const Residency r = DropFromPageCache(JoinPath(env->dir, "m"));
      resident += r.resident;
      pages = r.pages;
      if (r.resident > 0) ++not_cold;
      if (error.empty()) error = r.error;
    }
    state.ResumeTiming();
    Request();
  }
  Report(state);
  if (!drop_page_cache) return;
  state.counters["resident_pages"] =
      static_cast<double>(resident) / std::max<int64_t>(1, state.iterations());
  state.counters["file_pages"] = static_cast<double>(pages);
  if (not_cold > 0 || !error.empty()) {
    const std::string label =
        absl::StrCat("NOT COLD: ", not_cold, " of ", state.iterations(),
                     " requests started with pages in the page cache (", resident, " pages)",
                     error.empty() ? "" : "; ", error);
    std::fprintf(stderr, "TranslateColdDisk: %s\n", label.c_str());
    state.SetLabel(label);
  } else {
    state.SetLabel("page cache dropped, mincore: 0 resident");
  }
}

void BM_TranslateColdDisk(benchmark::State& state) { TranslateFromDisk(state, true); }
void BM_TranslateColdPageCache(benchmark::State& state) { TranslateFromDisk(state, false); }

// The device page-in alone (every layer arrived), as bytes per second of the device copy.
void BM_PageIn(benchmark::State& state) {
  for (auto _ : state) {
    state.PauseTiming();
    Check(env->store->Unload("m", env->backend->device(), absl::InfiniteFuture()).status(),
          "unload device");
    state.ResumeTiming();
    Check(env->store->Load("m", env->backend->device(), absl::InfiniteFuture()).status(),
          "page-in");
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * env->prepared_bytes));
  Report(state);
}

// The ceiling for PageIn on a GPU: one plain pinned cudaMemcpy of the same bytes.
void BM_PinnedMemcpy(benchmark::State& state) {
  for (auto _ : state) {
    absl::StatusOr<double> seconds = PinnedHostToDeviceSeconds(env->prepared_bytes, 1);
    if (!seconds.ok()) {
      state.SkipWithError(std::string(seconds.status().message()).c_str());
      return;
    }
    state.SetIterationTime(*seconds);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * env->prepared_bytes));
}

}  // namespace
}  // namespace kvt

int main(int argc, char** argv) {
  std::string preset, backend = "auto";
  int64_t tokens = 1024;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (absl::StartsWith(arg, "--preset=")) {
      preset = arg.substr(9);
    } else if (absl::StartsWith(arg, "--backend=")) {
      backend = arg.substr(10);
    } else if (absl::StartsWith(arg, "--tokens=")) {
      if (!absl::SimpleAtoi(arg.substr(9), &tokens) || tokens <= 0) {
        std::fprintf(stderr, "--tokens must be a positive integer\n");
        return 2;
      }
    } else {
      rest.push_back(argv[i]);
    }
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  kvt::Setup(preset, backend, tokens);
  benchmark::RegisterBenchmark("TranslateWarm", kvt::BM_TranslateWarm)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("TranslateColdDevice", kvt::BM_TranslateColdDevice)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("TranslateColdDisk", kvt::BM_TranslateColdDisk)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("TranslateColdPageCache", kvt::BM_TranslateColdPageCache)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("PageIn", kvt::BM_PageIn)
      ->UseRealTime()  // the copy runs on the store's worker, not this thread
      ->Unit(benchmark::kMillisecond);
  if (kvt::env->backend->name() == "cuda") {
    benchmark::RegisterBenchmark("PinnedMemcpy", kvt::BM_PinnedMemcpy)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  kvt::RemoveTree(kvt::env->dir).IgnoreError();
  return 0;
}
