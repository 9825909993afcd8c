// CPU translate time against bare GEMMs of the same FLOPs, measured in the same run.
//
//   bazel build -c opt //kernels:cpu_backend_benchmark
//   bazel-out/k8-opt/bin/kernels/cpu_backend_benchmark --benchmark_repetitions=3
//       --benchmark_enable_random_interleaving=true    (one command line)
//
// Shapes are a scaled-down Qwen3 pair (8 KV heads x 128 dims on both sides, bf16 caches and
// weights, sigma = every source layer) with fewer target layers so 2 cores finish in minutes.
// Each shape T/k/L/chunk runs five benchmarks back to back:
//   BM_Translate           the backend as it starts here (oneDNN bf16 on CPUs with AVX-512 BF16
//                          or AMX, else sgemm; --kvt_gemm_path=auto|bf16|fp32 forces one;
//                          --kvt_target_layout=NHD writes the target caches as vLLM's paged
//                          blocks hold them, [tokens, heads, dim], instead of HND);
//   BM_Bf16MatmulSameFlops its ceiling: 2 L bare oneDNN bf16 matmuls of T x (k n d) x (n d),
//                          prepacked weights (one matrix per GEMM), one primitive on every core;
//   BM_Bf16MatmulPerCore   the same matmuls split by rows over the cores as the backend splits
//                          tokens: the GEMM-only floor of its design;
//   BM_TranslateSgemmPath  the backend forced onto the sgemm path (fp32 weight copies);
//   BM_SgemmSameFlops      that path's ceiling: the same GEMMs as fp32 cblas_sgemm, OpenBLAS on
//                          every core, no gather and no epilogue.
// The program prints the ISA oneDNN dispatched first; at the end a table of GFLOP/s and ratios
// from the best repetition of each (wall time), the same comparisons in process CPU time (which
// a shared machine disturbs much less), and the oneDNN implementations the matmuls used.
// Results: docs/BENCHMARKS.md.
//
// MLP vs ridge of the same pair: BM_TranslateMlp/T/k/L/H/per_head runs the same shapes, caches
// and sigma as BM_Translate/T/k/L/0 with kind: mlp chains of hidden width H (per_layer or
// per_head), next to BM_TranslateMlpSgemmPath (the same on the sgemm path), and a last table
// prints tokens/s of each MLP next to its ridge twin and its sgemm-path twin:
//
//   bazel-out/k8-opt/bin/kernels/cpu_backend_benchmark
//       --benchmark_filter='BM_Translate(Mlp)?(SgemmPath)?/512/[24]/2/' --benchmark_repetitions=3
//
// Window vs token-wise of equal GEMM FLOPs: BM_TranslateWindow/T/k/L/w runs BM_Translate's
// shapes, caches and sigma (every one of k source layers) with a window-w ridge mapper
// (MapperView::window = w, weight rows w k n d, offset-major), on the same backend and gemm path.
// Its GEMMs have w k input blocks, the same as the token-wise BM_Translate/T/(w k)/L/0; what
// differs is the gather (w strided token reads per block, the RoPE strip of each block at its
// own token's position, zeros before the first token). A last table prints, for each window
// case, tokens/s next to that token-wise twin and the time ratio window / token-wise (wall,
// and process CPU time); w = 1 cases are the control (ratio 1 but for noise):
//
//   bazel-out/k8-opt/bin/kernels/cpu_backend_benchmark
//       --benchmark_filter='BM_TranslateWindow|BM_Translate/512/[28]/2/' --benchmark_repetitions=3
//       --benchmark_enable_random_interleaving=true
//
// Head-local (per_head) vs per_layer ridge at real model shapes, with --kvt_per_head (which
// registers these instead of everything above): BM_TranslatePairRidge/pair/T/k/per_head
// translates every target layer of pair 0 = Qwen3-0.6B -> 1.7B (28 -> 28 layers) or 1 =
// Qwen3-14B -> 32B (40 -> 64 layers), 8 KV heads x 128 on both sides, bf16 synthetic weights
// and caches, per_layer ([k n d, n d] per target layer and K|V) then per_head ([n, k d, d]),
// back to back; a last table prints per pair/T/k both translate times, their ratio (wall and
// process CPU time) and both mappers' bytes per direction with their ratio:
//
//   bazel-out/k8-opt/bin/kernels/cpu_backend_benchmark --kvt_per_head
//       [--benchmark_filter='BM_TranslatePairRidge/0/512/'] --benchmark_repetitions=3
#include <cblas.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/onednn_matmul.h"
#include "kernels/thread_pool.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace kvt {
namespace {

constexpr int kHeads = 8;
constexpr int kHeadDim = 128;
constexpr int64_t kWidth = kHeads * kHeadDim;

// --kvt_gemm_path: the path BM_Translate and BM_TranslateMlp run (default auto).
CpuGemmPath g_gemm_path = CpuGemmPath::kAuto;
// --kvt_target_layout: the target caches' layout (default HND, the Hugging Face cache's).
Layout g_target_layout = Layout::kHND;

// Fills with small pseudo-random values; quality is irrelevant, speed matters at 10^8 elements.
void Fill(DType dtype, void* data, int64_t count, uint64_t seed) {
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  std::vector<float> block(4096);
  for (int64_t first = 0; first < count; first += 4096) {
    const int64_t n = std::min<int64_t>(4096, count - first);
    for (int64_t i = 0; i < n; ++i) {
      state ^= state << 13;
      state ^= state >> 7;
      state ^= state << 17;
      block[i] = static_cast<float>(static_cast<int64_t>(state >> 40) - (1 << 23)) / (1 << 26);
    }
    FromFloat(dtype, block.data(), static_cast<char*>(data) + first * DTypeSize(dtype), n);
  }
}

RopeConfig Qwen3Rope() {
  RopeConfig rope;
  rope.theta = 1000000;
  rope.rotary_dim = kHeadDim;
  return rope;
}

double Flops(int64_t tokens, int64_t k, int64_t target_layers) {
  return 2.0 * tokens * (k * kWidth) * kWidth * 2 * target_layers;
}

// FLOPs of one MLP translation: per token, target layer and K|V, `heads` chains of
// in x H, H x H and H x out GEMMs (2 FLOPs per multiply-add).
double MlpFlops(int64_t tokens, int64_t k, int64_t target_layers, int64_t hidden, bool per_head) {
  const int64_t heads = per_head ? kHeads : 1;
  const int64_t out = per_head ? kHeadDim : kWidth;
  const double per_chain = static_cast<double>(k * kWidth) * hidden +
                           static_cast<double>(hidden) * hidden +
                           static_cast<double>(hidden) * out;
  return 2.0 * tokens * heads * per_chain * 2 * target_layers;
}

// A mapper with its weights, and bf16 caches (source HND, target g_target_layout), for one
// benchmark shape. hidden == 0: ridge;
// else kind: mlp with that hidden width. Ridge and MLP of one shape share sigma and caches.
// window > 1: a window mapper (input rows window k n d, offset-major; same sigma and caches).
struct Fixture {
  MapperView mapper;
  CacheView source{DType::kBF16, Layout::kHND, kHeads, kHeadDim, 0, {}, {}};
  MutableCacheView target{DType::kBF16, g_target_layout, kHeads, kHeadDim, 0, {}, {}};
  std::vector<std::vector<uint16_t>> weights, source_bytes, target_bytes;
};

// source_layers 0: k (sigma = every source layer). ridge_per_head: a head-local ridge mapper
// (MapperView::head_local), n stacked [window k d, d] matrices per target layer and K|V.
std::unique_ptr<Fixture> MakeFixture(int64_t tokens, int k, int target_layers, int64_t hidden,
                                     bool per_head, int window = 1, int source_layers = 0,
                                     bool ridge_per_head = false) {
  auto f = std::make_unique<Fixture>();
  if (source_layers == 0) source_layers = k;
  MapperView& mapper = f->mapper;
  mapper.kind = hidden > 0 ? MapKind::kMlp : MapKind::kRidge;
  mapper.window = window;
  mapper.head_local = ridge_per_head;
  mapper.source = {"source", source_layers, kHeads, kHeadDim, Qwen3Rope()};
  mapper.target = {"target", target_layers, kHeads, kHeadDim, Qwen3Rope()};
  f->weights.reserve(12 * target_layers);
  const auto weight = [&](int64_t rows, int64_t cols) {
    std::vector<uint16_t>& w = f->weights.emplace_back(rows * cols);
    Fill(DType::kBF16, w.data(), rows * cols, f->weights.size());
    return WeightView{w.data(), DType::kBF16, rows, cols};
  };
  const auto chain = [&](int64_t in) {
    MlpView m;
    m.heads = per_head ? kHeads : 1;
    m.hidden = hidden;
    const int64_t out = per_head ? kHeadDim : kWidth;
    m.a1 = weight(m.heads * in, hidden);
    m.c1 = weight(m.heads, hidden);
    m.a2 = weight(m.heads * hidden, hidden);
    m.c2 = weight(m.heads, hidden);
    m.a3 = weight(m.heads * hidden, out);
    m.c3 = weight(m.heads, out);
    return m;
  };
  for (int l = 0; l < target_layers; ++l) {
    LayerMapView layer;
    // The source layers at the target layer's relative depth and after it (distinct, k of them).
    const int first = static_cast<int>(static_cast<int64_t>(l) * source_layers / target_layers);
    for (int j = 0; j < k; ++j) layer.sigma_k.push_back((first + j) % source_layers);
    layer.sigma_v = layer.sigma_k;
    const int64_t inputs = static_cast<int64_t>(window) * k * kWidth;
    if (hidden > 0) {
      layer.mlp_k = chain(inputs);
      layer.mlp_v = chain(inputs);
    } else if (ridge_per_head) {
      const int64_t head_inputs = static_cast<int64_t>(window) * k * kHeadDim;
      layer.w_k = weight(kHeads * head_inputs, kHeadDim);
      layer.w_v = weight(kHeads * head_inputs, kHeadDim);
      layer.b_k = weight(kHeads, kHeadDim);
      layer.b_v = weight(kHeads, kHeadDim);
    } else {
      layer.w_k = weight(inputs, kWidth);
      layer.w_v = weight(inputs, kWidth);
      layer.b_k = weight(1, kWidth);
      layer.b_v = weight(1, kWidth);
    }
    mapper.layers.push_back(layer);
  }

  f->source.num_tokens = f->target.num_tokens = tokens;
  for (int j = 0; j < 2 * source_layers; ++j) {
    std::vector<uint16_t>& bytes = f->source_bytes.emplace_back(tokens * kWidth);
    Fill(DType::kBF16, bytes.data(), bytes.size(), 1000 + j);
    (j % 2 ? f->source.v : f->source.k).push_back(bytes.data());
  }
  for (int l = 0; l < 2 * target_layers; ++l) {
    std::vector<uint16_t>& bytes = f->target_bytes.emplace_back(tokens * kWidth);
    (l % 2 ? f->target.v : f->target.k).push_back(bytes.data());
  }
  return f;
}

void RunTranslate(benchmark::State& state, Fixture& f, int64_t chunk, double flops,
                  CpuGemmPath path) {
  CpuBackendOptions backend_options;
  backend_options.gemm_path = path;
  std::unique_ptr<Backend> backend = NewCpuBackend(backend_options);
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend->Prepare(f.mapper);
  if (!prepared.ok()) {
    state.SkipWithError(std::string(prepared.status().message()).c_str());
    return;
  }
  Positions positions;
  positions.offset = 100;
  TranslateOptions options;
  options.token_chunk = chunk;
  for (auto _ : state) {
    absl::Status status = backend->Translate(**prepared, f.source, positions, options, &f.target);
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(f.target.k[0]);
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.SetItemsProcessed(state.iterations() * f.source.num_tokens);
}

void BM_Translate(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int k = static_cast<int>(state.range(1));
  const int target_layers = static_cast<int>(state.range(2));
  std::unique_ptr<Fixture> f = MakeFixture(tokens, k, target_layers, 0, false);
  RunTranslate(state, *f, state.range(3), Flops(tokens, k, target_layers), g_gemm_path);
}

// Today's path: the same translation with fp32 copies of the weights and sgemm.
void BM_TranslateSgemmPath(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int k = static_cast<int>(state.range(1));
  const int target_layers = static_cast<int>(state.range(2));
  std::unique_ptr<Fixture> f = MakeFixture(tokens, k, target_layers, 0, false);
  RunTranslate(state, *f, state.range(3), Flops(tokens, k, target_layers), CpuGemmPath::kSgemm);
}

// Args: tokens, k, target layers, hidden H, per_head (0 / 1); the backend's default chunk.
void BM_TranslateMlp(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int k = static_cast<int>(state.range(1));
  const int target_layers = static_cast<int>(state.range(2));
  const int64_t hidden = state.range(3);
  const bool per_head = state.range(4) != 0;
  std::unique_ptr<Fixture> f = MakeFixture(tokens, k, target_layers, hidden, per_head);
  RunTranslate(state, *f, 0, MlpFlops(tokens, k, target_layers, hidden, per_head), g_gemm_path);
}

// The same MLP on today's sgemm path.
void BM_TranslateMlpSgemmPath(benchmark::State& state) {
  std::unique_ptr<Fixture> f = MakeFixture(state.range(0), static_cast<int>(state.range(1)),
                                           static_cast<int>(state.range(2)), state.range(3),
                                           state.range(4) != 0);
  RunTranslate(state, *f, 0,
               MlpFlops(state.range(0), state.range(1), state.range(2), state.range(3),
                        state.range(4) != 0),
               CpuGemmPath::kSgemm);
}

// Args: tokens, k, target layers, window w; the backend's default chunk. A ridge window mapper:
// the GEMM FLOPs of BM_Translate with w k layers in sigma, the gather of w tokens per row.
void BM_TranslateWindow(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int k = static_cast<int>(state.range(1));
  const int target_layers = static_cast<int>(state.range(2));
  const int window = static_cast<int>(state.range(3));
  std::unique_ptr<Fixture> f = MakeFixture(tokens, k, target_layers, 0, false, window);
  RunTranslate(state, *f, 0, Flops(tokens, int64_t{window} * k, target_layers), g_gemm_path);
}

void BM_SgemmSameFlops(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int k = static_cast<int>(state.range(1));
  const int target_layers = static_cast<int>(state.range(2));
  const int64_t inputs = k * kWidth;
  // One weight matrix per GEMM, as a mapper has (2 per target layer): reusing one B would let
  // it sit in L3 and measure a cheaper problem than the translation's.
  std::vector<float> a(tokens * inputs), c(tokens * kWidth);
  std::vector<std::vector<float>> b(2 * target_layers, std::vector<float>(inputs * kWidth));
  Fill(DType::kFP32, a.data(), a.size(), 1);
  for (size_t g = 0; g < b.size(); ++g) Fill(DType::kFP32, b[g].data(), b[g].size(), 2 + g);
  // The CPU backend sets OpenBLAS to one thread (it parallelises over tokens itself).
  openblas_set_num_threads(static_cast<int>(std::thread::hardware_concurrency()));
  for (auto _ : state) {
    for (const std::vector<float>& weights : b) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(tokens),
                  static_cast<int>(kWidth), static_cast<int>(inputs), 1.0f, a.data(),
                  static_cast<int>(inputs), weights.data(), static_cast<int>(kWidth), 0.0f,
                  c.data(), static_cast<int>(kWidth));
    }
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["FLOP/s"] = benchmark::Counter(Flops(tokens, k, target_layers),
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.SetItemsProcessed(state.iterations() * tokens);
}

// The bf16 ceiling: 2 L oneDNN matmuls of T x (k n d) bf16 times (k n d) x (n d) bf16, fp32
// out, weights prepacked in oneDNN's blocked layout (one distinct matrix per GEMM, outside the
// timing), one primitive over all T rows on every core (OpenMP), no gather and no epilogue.
void BM_Bf16MatmulSameFlops(benchmark::State& state) {
  using dnnl::memory;
  const int64_t tokens = state.range(0);
  const int k = static_cast<int>(state.range(1));
  const int target_layers = static_cast<int>(state.range(2));
  const int64_t inputs = k * kWidth;
  try {
    dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    const memory::desc a_desc({tokens, inputs}, memory::data_type::bf16, memory::format_tag::ab);
    const memory::desc b_any({inputs, kWidth}, memory::data_type::bf16, memory::format_tag::any);
    const memory::desc b_plain({inputs, kWidth}, memory::data_type::bf16,
                               memory::format_tag::ab);
    const memory::desc c_desc({tokens, kWidth}, memory::data_type::f32, memory::format_tag::ab);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_desc, b_any, c_desc), engine);
    const dnnl::matmul matmul(pd);
    memory a(a_desc, engine), c(c_desc, engine);
    Fill(DType::kBF16, a.get_data_handle(), tokens * inputs, 1);
    std::vector<memory> b;
    std::vector<uint16_t> plain(inputs * kWidth);
    for (int g = 0; g < 2 * target_layers; ++g) {
      Fill(DType::kBF16, plain.data(), plain.size(), 2 + g);
      memory from(b_plain, engine, plain.data());
      b.emplace_back(pd.weights_desc(), engine);
      dnnl::reorder(from, b.back()).execute(stream, from, b.back());
    }
    stream.wait();
    for (auto _ : state) {
      for (const memory& weights : b) {
        matmul.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, c}});
      }
      stream.wait();
      benchmark::DoNotOptimize(c.get_data_handle());
    }
    state.SetLabel(pd.impl_info_str());
  } catch (const dnnl::error& e) {
    state.SkipWithError(e.what());
    return;
  }
  state.counters["FLOP/s"] = benchmark::Counter(Flops(tokens, k, target_layers),
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.SetItemsProcessed(state.iterations() * tokens);
}

// The same bf16 matmuls split as the backend splits them: every core runs single-threaded
// oneDNN matmuls (kvt's Bf16Matmul, packed weights) on its own T / cores rows, in pieces of at
// most 512 rows; the GEMM-only floor of the token-parallel design, without gather or epilogue.
void BM_Bf16MatmulPerCore(benchmark::State& state) {
  const int64_t tokens = state.range(0);
  const int k = static_cast<int>(state.range(1));
  const int target_layers = static_cast<int>(state.range(2));
  const int64_t inputs = k * kWidth;
  ThreadPool pool(0);
  std::vector<uint16_t> a(tokens * inputs);
  Fill(DType::kBF16, a.data(), a.size(), 1);
  std::vector<std::unique_ptr<PackedBf16Weights>> b;
  std::vector<uint16_t> plain(inputs * kWidth);
  for (int g = 0; g < 2 * target_layers; ++g) {
    Fill(DType::kBF16, plain.data(), plain.size(), 2 + g);
    absl::StatusOr<std::unique_ptr<PackedBf16Weights>> packed =
        PackBf16Weights(DType::kBF16, plain.data(), inputs, kWidth);
    if (!packed.ok()) {
      state.SkipWithError(std::string(packed.status().message()).c_str());
      return;
    }
    b.push_back(*std::move(packed));
  }
  const int64_t threads = pool.num_threads();
  const int64_t rows = std::min<int64_t>(512, (tokens + threads - 1) / threads);
  const int64_t pieces = (tokens + rows - 1) / rows;
  std::vector<std::vector<float>> c(threads, std::vector<float>(rows * kWidth));
  for (auto _ : state) {
    pool.ParallelFor(pieces, 1, [&](int64_t begin, int64_t end) {
      ScopedOmpThreads one(1);
      std::vector<float>& out = c[begin * threads / pieces];
      for (int64_t piece = begin; piece < end; ++piece) {
        const int64_t t0 = piece * rows, m = std::min(rows, tokens - t0);
        for (const auto& weights : b) {
          (void)Bf16Matmul(m, a.data() + t0 * inputs, inputs, *weights, nullptr, false, false,
                           out.data(), kWidth);
        }
      }
    });
    benchmark::DoNotOptimize(c[0].data());
  }
  state.counters["FLOP/s"] = benchmark::Counter(Flops(tokens, k, target_layers),
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.SetItemsProcessed(state.iterations() * tokens);
}

// Args: tokens, k, target layers, token chunk (0 = backend default). Each shape registers its
// translate and its sgemm twin back to back, so both see the same machine state.
// The model pairs of BM_TranslatePairRidge: source and target layer counts (8 x 128 KV heads).
struct ModelPair {
  const char* name;
  int source_layers, target_layers;
};
constexpr ModelPair kPairs[] = {{"Qwen3-0.6B->1.7B", 28, 28}, {"Qwen3-14B->32B", 40, 64}};

// Bytes of a mapper's weights and biases as stored (bf16 here): one direction's mapper.
uint64_t MapperBytes(const MapperView& mapper) {
  uint64_t bytes = 0;
  for (const LayerMapView& layer : mapper.layers) {
    for (const WeightView* w : {&layer.w_k, &layer.b_k, &layer.w_v, &layer.b_v}) {
      bytes += static_cast<uint64_t>(w->rows * w->cols) * DTypeSize(w->dtype);
    }
  }
  return bytes;
}

// Args: pair, tokens, k, per_head (0 / 1). Every target layer of the pair; the backend's
// default chunk. per_head does 1/n of per_layer's GEMM FLOPs.
void BM_TranslatePairRidge(benchmark::State& state) {
  const ModelPair& pair = kPairs[state.range(0)];
  const int64_t tokens = state.range(1);
  const int k = static_cast<int>(state.range(2));
  const bool per_head = state.range(3) != 0;
  std::unique_ptr<Fixture> f = MakeFixture(tokens, k, pair.target_layers, 0, false, 1,
                                           pair.source_layers, per_head);
  state.counters["mapper_bytes"] = static_cast<double>(MapperBytes(f->mapper));
  RunTranslate(state, *f, 0, Flops(tokens, k, pair.target_layers) / (per_head ? kHeads : 1),
               g_gemm_path);
}

// --kvt_per_head's set: per pair, T and k, per_layer then per_head.
void RegisterPerHeadShapes() {
  for (int64_t pair : {0, 1}) {
    const std::vector<int64_t> ks = pair == 0 ? std::vector<int64_t>{2, 3, 4}
                                              : std::vector<int64_t>{4, 8};
    for (int64_t tokens : {512, 2048, 4096}) {
      for (int64_t k : ks) {
        for (int64_t per_head : {0, 1}) {
          benchmark::RegisterBenchmark("BM_TranslatePairRidge", BM_TranslatePairRidge)
              ->Args({pair, tokens, k, per_head})
              ->Unit(benchmark::kMillisecond)
              ->MeasureProcessCPUTime()
              ->UseRealTime()
              ->ComputeStatistics("max", [](const std::vector<double>& v) {
                return *std::max_element(v.begin(), v.end());
              });
        }
      }
    }
  }
}

void RegisterShapes() {
  std::vector<std::vector<int64_t>> shapes;
  for (int k : {2, 4, 8}) shapes.push_back({512, k, 4, 0});
  for (int k : {2, 4, 8}) shapes.push_back({4096, k, 2, 0});
  // The token chunk's effect (0 is the default, 512).
  for (int64_t chunk : {128, 256, 1024, 2048}) shapes.push_back({4096, 4, 2, chunk});
  shapes.push_back({32768, 2, 1, 0});
  shapes.push_back({32768, 8, 1, 0});
  // With --benchmark_repetitions, "max" of FLOP/s is the least disturbed repetition on a
  // shared machine; the ratio tables prefer it.
  const auto setup = [](benchmark::internal::Benchmark* b, const std::vector<int64_t>& args) {
    b->Args(args)->Unit(benchmark::kMillisecond)->MeasureProcessCPUTime()->UseRealTime();
    b->ComputeStatistics("max", [](const std::vector<double>& v) {
      return *std::max_element(v.begin(), v.end());
    });
  };
  // Few tokens (a turn's increment): the oneDNN path pads rows to 16, sgemm does not.
  for (int64_t tokens : {1, 16, 100}) shapes.push_back({tokens, 2, 4, 0});
  std::set<std::vector<int64_t>> translate_shapes;  // BM_Translate args registered so far
  for (const std::vector<int64_t>& shape : shapes) {
    translate_shapes.insert(shape);
    setup(benchmark::RegisterBenchmark("BM_Translate", BM_Translate), shape);
    setup(benchmark::RegisterBenchmark("BM_Bf16MatmulSameFlops", BM_Bf16MatmulSameFlops),
          shape);
    setup(benchmark::RegisterBenchmark("BM_Bf16MatmulPerCore", BM_Bf16MatmulPerCore), shape);
    setup(benchmark::RegisterBenchmark("BM_TranslateSgemmPath", BM_TranslateSgemmPath), shape);
    setup(benchmark::RegisterBenchmark("BM_SgemmSameFlops", BM_SgemmSameFlops), shape);
  }
  // MLP vs ridge of the same pair: each ridge shape, then its MLPs (H 1024 and 256, both
  // granularities), back to back.
  for (int k : {2, 4}) {
    translate_shapes.insert({512, k, 2, 0});
    setup(benchmark::RegisterBenchmark("BM_Translate", BM_Translate), {512, k, 2, 0});
    for (int64_t hidden : {1024, 256}) {
      for (int64_t per_head : {0, 1}) {
        setup(benchmark::RegisterBenchmark("BM_TranslateMlp", BM_TranslateMlp),
              {512, k, 2, hidden, per_head});
        setup(benchmark::RegisterBenchmark("BM_TranslateMlpSgemmPath", BM_TranslateMlpSgemmPath),
              {512, k, 2, hidden, per_head});
      }
    }
  }
  // Window vs token-wise of equal input blocks (w k): each window case T/k/L/w, then its
  // token-wise twin BM_Translate/T/(w k)/L/0 unless an earlier shape registered it. 8 blocks:
  // w 4 x k 2, w 2 x k 4 and the w 1 x k 8 control; 2 blocks: the w 1 x k 2 control.
  const std::vector<std::vector<int64_t>> windows = {
      {512, 2, 2, 4}, {512, 4, 2, 2}, {512, 8, 2, 1}, {512, 2, 2, 1}};
  for (const std::vector<int64_t>& args : windows) {
    setup(benchmark::RegisterBenchmark("BM_TranslateWindow", BM_TranslateWindow), args);
    const std::vector<int64_t> twin = {args[0], args[1] * args[3], args[2], 0};
    if (translate_shapes.insert(twin).second) {
      setup(benchmark::RegisterBenchmark("BM_Translate", BM_Translate), twin);
    }
  }
}

// Console output plus, at the end, translate FLOP/s over sgemm FLOP/s for each shape.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      const bool best = run.run_type == Run::RT_Aggregate && run.aggregate_name == "max";
      if (run.run_type != Run::RT_Iteration && !best) continue;
      const auto it = run.counters.find("FLOP/s");
      if (it == run.counters.end()) continue;
      const std::string& name = run.run_name.function_name;
      if (name == "BM_TranslatePairRidge") {
        const auto bytes = run.counters.find("mapper_bytes");
        if (bytes != run.counters.end()) pair_bytes_[run.run_name.args] = bytes->second;
      }
      auto& table = name == "BM_TranslatePairRidge"    ? pair_
                    : name == "BM_Translate"           ? translate_
                    : name == "BM_TranslateMlp"        ? mlp_
                    : name == "BM_TranslateMlpSgemmPath" ? mlp_sgemm_
                    : name == "BM_TranslateWindow"     ? window_
                    : name == "BM_TranslateSgemmPath"  ? translate_sgemm_
                    : name == "BM_Bf16MatmulSameFlops" ? bf16_
                    : name == "BM_Bf16MatmulPerCore"   ? bf16_per_core_
                                                       : sgemm_;
      // Counters arrive already divided by the (real) time. The best-of-repetitions aggregate
      // replaces single repetitions; without repetitions the one run stands.
      if (best || !best_seen_.count(name + run.run_name.args)) {
        table[run.run_name.args] = it->second.value;
        const auto items = run.counters.find("items_per_second");
        if (items != run.counters.end()) tokens_per_s_[name + run.run_name.args] = items->second;
      }
      if (best) best_seen_.insert(name + run.run_name.args);
      // Least process CPU time per iteration over the repetitions (both pool threads counted).
      if (run.run_type == Run::RT_Iteration && run.iterations > 0) {
        const double cpu = run.cpu_accumulated_time / static_cast<double>(run.iterations);
        auto [it_cpu, inserted] = cpu_seconds_.emplace(name + run.run_name.args, cpu);
        if (!inserted) it_cpu->second = std::min(it_cpu->second, cpu);
      }
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    const auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    if (!translate_.empty()) PrintTranslateTables();  // none with --kvt_per_head
    PrintWindowTable(ratio);
    PrintPerHeadTable(ratio);
    if (mlp_.empty()) return;
    // MLP args "T/k/L/H/per_head" against the ridge "T/k/L/0" of the same pair.
    std::printf("\n%-24s %12s %12s %12s %10s %10s %12s %10s\n", "MLP T/k/L/H/per_head",
                "MLP tok/s", "ridge tok/s", "MLP/ridge", "MLP GF/s", "ridge GF/s",
                "sgemmP tok/s", "MLP/sgemmP");
    for (const auto& [args, mlp_flops] : mlp_) {
      const std::string ridge_args = args.substr(0, args.rfind('/', args.rfind('/') - 1)) + "/0";
      const auto ridge = translate_.find(ridge_args);
      const auto mlp_tokens = tokens_per_s_.find("BM_TranslateMlp" + args);
      const auto ridge_tokens = tokens_per_s_.find("BM_Translate" + ridge_args);
      if (ridge == translate_.end() || mlp_tokens == tokens_per_s_.end() ||
          ridge_tokens == tokens_per_s_.end()) {
        continue;
      }
      const auto today = tokens_per_s_.find("BM_TranslateMlpSgemmPath" + args);
      const double today_tokens = today == tokens_per_s_.end() ? 0.0 : double(today->second);
      std::printf("%-24s %12.0f %12.0f %12.3f %10.1f %10.1f %12.0f %10.3f\n", args.c_str(),
                  mlp_tokens->second, ridge_tokens->second,
                  mlp_tokens->second / ridge_tokens->second, mlp_flops / 1e9, ridge->second / 1e9,
                  today_tokens, today_tokens > 0 ? mlp_tokens->second / today_tokens : 0.0);
    }
  }

 private:
  // translate_'s shapes against their GEMM twins, in wall and in process CPU time.
  void PrintTranslateTables() const {
    // GF/s of: translate (the path in use), its bare bf16 matmul ceiling, translate forced
    // onto sgemm (today's path), the bare sgemm; then translate / bf16 matmul, translate /
    // today's translate and today's translate / sgemm. 0 where a twin did not run.
    std::printf("\n%-22s %10s %10s %10s %10s %10s %10s %10s %10s %10s\n",
                "tokens/k/layers/chunk", "transl GF", "bf16mm GF", "mm/core GF", "sgemmP GF",
                "sgemm GF", "tr/bf16mm", "tr/mm/core", "tr/sgemmP", "sgemmP/sg");
    const auto get = [](const std::map<std::string, double>& table, const std::string& args) {
      const auto it = table.find(args);
      return it == table.end() ? 0.0 : it->second;
    };
    const auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    for (const auto& [args, translate] : translate_) {
      const double bf16 = get(bf16_, args), per_core = get(bf16_per_core_, args),
                   today = get(translate_sgemm_, args), sgemm = get(sgemm_, args);
      std::printf("%-22s %10.1f %10.1f %10.1f %10.1f %10.1f %10.3f %10.3f %10.3f %10.3f\n",
                  args.c_str(), translate / 1e9, bf16 / 1e9, per_core / 1e9, today / 1e9,
                  sgemm / 1e9, ratio(translate, bf16), ratio(translate, per_core),
                  ratio(translate, today), ratio(today, sgemm));
    }
    // The same comparisons in process CPU time per translation (best repetition), which a
    // busy shared machine disturbs much less than wall time: twin CPU time / translate CPU
    // time, i.e. the fraction of the twin's efficiency per FLOP that translate keeps (OpenMP
    // and OpenBLAS spin-waits count as CPU time, the pool's condition-variable waits do not).
    std::printf("\n%-22s %12s %12s %12s %12s %10s %10s %10s\n", "tokens/k/layers/chunk",
                "transl cpu ms", "bf16mm cpu ms", "mm/core cpu", "sgemmP cpu ms", "bf16mm/tr",
                "mm/core/tr", "sgemmP/tr");
    const auto cpu_ms = [&](const char* name, const std::string& args) {
      const auto it = cpu_seconds_.find(name + args);
      return it == cpu_seconds_.end() ? 0.0 : it->second * 1e3;
    };
    for (const auto& [args, translate] : translate_) {
      const double tr = cpu_ms("BM_Translate", args), mm = cpu_ms("BM_Bf16MatmulSameFlops", args),
                   per_core = cpu_ms("BM_Bf16MatmulPerCore", args),
                   today = cpu_ms("BM_TranslateSgemmPath", args);
      std::printf("%-22s %12.1f %12.1f %12.1f %12.1f %10.3f %10.3f %10.3f\n", args.c_str(), tr,
                  mm, per_core, today, ratio(mm, tr), ratio(per_core, tr), ratio(today, tr));
    }
  }

  // Window args "T/k/L/w" against the token-wise ridge "T/(w k)/L/0" of the same input blocks
  // (GEMM FLOPs): tokens/s of both and window time / token-wise time, in wall time (best
  // repetition) and in process CPU time (least over the repetitions). 0 where the twin did not
  // run.
  template <typename Ratio>
  void PrintWindowTable(const Ratio& ratio) const {
    if (window_.empty()) return;
    std::printf("\n%-18s %-16s %12s %10s %12s %10s %10s %10s\n", "window T/k/L/w",
                "vs token-wise", "window tok/s", "window GF", "twin tok/s", "twin GF",
                "time ratio", "cpu ratio");
    const auto find = [](const std::map<std::string, double>& table, const std::string& key) {
      const auto it = table.find(key);
      return it == table.end() ? 0.0 : it->second;
    };
    for (const auto& [args, window_flops] : window_) {
      int64_t tokens = 0, k = 0, layers = 0, w = 0;
      if (std::sscanf(args.c_str(), "%ld/%ld/%ld/%ld", &tokens, &k, &layers, &w) != 4) continue;
      const std::string twin = std::to_string(tokens) + "/" + std::to_string(w * k) + "/" +
                               std::to_string(layers) + "/0";
      const std::string label = "w " + std::to_string(w) + " x k " + std::to_string(k) +
                                " vs k " + std::to_string(w * k);
      const double window_tokens = find(tokens_per_s_, "BM_TranslateWindow" + args),
                   twin_tokens = find(tokens_per_s_, "BM_Translate" + twin),
                   window_cpu = find(cpu_seconds_, "BM_TranslateWindow" + args),
                   twin_cpu = find(cpu_seconds_, "BM_Translate" + twin);
      // Time per translation is 1 / tokens/s (both translate T tokens).
      std::printf("%-18s %-16s %12.0f %10.1f %12.0f %10.1f %10.3f %10.3f\n", args.c_str(),
                  label.c_str(), window_tokens, window_flops / 1e9, twin_tokens,
                  find(translate_, twin) / 1e9, ratio(twin_tokens, window_tokens),
                  ratio(window_cpu, twin_cpu));
    }
  }

  // Per pair/T/k ("p/T/k/0" and ".../1"): per_layer and per_head translate ms (T / tokens/s,
  // best repetition) and process CPU ms, their ratios per_head / per_layer, and both mappers'
  // bytes and their ratio.
  template <typename Ratio>
  void PrintPerHeadTable(const Ratio& ratio) const {
    if (pair_.empty()) return;
    std::printf("\n%-18s %-17s %10s %10s %8s %8s %11s %11s %8s\n", "pair/T/k", "pair",
                "layer ms", "head ms", "time", "cpu", "layer MB", "head MB", "bytes");
    const auto find = [](const std::map<std::string, double>& table, const std::string& key) {
      const auto it = table.find(key);
      return it == table.end() ? 0.0 : it->second;
    };
    for (const auto& [args, flops] : pair_) {
      if (args.size() < 2 || args.substr(args.size() - 2) != "/0") continue;
      const std::string stem = args.substr(0, args.size() - 2), head = stem + "/1";
      int64_t pair = 0, tokens = 0, k = 0;
      if (std::sscanf(stem.c_str(), "%ld/%ld/%ld", &pair, &tokens, &k) != 3) continue;
      const std::string name = "BM_TranslatePairRidge";
      const double layer_tps = find(tokens_per_s_, name + args),
                   head_tps = find(tokens_per_s_, name + head);
      const double layer_ms = layer_tps > 0 ? 1e3 * tokens / layer_tps : 0.0;
      const double head_ms = head_tps > 0 ? 1e3 * tokens / head_tps : 0.0;
      const double layer_mb = find(pair_bytes_, args) / 1e6, head_mb = find(pair_bytes_, head) / 1e6;
      std::printf("%-18s %-17s %10.1f %10.1f %8.3f %8.3f %11.1f %11.1f %8.3f\n", stem.c_str(),
                  kPairs[pair].name, layer_ms, head_ms, ratio(head_ms, layer_ms),
                  ratio(find(cpu_seconds_, name + head), find(cpu_seconds_, name + args)),
                  layer_mb, head_mb, ratio(head_mb, layer_mb));
    }
  }

  std::map<std::string, double> translate_, sgemm_, mlp_, tokens_per_s_, translate_sgemm_, bf16_,
      bf16_per_core_, mlp_sgemm_, window_, pair_, pair_bytes_;
  std::map<std::string, double> cpu_seconds_;
  std::set<std::string> best_seen_;
};

}  // namespace
}  // namespace kvt

int main(int argc, char** argv) {
  // --kvt_gemm_path=auto|bf16|fp32, --kvt_target_layout=HND|NHD and --kvt_per_head (ours;
  // taken out before the benchmark library's flags).
  int kept = 1;
  bool per_head = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--kvt_per_head") {
      per_head = true;
      continue;
    }
    const std::string path_flag = "--kvt_gemm_path=";
    const std::string layout_flag = "--kvt_target_layout=";
    if (arg.rfind(path_flag, 0) == 0) {
      absl::StatusOr<kvt::CpuGemmPath> path =
          kvt::ParseCpuGemmPath(arg.substr(path_flag.size()));
      if (!path.ok()) {
        std::fprintf(stderr, "%s\n", std::string(path.status().message()).c_str());
        return 1;
      }
      kvt::g_gemm_path = *path;
    } else if (arg.rfind(layout_flag, 0) == 0) {
      absl::StatusOr<kvt::Layout> layout = kvt::ParseLayout(arg.substr(layout_flag.size()));
      if (!layout.ok()) {
        std::fprintf(stderr, "--kvt_target_layout: %s\n",
                     std::string(layout.status().message()).c_str());
        return 1;
      }
      kvt::g_target_layout = *layout;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  {
    kvt::CpuBackendOptions options;
    options.gemm_path = kvt::g_gemm_path;
    kvt::CpuBackend backend(options);
    std::printf("oneDNN %s dispatches ISA %s (bf16 hardware: %s)\nBM_Translate backend: %s, "
                "target layout %s\n",
                kvt::OnednnVersion().c_str(), kvt::OnednnIsaName().c_str(),
                kvt::OnednnHasBf16Hardware() ? "yes" : "no", backend.description().c_str(),
                kvt::LayoutName(kvt::g_target_layout));
    std::fflush(stdout);
  }
  if (per_head) {
    kvt::RegisterPerHeadShapes();
  } else {
    kvt::RegisterShapes();
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvt::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  std::printf("\noneDNN implementations the backend's matmuls used:");
  for (const std::string& impl : kvt::OnednnImplementations()) std::printf(" %s", impl.c_str());
  std::printf("\n");
  benchmark::Shutdown();
  return 0;
}
