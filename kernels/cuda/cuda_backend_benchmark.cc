// Speed of the CUDA backend on the paper's model pairs (synthetic weights from the
// mapper_store/synth presets: speed depends on shapes, not values), device-resident bf16
// caches, against a plain cuBLAS bf16 GEMM of the same FLOPs timed in the same run.
//
//   bazel run //kernels/cuda:cuda_backend_benchmark -- --tokens=64,1024,8192,32768
//
// Per (preset, T): median and min over --repeats timed runs after --warmup untimed ones.
// "translate" is one whole Backend::Translate (RoPE tables on the host, gather, batched GEMMs,
// epilogue; synchronous), timed with CUDA events on the legacy stream around the call, which
// equals the call's wall time. "gemm" is cublasGemmStridedBatchedEx, bf16 x bf16 -> bf16 with
// fp32 accumulation, one batch entry per (target layer, K|V) of m = n_t d_t, n = T,
// k = |sigma| n_s d_s (X shared across the batch so its memory stays small), timed with events
// on its stream. ratio = gemm ms / translate ms (1.0: translation as fast as its GEMMs alone).
//
// MLP mappers: each preset in --mlp_presets is also timed as an MLP mapper of the
// same pair (kind: mlp, --mlp_hidden, --mlp_granularity; synthetic He-scaled weights) in the same
// run, right after its ridge rows. Its "gemm" is the chain's three strided-batched bf16 GEMMs
// alone (x A1, h A2, h A3: the same FLOPs, no bias / ReLU / gather / epilogue). The last block
// printed compares the two: mlp ms / ridge ms per T (also --mlp_out as TSV).
//
// Head-local ridge: each preset in --per_head_presets is also timed as a head-local mapper
// (ridge granularity per_head, [n_t, k d, d] per target layer and K|V: n_kv times fewer bytes
// and FLOPs); its "gemm" is one strided-batched GEMM per (layer, kind) over the heads, and it
// joins the same comparison (variant ms / ridge ms).
//
// Values: after its timed runs at each T the output of the last run is checked against the
// float64 reference on the last --check_tokens tokens of the first and last target layer (K and
// V, bf16's 1e-2), so the 32K figures are of a translation that is right; a failed check exits
// 3 after every row is printed. Rows "<kind>+host-layers" (--host_presets) time what kvtd
// serves: host-memory caches, one TranslateLayer per target layer (pinned staging over PCIe).
#include "kernels/cuda/cuda_backend.h"

#if KVT_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "kernels/cuda/device.h"
#include "kernels/dtype.h"
#include "kernels/reference.h"
#include "mapper_store/format/manifest.h"
#include "mapper_store/mapper.h"
#include "mapper_store/synth.h"

ABSL_FLAG(std::string, presets, "qwen3-14b-to-32b,qwen3-8b-to-32b,qwen3-32b-to-14b,llama3.1-8b-to-70b",
          "mapper_store/synth presets to time");
ABSL_FLAG(std::string, tokens, "64,1024,8192,32768", "token counts T");
ABSL_FLAG(int, warmup, 3, "untimed runs first");
ABSL_FLAG(int, repeats, 10, "timed runs (the median is reported)");
ABSL_FLAG(int64_t, workspace_mib, 2048, "CUDA backend workspace, MiB");
ABSL_FLAG(std::string, out, "", "also write the rows as TSV to this file");
ABSL_FLAG(std::string, mlp_presets, "qwen3-14b-to-32b",
          "presets also timed as an MLP mapper of the same pair (empty: none)");
ABSL_FLAG(int64_t, mlp_hidden, 1024, "MLP hidden width H");
ABSL_FLAG(std::string, mlp_granularity, "per_layer", "MLP granularity: per_layer or per_head");
ABSL_FLAG(std::string, mlp_out, "",
          "also write the MLP (and head-local ridge) vs ridge comparison as TSV to this file");
ABSL_FLAG(std::string, per_head_presets, "qwen3-14b-to-32b",
          "presets also timed as head-local ridge mappers (ridge granularity per_head: "
          "n_t [k d, d] GEMMs per layer and K|V), compared with their per_layer ridge");
ABSL_FLAG(int64_t, check_tokens, 32,
          "tokens at the end of each T checked against the float64 reference (0: none)");
ABSL_FLAG(std::string, host_presets, "qwen3-14b-to-32b",
          "presets also timed on host-memory caches, layer by layer (kvtd's path; empty: none)");
ABSL_FLAG(int, host_repeats, 3, "timed runs of the host path (one untimed first)");
ABSL_FLAG(int64_t, host_max_tokens, 8192,
          "largest T of the host path (its pinned caches: 7 GB at 8K for Qwen3 14B -> 32B)");

namespace kvt {
namespace {

#define CHECK_CUDA(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t e_ = (expr);                                                        \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "FATAL %s: %s (%s)\n", #expr, cudaGetErrorName(e_),            \
                   cudaGetErrorString(e_));                                               \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)
#define CHECK_CUBLAS(expr)                                                                \
  do {                                                                                    \
    const cublasStatus_t s_ = (expr);                                                     \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                    \
      std::fprintf(stderr, "FATAL %s: %s\n", #expr, cublasGetStatusName(s_));             \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)
#define CHECK_OK(expr)                                                                    \
  do {                                                                                    \
    const absl::Status s_ = (expr);                                                       \
    if (!s_.ok()) {                                                                       \
      std::fprintf(stderr, "FATAL %s: %s\n", #expr, s_.ToString().c_str());              \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Device memory filled from a random bf16 block (never zeros: they run faster than data).
class DeviceArray {
 public:
  DeviceArray(size_t bytes, const std::vector<uint16_t>& pattern) : bytes_(bytes) {
    CHECK_CUDA(cudaMalloc(&data_, std::max<size_t>(bytes, 1)));
    const size_t block = pattern.size() * sizeof(uint16_t);
    for (size_t at = 0; at < bytes; at += block) {
      CHECK_CUDA(cudaMemcpy(static_cast<char*>(data_) + at, pattern.data(),
                            std::min(block, bytes - at), cudaMemcpyHostToDevice));
    }
    // Pageable copies may return before the DMA lands; the backend's streams do not wait.
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data_); }
  char* data() const { return static_cast<char*>(data_); }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

struct Row {
  std::string preset;
  std::string kind;  // "ridge", "mlp-per_layer-1024", ...
  int64_t tokens;
  double translate_ms, translate_min_ms, gemm_ms, tflop;
};

// One strided-batched GEMM of the baseline: m x k weights per batch entry, X (k x T) shared.
struct BaselineGemm {
  int64_t m, k, batch;
};

// Set by a failed value check; main exits 3 once every row is printed.
bool g_value_check_failed = false;

// Tokens [begin, end) of layer `l` (K or V) of a device or host cache of `tokens` tokens in HND,
// as a host buffer of end - begin tokens in HND.
std::vector<uint8_t> SliceLayer(const void* layer, int heads, int head_dim, int64_t tokens,
                                int64_t begin, int64_t end) {
  const size_t row = static_cast<size_t>(head_dim) * 2;
  const size_t count = static_cast<size_t>(end - begin);
  std::vector<uint8_t> out(heads * count * row);
  for (int h = 0; h < heads; ++h) {
    CHECK_CUDA(cudaMemcpy(out.data() + h * count * row,
                          static_cast<const char*>(layer) + (h * tokens + begin) * row,
                          count * row, cudaMemcpyDefault));
  }
  return out;
}

// A host copy of tokens [begin, end) of every layer of `cache`.
struct HostSlice {
  std::vector<std::vector<uint8_t>> k, v;
  CacheView view;
};

template <typename View>
HostSlice Slice(const View& cache, int64_t begin, int64_t end) {
  HostSlice slice;
  slice.view.dtype = cache.dtype;
  slice.view.layout = Layout::kHND;
  slice.view.num_kv_heads = cache.num_kv_heads;
  slice.view.head_dim = cache.head_dim;
  slice.view.num_tokens = end - begin;
  for (size_t l = 0; l < cache.k.size(); ++l) {
    slice.k.push_back(SliceLayer(cache.k[l], cache.num_kv_heads, cache.head_dim,
                                 cache.num_tokens, begin, end));
    slice.v.push_back(SliceLayer(cache.v[l], cache.num_kv_heads, cache.head_dim,
                                 cache.num_tokens, begin, end));
    slice.view.k.push_back(slice.k.back().data());
    slice.view.v.push_back(slice.v.back().data());
  }
  return slice;
}

// The last --check_tokens tokens of the first and last target layer of a translation at
// positions 0.. against the float64 reference. Window mappers would need the tokens before the
// slice too: not checked (no preset has a window).
void CheckValues(const std::string& label, const MapperView& view, const CacheView& source,
                 const MutableCacheView& target) {
  const int64_t tokens = source.num_tokens;
  const int64_t n = std::min(absl::GetFlag(FLAGS_check_tokens), tokens);
  if (n <= 0 || view.window > 1) return;
  const HostSlice in = Slice(source, tokens - n, tokens);
  const HostSlice out = Slice(target, tokens - n, tokens);
  Positions positions;
  positions.offset = static_cast<uint64_t>(tokens - n);
  double worst = 0;
  for (int l : {0, view.target.num_layers - 1}) {
    for (reference::Kind kind : {reference::Kind::kK, reference::Kind::kV}) {
      worst = std::max(worst, reference::MaxRelError(
                                  reference::ReadLayer(out.view, l, kind),
                                  reference::ReferenceTranslate(view, l, kind, in.view, positions)));
    }
  }
  const double tolerance = reference::TranslationTolerance(DType::kBF16);
  const bool ok = worst <= tolerance;
  std::printf("value check %s T=%lld, last %lld tokens, layers 0 and %d: max rel err %.3g "
              "(tolerance %.0e) %s\n",
              label.c_str(), static_cast<long long>(tokens), static_cast<long long>(n),
              view.target.num_layers - 1, worst, tolerance, ok ? "ok" : "VALUE CHECK FAILED");
  std::fflush(stdout);
  if (!ok) g_value_check_failed = true;
}

// Page-locked host memory (kvtd's request buffers are in host memory; pinned is its best case).
class HostArray {
 public:
  explicit HostArray(size_t bytes) {
    CHECK_CUDA(cudaHostAlloc(&data_, std::max<size_t>(bytes, 1), cudaHostAllocDefault));
  }
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  ~HostArray() { cudaFreeHost(data_); }
  char* data() const { return static_cast<char*>(data_); }

 private:
  void* data_ = nullptr;
};

// kvtd's path: the request's caches in host memory, one TranslateLayer per target layer. Median
// ms of a whole request (every layer), over --host_repeats runs after one untimed run.
double TimeHostLayers(Backend* backend, const PreparedMapper& prepared, const MapperView& view,
                      const CacheView& device_source, const std::string& label) {
  const int64_t tokens = device_source.num_tokens;
  const ModelSpec& s = view.source;
  const ModelSpec& t = view.target;
  const size_t in_layer = static_cast<size_t>(tokens) * s.num_kv_heads * s.head_dim * 2;
  const size_t out_layer = static_cast<size_t>(tokens) * t.num_kv_heads * t.head_dim * 2;
  HostArray in(2 * s.num_layers * in_layer), out(2 * t.num_layers * out_layer);
  CacheView source = device_source;
  for (int l = 0; l < s.num_layers; ++l) {
    source.k[l] = in.data() + 2 * l * in_layer;
    source.v[l] = in.data() + (2 * l + 1) * in_layer;
    CHECK_CUDA(cudaMemcpy(in.data() + 2 * l * in_layer, device_source.k[l], in_layer,
                          cudaMemcpyDefault));
    CHECK_CUDA(cudaMemcpy(in.data() + (2 * l + 1) * in_layer, device_source.v[l], in_layer,
                          cudaMemcpyDefault));
  }
  MutableCacheView target;
  target.dtype = DType::kBF16;
  target.layout = Layout::kHND;
  target.num_kv_heads = t.num_kv_heads;
  target.head_dim = t.head_dim;
  target.num_tokens = tokens;
  for (int l = 0; l < t.num_layers; ++l) {
    target.k.push_back(out.data() + 2 * l * out_layer);
    target.v.push_back(out.data() + (2 * l + 1) * out_layer);
  }
  std::vector<double> ms;
  for (int r = 0; r < 1 + absl::GetFlag(FLAGS_host_repeats); ++r) {
    const auto begin = std::chrono::steady_clock::now();
    for (int l = 0; l < t.num_layers; ++l) {
      CHECK_OK(backend->TranslateLayer(prepared, l, source, Positions(), TranslateOptions(),
                                       &target));
    }
    const double elapsed =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin)
            .count();
    if (r > 0) ms.push_back(elapsed);
  }
  CheckValues(label, view, source, target);
  return Median(ms);
}

void RunPreset(const std::string& preset, const std::optional<MlpConfig>& mlp, bool head_local,
               const std::vector<int64_t>& token_counts, const std::vector<uint16_t>& pattern,
               bool host_layers, std::vector<Row>* rows) {
  absl::StatusOr<SynthOptions> options = SynthPreset(preset);
  CHECK_OK(options.status());
  options->mlp = mlp;
  if (head_local) options->ridge_granularity = RidgeGranularity::kPerHead;
  absl::StatusOr<Manifest> manifest = SynthManifest(*options);
  CHECK_OK(manifest.status());
  const std::string kind =
      mlp ? absl::StrCat("mlp-", MlpGranularityName(mlp->granularity), "-", mlp->hidden)
          : head_local ? "ridge-per_head" : "ridge";
  // One target layer's tensors, generated once; every layer's view points at them (each
  // layer still gets its own device copy and its own sigma lists; every preset has |sigma| = k
  // for all layers, so the shapes agree). Ridge: k.weight, k.bias, v.weight, v.bias; MLP: for
  // k then v, fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc3.weight, fc3.bias.
  const std::vector<TensorSpec> specs = MapperTensorSpecs(*manifest);
  const size_t per_layer = mlp ? 12 : 4;
  std::vector<std::vector<uint8_t>> layer0(per_layer);
  std::vector<WeightView> tensors(per_layer);
  for (size_t i = 0; i < per_layer; ++i) {
    layer0[i].resize(specs[i].num_bytes());
    CHECK_OK(FillSynthTensor(*options, *manifest, i, absl::MakeSpan(layer0[i])));
    // Every dimension but the last folds into rows (per_head [n_t, a, b] is (n_t a) x b).
    tensors[i].data = layer0[i].data();
    tensors[i].dtype = specs[i].dtype;
    tensors[i].cols = specs[i].shape.back();
    tensors[i].rows = 1;
    for (size_t d = 0; d + 1 < specs[i].shape.size(); ++d) tensors[i].rows *= specs[i].shape[d];
  }
  MapperView view;
  view.kind = mlp ? MapKind::kMlp : MapKind::kRidge;
  view.head_local = head_local;
  view.source = manifest->source;
  view.target = manifest->target;
  const int heads =
      mlp && mlp->granularity == MlpGranularity::kPerHead ? view.target.num_kv_heads : 1;
  for (const LayerEntry& entry : manifest->layers) {
    LayerMapView layer;
    layer.sigma_k = entry.sigma_k;
    layer.sigma_v = entry.sigma_v;
    if (mlp) {
      MlpView* chains[2] = {&layer.mlp_k, &layer.mlp_v};
      for (int c = 0; c < 2; ++c) {
        MlpView& chain = *chains[c];
        chain.heads = heads;
        chain.hidden = mlp->hidden;
        WeightView* parts[6] = {&chain.a1, &chain.c1, &chain.a2, &chain.c2, &chain.a3, &chain.c3};
        for (int i = 0; i < 6; ++i) *parts[i] = tensors[6 * c + i];
      }
    } else {
      layer.w_k = tensors[0];
      layer.b_k = tensors[1];
      layer.w_v = tensors[2];
      layer.b_v = tensors[3];
    }
    view.layers.push_back(std::move(layer));
  }

  CudaBackendOptions backend_options;
  backend_options.workspace_bytes = absl::GetFlag(FLAGS_workspace_mib) << 20;
  absl::StatusOr<std::unique_ptr<Backend>> backend = NewCudaBackend(backend_options);
  CHECK_OK(backend.status());
  const auto prepare_begin = std::chrono::steady_clock::now();
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = (*backend)->Prepare(view);
  CHECK_OK(prepared.status());
  const double prepare_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - prepare_begin).count();

  const ModelSpec& s = view.source;
  const ModelSpec& t = view.target;
  const int64_t source_width = static_cast<int64_t>(s.num_kv_heads) * s.head_dim;
  const int64_t target_width = static_cast<int64_t>(t.num_kv_heads) * t.head_dim;
  const int64_t k_width = static_cast<int64_t>(manifest->k) * source_width;
  const int64_t max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
  std::printf("# %s %s: %s (%d layers) -> %s (%d layers), k=%d, K=%lld, N=%lld, weights %.2f GB "
              "bf16, device copy %.2f GB, Prepare %.2f s\n",
              preset.c_str(), kind.c_str(), s.name.c_str(), s.num_layers, t.name.c_str(),
              t.num_layers, manifest->k, static_cast<long long>(k_width),
              static_cast<long long>(target_width), MapperWeightBytes(*manifest) / 1e9,
              (*prepared)->bytes() / 1e9, prepare_s);
  std::fflush(stdout);

  // Caches sized for the longest T; a view of T tokens uses the front of each layer buffer.
  const size_t source_layer_bytes = max_tokens * source_width * 2;
  const size_t target_layer_bytes = max_tokens * target_width * 2;
  DeviceArray source(2 * s.num_layers * source_layer_bytes, pattern);
  DeviceArray target(2 * t.num_layers * target_layer_bytes, pattern);
  // Baseline GEMMs of the same shapes: ridge one per (layer, kind) of N x K; MLP x A1 per
  // (layer, kind), then h A2 and h A3 per (layer, kind, head). Operands: per entry weights, one
  // shared X (its memory stays small), per entry outputs.
  const int64_t pairs = 2 * t.num_layers;
  std::vector<BaselineGemm> baseline;
  if (mlp) {
    const int64_t h = mlp->hidden;
    baseline.push_back({heads * h, k_width, pairs});
    baseline.push_back({h, h, pairs * heads});
    baseline.push_back({target_width / heads, h, pairs * heads});
  } else if (head_local) {
    // One [T, in_h] x [in_h, d_t] GEMM per (layer, kind, head): specs[0] is [n_t, in_h, d_t].
    baseline.push_back({specs[0].shape[2], specs[0].shape[1], pairs * t.num_kv_heads});
  } else {
    baseline.push_back({target_width, k_width, pairs});
  }
  int64_t a_elements = 0, b_elements = 0, c_elements = 0;
  double flop_per_token = 0;
  for (const BaselineGemm& g : baseline) {
    a_elements = std::max(a_elements, g.batch * g.m * g.k);
    b_elements = std::max(b_elements, max_tokens * g.k);
    c_elements = std::max(c_elements, g.batch * max_tokens * g.m);
    flop_per_token += 2.0 * g.batch * static_cast<double>(g.m) * g.k;
  }
  // Outputs past 16 GiB (per_head MLPs at 32K tokens) share one entry's space: the timing is
  // the same, the values are not needed.
  const bool shared_c = c_elements * 2 > (int64_t{16} << 30);
  if (shared_c) {
    c_elements = 0;
    for (const BaselineGemm& g : baseline) c_elements = std::max(c_elements, max_tokens * g.m);
  }
  DeviceArray gemm_a(static_cast<size_t>(a_elements) * 2, pattern);
  DeviceArray gemm_b(static_cast<size_t>(b_elements) * 2, pattern);
  DeviceArray gemm_c(static_cast<size_t>(c_elements) * 2, pattern);

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas;
  CHECK_CUBLAS(cublasCreate(&cublas));
  CHECK_CUBLAS(cublasSetStream(cublas, stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));

  for (int64_t tokens : token_counts) {
    CacheView source_view;
    source_view.dtype = DType::kBF16;
    source_view.layout = Layout::kHND;
    source_view.num_kv_heads = s.num_kv_heads;
    source_view.head_dim = s.head_dim;
    source_view.num_tokens = tokens;
    for (int l = 0; l < s.num_layers; ++l) {
      source_view.k.push_back(source.data() + (2 * l) * source_layer_bytes);
      source_view.v.push_back(source.data() + (2 * l + 1) * source_layer_bytes);
    }
    MutableCacheView target_view;
    target_view.dtype = DType::kBF16;
    target_view.layout = Layout::kHND;
    target_view.num_kv_heads = t.num_kv_heads;
    target_view.head_dim = t.head_dim;
    target_view.num_tokens = tokens;
    for (int l = 0; l < t.num_layers; ++l) {
      target_view.k.push_back(target.data() + (2 * l) * target_layer_bytes);
      target_view.v.push_back(target.data() + (2 * l + 1) * target_layer_bytes);
    }
    Positions positions;
    TranslateOptions translate_options;

    const int warmup = absl::GetFlag(FLAGS_warmup);
    const int repeats = absl::GetFlag(FLAGS_repeats);
    std::vector<double> translate_ms;
    for (int r = 0; r < warmup + repeats; ++r) {
      CHECK_CUDA(cudaEventRecord(start, 0));
      CHECK_OK((*backend)->Translate(**prepared, source_view, positions, translate_options,
                                     &target_view));
      CHECK_CUDA(cudaEventRecord(stop, 0));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (r >= warmup) translate_ms.push_back(ms);
    }
    CheckValues(absl::StrCat(preset, " ", kind), view, source_view, target_view);

    const float alpha = 1.0f, beta = 0.0f;
    std::vector<double> gemm_ms;
    for (int r = 0; r < warmup + repeats; ++r) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      for (const BaselineGemm& g : baseline) {
        CHECK_CUBLAS(cublasGemmStridedBatchedEx(
            cublas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(g.m), static_cast<int>(tokens),
            static_cast<int>(g.k), &alpha, gemm_a.data(), CUDA_R_16BF, static_cast<int>(g.m),
            g.m * g.k, gemm_b.data(), CUDA_R_16BF, static_cast<int>(g.k), 0, &beta,
            gemm_c.data(), CUDA_R_16BF, static_cast<int>(g.m), shared_c ? 0 : tokens * g.m,
            static_cast<int>(g.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (r >= warmup) gemm_ms.push_back(ms);
    }
    // Every preset has |sigma| = k for K and V of every layer.
    const double flop = flop_per_token * tokens;
    Row row{preset, kind, tokens, Median(translate_ms),
            *std::min_element(translate_ms.begin(), translate_ms.end()), Median(gemm_ms),
            flop / 1e12};
    std::printf("%-20s %-18s T=%-6lld translate %9.3f ms (min %9.3f) %7.1f TFLOP/s | gemm %9.3f "
                "ms %7.1f TFLOP/s | ratio %.3f\n",
                preset.c_str(), kind.c_str(), static_cast<long long>(tokens), row.translate_ms,
                row.translate_min_ms, row.tflop / (row.translate_ms * 1e-3), row.gemm_ms,
                row.tflop / (row.gemm_ms * 1e-3), row.gemm_ms / row.translate_ms);
    std::fflush(stdout);
    rows->push_back(row);
    if (host_layers && tokens <= absl::GetFlag(FLAGS_host_max_tokens)) {
      const std::string host_kind = absl::StrCat(kind, "+host-layers");
      Row host{preset, host_kind, tokens,
               TimeHostLayers(backend->get(), **prepared, view, source_view,
                              absl::StrCat(preset, " ", host_kind)),
               0, row.gemm_ms, row.tflop};
      host.translate_min_ms = host.translate_ms;
      std::printf("%-20s %-18s T=%-6lld translate %9.3f ms (layer by layer, host caches) | "
                  "ratio %.3f\n",
                  preset.c_str(), host_kind.c_str(), static_cast<long long>(tokens),
                  host.translate_ms, host.gemm_ms / host.translate_ms);
      std::fflush(stdout);
      rows->push_back(host);
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(cublas);
  cudaStreamDestroy(stream);
}

int Main() {
  absl::StatusOr<int> devices = cuda::DeviceCount();
  if (!devices.ok()) {
    std::fprintf(stderr, "no CUDA device: %s\n", devices.status().ToString().c_str());
    return 1;
  }
  cudaDeviceProp properties;
  CHECK_CUDA(cudaGetDeviceProperties(&properties, 0));
  std::printf("# device: %s, %d SMs, %.1f GiB; CUDA runtime %d\n", properties.name,
              properties.multiProcessorCount, properties.totalGlobalMem / 1073741824.0,
              CUDART_VERSION);
  std::vector<int64_t> token_counts;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',')) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(part, &value) || value <= 0) {
      std::fprintf(stderr, "--tokens: '%s' is not a positive integer\n", std::string(part).c_str());
      return 1;
    }
    token_counts.push_back(value);
  }
  std::mt19937_64 rng(12345);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> pattern(size_t{1} << 24);  // 32 MiB of N(0, 1) bf16
  for (uint16_t& x : pattern) x = FloatToBF16(normal(rng));

  absl::StatusOr<MlpConfig> mlp_config =
      MakeMlpConfig(absl::GetFlag(FLAGS_mlp_hidden), absl::GetFlag(FLAGS_mlp_granularity));
  if (!mlp_config.ok()) {
    std::fprintf(stderr, "%s\n", std::string(mlp_config.status().message()).c_str());
    return 1;
  }
  const MlpConfig mlp = *mlp_config;
  std::vector<std::string> mlp_presets;
  for (absl::string_view preset :
       absl::StrSplit(absl::GetFlag(FLAGS_mlp_presets), ',', absl::SkipEmpty())) {
    mlp_presets.emplace_back(preset);
  }

  const std::vector<std::string> per_head_presets =
      absl::StrSplit(absl::GetFlag(FLAGS_per_head_presets), ',', absl::SkipEmpty());
  const std::vector<std::string> host_presets =
      absl::StrSplit(absl::GetFlag(FLAGS_host_presets), ',', absl::SkipEmpty());
  std::vector<Row> rows;
  for (absl::string_view preset : absl::StrSplit(absl::GetFlag(FLAGS_presets), ',')) {
    const bool host = std::find(host_presets.begin(), host_presets.end(), preset) !=
                      host_presets.end();
    RunPreset(std::string(preset), std::nullopt, false, token_counts, pattern, host, &rows);
    if (std::find(mlp_presets.begin(), mlp_presets.end(), preset) != mlp_presets.end()) {
      RunPreset(std::string(preset), mlp, false, token_counts, pattern, host, &rows);
    }
    if (std::find(per_head_presets.begin(), per_head_presets.end(), preset) !=
        per_head_presets.end()) {
      RunPreset(std::string(preset), std::nullopt, true, token_counts, pattern, host, &rows);
    }
  }
  std::string tsv = "preset\tkind\ttokens\ttranslate_ms\ttranslate_min_ms\ttranslate_tflops\t"
                    "gemm_ms\tgemm_tflops\tratio\n";
  for (const Row& r : rows) {
    absl::StrAppendFormat(&tsv, "%s\t%s\t%d\t%.4f\t%.4f\t%.1f\t%.4f\t%.1f\t%.3f\n", r.preset,
                          r.kind, r.tokens, r.translate_ms, r.translate_min_ms,
                          r.tflop / (r.translate_ms * 1e-3), r.gemm_ms,
                          r.tflop / (r.gemm_ms * 1e-3), r.gemm_ms / r.translate_ms);
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) std::ofstream(out) << tsv;
  std::printf("\n%s", tsv.c_str());

  // MLP and head-local ridge vs per_layer ridge of the same pair, from the same run.
  std::string compare = "preset\tvariant\ttokens\tridge_ms\tvariant_ms\tvariant_over_ridge\n";
  for (const Row& m : rows) {
    if (m.kind == "ridge") continue;
    for (const Row& r : rows) {
      if (r.kind == "ridge" && r.preset == m.preset && r.tokens == m.tokens) {
        absl::StrAppendFormat(&compare, "%s\t%s\t%d\t%.4f\t%.4f\t%.3f\n", m.preset, m.kind,
                              m.tokens, r.translate_ms, m.translate_ms,
                              m.translate_ms / r.translate_ms);
      }
    }
  }
  if (!mlp_presets.empty() || !per_head_presets.empty()) {
    const std::string mlp_out = absl::GetFlag(FLAGS_mlp_out);
    if (!mlp_out.empty()) std::ofstream(mlp_out) << compare;
    std::printf("\n%s", compare.c_str());
  }
  if (g_value_check_failed) {
    std::fprintf(stderr, "VALUE CHECK FAILED: a timed translation is wrong (lines above)\n");
    return 3;
  }
  return 0;
}

}  // namespace
}  // namespace kvt

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvt::Main();
}

#else  // !KVT_HAVE_CUDA

#include <cstdio>

int main() {
  std::fprintf(stderr, "cuda_backend_benchmark: built without the CUDA toolkit\n");
  return 1;
}

#endif  // KVT_HAVE_CUDA
