// Cost of live verification's comparison (docs/OPERATIONS.md "Live verification"): one target
// layer of a translated cache against the target's own, bf16 -> float for both, then
// ComputeLayerQuality (cosines only, as kvtd runs it; or with R^2 for comparison), per layer;
// the translation itself is the cost of the TranslateKV the sample replaced.
//
//   bazel build -c opt //quality:kv_cosine_benchmark
//   bazel-bin/quality/kv_cosine_benchmark --benchmark_repetitions=3
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/dtype.h"
#include "kernels/rope.h"
#include "quality/kv_quality.h"

namespace kvt {
namespace {

// Args: tokens, KV heads, head_dim (Qwen3-class: 8 x 128), cosines only (what live
// verification computes) or every metric without queries (R^2 too).
void BM_LayerComparison(benchmark::State& state) {
  const int64_t T = state.range(0);
  const int H = static_cast<int>(state.range(1));
  const int d = static_cast<int>(state.range(2));
  const int64_t n = T * H * d;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> mapped_k(n), mapped_v(n), own_k(n), own_v(n);
  for (std::vector<uint16_t>* x : {&mapped_k, &mapped_v, &own_k, &own_v}) {
    for (uint16_t& v : *x) v = FloatToBF16(normal(rng));
  }
  RopeConfig config;
  config.theta = 1000000;
  config.rotary_dim = d;
  absl::StatusOr<Rope> rope = Rope::Create(config, d);
  if (!rope.ok()) {
    state.SkipWithError("rope");
    return;
  }
  std::vector<float> mk(n), mv(n), ok(n), ov(n);
  for (auto _ : state) {
    ToTokenMajorFloat(DType::kBF16, Layout::kNHD, H, T, d, mapped_k.data(), mk.data());
    ToTokenMajorFloat(DType::kBF16, Layout::kNHD, H, T, d, mapped_v.data(), mv.data());
    ToTokenMajorFloat(DType::kBF16, Layout::kNHD, H, T, d, own_k.data(), ok.data());
    ToTokenMajorFloat(DType::kBF16, Layout::kNHD, H, T, d, own_v.data(), ov.data());
    LayerQualityInputs in;
    in.num_tokens = T;
    in.num_kv_heads = H;
    in.head_dim = d;
    in.k_mapped = mk.data();
    in.v_mapped = mv.data();
    in.k_true = ok.data();
    in.v_true = ov.data();
    in.cosines_only = state.range(3) != 0;
    absl::StatusOr<LayerQuality> quality = ComputeLayerQuality(in, *rope, Positions{});
    benchmark::DoNotOptimize(quality);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_LayerComparison)
    ->Args({512, 8, 128, 1})
    ->Args({512, 8, 128, 0})
    ->Args({2048, 8, 128, 1})
    ->Args({512, 2, 32, 1})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kvt

BENCHMARK_MAIN();
