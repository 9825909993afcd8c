// Throughput of `kvt fit`'s streaming accumulation against plain dsyrk/dgemm calls of the same
// shapes in the same run (target: >= 0.8x), plus the peak resident memory. docs/BENCHMARKS.md.
//
//   bazel build -c opt //fit:accumulate_benchmark
//   bazel-bin/fit/accumulate_benchmark --benchmark_repetitions=3
#include <cblas.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "fit/calibration.h"
#include "fit/fit.h"
#include "fit/stats.h"

namespace kvt {
namespace fit {
namespace {

// A scaled-down Qwen3 pair: 8 KV heads x 128 dims on both sides.
constexpr int kHeads = 8;
constexpr int kHeadDim = 128;
constexpr int64_t kWidth = kHeads * kHeadDim;

ModelSpec Model(int layers) {
  ModelSpec m;
  m.name = "bench";
  m.num_layers = layers;
  m.num_kv_heads = kHeads;
  m.head_dim = kHeadDim;
  m.rope.rotary_dim = kHeadDim;
  return m;
}

FeatureRows RandomRows(int64_t rows, int source_layers, int target_layers) {
  FeatureRows f;
  f.Reset(source_layers * kWidth, target_layers * kWidth);
  f.Resize(rows);
  std::mt19937_64 rng(1);
  std::normal_distribution<double> normal;
  for (std::vector<double>* m : {&f.source_k, &f.source_v, &f.target_k, &f.target_v}) {
    for (double& x : *m) x = normal(rng);
  }
  return f;
}

double PeakRssMiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

// Final pass of one target layer fed by k source layers: Gram blocks of the k layers and their
// cross-covariance with the target layer, K and V. FLOPs: dsyrk N (kD)(kD+1) + dgemm 2 N kD D,
// twice.
double FinalFlops(int64_t n, int k) {
  const double kd = k * kWidth;
  return 2 * (n * kd * (kd + 1) + 2.0 * n * kd * kWidth);
}

void BM_FinalAccumulate(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int k = state.range(1);
  SetBlasThreads(0);
  const FitShape shape{Model(k), Model(1)};
  std::vector<int> sigma(k);
  for (int j = 0; j < k; ++j) sigma[j] = j;
  const FeatureRows rows = RandomRows(n, k, 1);
  for (auto _ : state) {
    state.PauseTiming();
    FinalAccumulator accumulator(shape, BlockPlan::FromSigma({sigma}));
    state.ResumeTiming();
    accumulator.Add(rows, /*heldout=*/false);
    benchmark::DoNotOptimize(accumulator.stats().arrays.size());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(FinalFlops(n, k) / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_rss_MiB"] = PeakRssMiB();
}

// The same FLOPs as plain BLAS on contiguous operands: one dsyrk of [N, kD] and one dgemm
// [kD, N] x [N, D], for K and for V.
void BM_FinalPlainBlas(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int k = state.range(1);
  SetBlasThreads(0);
  const int64_t kd = k * kWidth;
  const FeatureRows rows = RandomRows(n, k, 1);
  std::vector<double> gram(kd * kd), cross(kd * kWidth);
  for (auto _ : state) {
    for (int c = 0; c < 2; ++c) {
      const double* x = (c == 0 ? rows.source_k : rows.source_v).data();
      const double* y = (c == 0 ? rows.target_k : rows.target_v).data();
      cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, kd, n, 1.0, x, kd, 1.0, gram.data(), kd);
      cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, kd, kWidth, n, 1.0, x, kd, y, kWidth,
                  1.0, cross.data(), kWidth);
    }
    benchmark::DoNotOptimize(gram.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(FinalFlops(n, k) / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_rss_MiB"] = PeakRssMiB();
}

// Probe pass (matched heads): per source layer the layer Gram, per head the cross-covariance of
// head h across all L_s source layers with head h across all L_t target layers, K and V.
double ProbeFlops(int64_t n, int ls, int lt) {
  const double gram = ls * n * kWidth * (kWidth + 1.0);
  const double cross = kHeads * 2.0 * n * (ls * kHeadDim) * (lt * kHeadDim);
  return 2 * (gram + cross);
}

void BM_ProbeAccumulate(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int ls = state.range(1), lt = state.range(2);
  SetBlasThreads(0);
  const FitShape shape{Model(ls), Model(lt)};
  const FeatureRows rows = RandomRows(n, ls, lt);
  for (auto _ : state) {
    state.PauseTiming();
    ProbeAccumulator accumulator(shape);
    state.ResumeTiming();
    accumulator.Add(rows);
    benchmark::DoNotOptimize(accumulator.stats().arrays.size());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(ProbeFlops(n, ls, lt) / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_rss_MiB"] = PeakRssMiB();
}

// Baseline: the same dsyrk per source layer and dgemm per head on operands already gathered
// head-contiguous (the accumulator gathers them itself).
void BM_ProbePlainBlas(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int ls = state.range(1), lt = state.range(2);
  SetBlasThreads(0);
  const FeatureRows rows = RandomRows(n, ls, lt);
  std::vector<double> gram(kWidth * kWidth), cross(ls * kHeadDim * lt * kHeadDim);
  std::vector<double> hx(n * ls * kHeadDim), hy(n * lt * kHeadDim, 0.5);
  for (size_t i = 0; i < hx.size(); ++i) hx[i] = rows.source_k[i];
  for (auto _ : state) {
    for (int c = 0; c < 2; ++c) {
      const double* x = (c == 0 ? rows.source_k : rows.source_v).data();
      for (int j = 0; j < ls; ++j) {
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, kWidth, n, 1.0, x + j * kWidth,
                    ls * kWidth, 1.0, gram.data(), kWidth);
      }
      for (int h = 0; h < kHeads; ++h) {
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ls * kHeadDim, lt * kHeadDim, n, 1.0,
                    hx.data(), ls * kHeadDim, hy.data(), lt * kHeadDim, 1.0, cross.data(),
                    lt * kHeadDim);
      }
    }
    benchmark::DoNotOptimize(cross.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(ProbeFlops(n, ls, lt) / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_rss_MiB"] = PeakRssMiB();
}

void FinalArgs(benchmark::internal::Benchmark* b) {
  b->Args({4096, 1})->Args({4096, 2})->Args({2048, 4})->Unit(benchmark::kMillisecond);
  b->UseRealTime();
}
void ProbeArgs(benchmark::internal::Benchmark* b) {
  b->Args({2048, 8, 12})->Args({4096, 8, 12})->Unit(benchmark::kMillisecond);
  b->UseRealTime();
}

BENCHMARK(BM_FinalAccumulate)->Apply(FinalArgs);
BENCHMARK(BM_FinalPlainBlas)->Apply(FinalArgs);
BENCHMARK(BM_ProbeAccumulate)->Apply(ProbeArgs);
BENCHMARK(BM_ProbePlainBlas)->Apply(ProbeArgs);

// Prints accumulate / plain ratios of the best GFLOP/s per shape after the run.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.run_type != Run::RT_Iteration) continue;
      auto it = run.counters.find("GFLOP/s");
      if (it == run.counters.end()) continue;
      double& best = best_[run.benchmark_name()];
      best = std::max(best, static_cast<double>(it->second));
    }
    ConsoleReporter::ReportRuns(runs);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nratio = accumulate / plain BLAS, best GFLOP/s of each (threads: %u)\n",
                std::thread::hardware_concurrency());
    for (const auto& [name, rate] : best_) {
      for (const char* kind : {"Final", "Probe"}) {
        const std::string prefix = std::string("BM_") + kind + "Accumulate";
        if (name.rfind(prefix, 0) != 0) continue;
        std::string twin = name;
        twin.replace(0, prefix.size(), std::string("BM_") + kind + "PlainBlas");
        auto other = best_.find(twin);
        if (other == best_.end()) continue;
        std::printf("  %-40s %8.1f vs %8.1f GFLOP/s  ratio %.3f\n", name.c_str(), rate,
                    other->second, rate / other->second);
      }
    }
    std::printf("peak RSS %.0f MiB\n", PeakRssMiB());
  }

 private:
  std::map<std::string, double> best_;
};

}  // namespace
}  // namespace fit
}  // namespace kvt

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  kvt::fit::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
