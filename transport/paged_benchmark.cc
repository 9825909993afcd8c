// kvtd's in-place publish reads a request's blocks out of vLLM's paged cache (GatherPaged), and an
// in-place load writes them back (ScatterPaged). In vLLM's CPU order K is transposed per block
// and head ([head_dim, block_size]), so K costs a transpose and V a copy of head vectors. Side by
// side: GatherPaged of K and of V, an element-by-element transpose of K (the simple loop), and
// memcpy of the same bytes (the floor). Qwen3-0.6B's cache: 28 layers x 8 KV heads x 128, bf16,
// block 32.
//
//   bazel run -c opt //transport:paged_benchmark -- --benchmark_repetitions=3
#include <cstdint>
#include <cstring>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/types.h"
#include "transport/paged.h"
#include "transport/paged_testing.h"

namespace kvt {
namespace {

constexpr int64_t kLayers = 28, kHeads = 8, kDim = 128, kBlockSize = 32;

struct Cache {
  explicit Cache(int64_t tokens)
      : tokens(tokens), blocks((tokens + kBlockSize - 1) / kBlockSize) {
    paged = VllmCpuOrder(blocks, kBlockSize, kHeads, kDim, 2, kLayers);
    region.assign(static_cast<size_t>(kLayers * blocks * paged.BlockStride()), 0x3f80);
    for (int64_t b = 0; b < blocks; ++b) table.push_back(static_cast<uint32_t>((b * 7) % blocks));
    out.assign(static_cast<size_t>(kLayers * kHeads * tokens * kDim), 0);
  }
  int64_t layer_elements() const { return kHeads * tokens * kDim; }
  int64_t bytes() const { return kLayers * layer_elements() * 2; }  // one kind, every layer
  const int64_t tokens, blocks;
  PagedLayout paged;
  std::vector<uint16_t> region, out;
  std::vector<uint32_t> table;
};

// Args: tokens, kind (0 = K, transposed in the engine's blocks; 1 = V).
void BM_GatherPaged(benchmark::State& state) {
  Cache c(state.range(0));
  const int kind = static_cast<int>(state.range(1));
  const LayerGeometry g{Layout::kNHD, kHeads, c.tokens, kDim, 2};
  for (auto _ : state) {
    for (int64_t l = 0; l < kLayers; ++l) {
      GatherPaged(c.paged, c.table.data(), kind,
                  reinterpret_cast<const char*>(c.region.data()) + c.paged.LayerOffset(static_cast<int>(l)), g,
                  c.out.data() + l * c.layer_elements());
    }
    benchmark::DoNotOptimize(c.out.data());
  }
  state.SetBytesProcessed(state.iterations() * c.bytes());
}
BENCHMARK(BM_GatherPaged)->ArgsProduct({{1024, 4096}, {0, 1}})->Unit(benchmark::kMillisecond);

// The simple loop for K: one element at a time, slot innermost.
void BM_GatherKElementLoop(benchmark::State& state) {
  Cache c(state.range(0));
  const BlockStrides s = c.paged.Strides(0);
  for (auto _ : state) {
    for (int64_t l = 0; l < kLayers; ++l) {
      const uint16_t* layer = c.region.data() + c.paged.LayerOffset(static_cast<int>(l)) / 2;
      uint16_t* dst = c.out.data() + l * c.layer_elements();
      for (int64_t t = 0; t < c.tokens; ++t) {
        const uint16_t* block = layer + c.table[t / kBlockSize] * c.paged.BlockStride() +
                                (t % kBlockSize) * s.slot_stride;
        for (int64_t h = 0; h < kHeads; ++h) {
          for (int64_t d = 0; d < kDim; ++d) {
            dst[(t * kHeads + h) * kDim + d] = block[h * s.head_stride + d * s.dim_stride];
          }
        }
      }
    }
    benchmark::DoNotOptimize(c.out.data());
  }
  state.SetBytesProcessed(state.iterations() * c.bytes());
}
BENCHMARK(BM_GatherKElementLoop)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);

// memcpy of the same bytes out of the region: what any gather costs at least.
void BM_Memcpy(benchmark::State& state) {
  Cache c(state.range(0));
  for (auto _ : state) {
    for (int64_t l = 0; l < kLayers; ++l) {
      std::memcpy(c.out.data() + l * c.layer_elements(),
                  c.region.data() + c.paged.LayerOffset(static_cast<int>(l)) / 2,
                  static_cast<size_t>(c.layer_elements() * 2));
    }
    benchmark::DoNotOptimize(c.out.data());
  }
  state.SetBytesProcessed(state.iterations() * c.bytes());
}
BENCHMARK(BM_Memcpy)->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvt

BENCHMARK_MAIN();
