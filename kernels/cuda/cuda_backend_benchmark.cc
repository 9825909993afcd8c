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
#include "kernels/cuda/cuda_backend.h"

#if KVT_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
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
#include "mapper_store/manifest.h"
#include "mapper_store/mapper.h"
#include "mapper_store/synth.h"

ABSL_FLAG(std::string, presets, "qwen3-14b-to-32b,qwen3-8b-to-32b,qwen3-32b-to-14b,llama3.1-8b-to-70b",
          "mapper_store/synth presets to time");
ABSL_FLAG(std::string, tokens, "64,1024,8192,32768", "token counts T");
ABSL_FLAG(int, warmup, 3, "untimed runs first");
ABSL_FLAG(int, repeats, 10, "timed runs (the median is reported)");
ABSL_FLAG(int64_t, workspace_mib, 2048, "CUDA backend workspace, MiB");
ABSL_FLAG(std::string, out, "", "also write the rows as TSV to this file");

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
  int64_t tokens;
  double translate_ms, translate_min_ms, gemm_ms, tflop;
};

void RunPreset(const std::string& preset, const std::vector<int64_t>& token_counts,
               const std::vector<uint16_t>& pattern, std::vector<Row>* rows) {
  absl::StatusOr<SynthOptions> options = SynthPreset(preset);
  CHECK_OK(options.status());
  absl::StatusOr<Manifest> manifest = SynthManifest(*options);
  CHECK_OK(manifest.status());
  // One target layer's tensors, generated once; every layer's view points at them (each
  // layer still gets its own device copy and its own sigma lists).
  const std::vector<TensorSpec> specs = MapperTensorSpecs(*manifest);
  std::vector<std::vector<uint8_t>> layer0(4);
  for (size_t i = 0; i < 4; ++i) {
    layer0[i].resize(specs[i].num_bytes());
    CHECK_OK(FillSynthTensor(*options, *manifest, i, absl::MakeSpan(layer0[i])));
  }
  MapperView view;
  view.source = manifest->source;
  view.target = manifest->target;
  for (const LayerEntry& entry : manifest->layers) {
    LayerMapView layer;
    layer.sigma_k = entry.sigma_k;
    layer.sigma_v = entry.sigma_v;
    WeightView* weights[4] = {&layer.w_k, &layer.b_k, &layer.w_v, &layer.b_v};
    for (size_t i = 0; i < 4; ++i) {
      weights[i]->data = layer0[i].data();
      weights[i]->dtype = specs[i].dtype;
      weights[i]->rows = specs[i].shape.size() == 2 ? specs[i].shape[0] : 1;
      weights[i]->cols = specs[i].shape.back();
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
  std::printf("# %s: %s (%d layers) -> %s (%d layers), k=%d, K=%lld, N=%lld, weights %.2f GB "
              "bf16, device copy %.2f GB, Prepare %.2f s\n",
              preset.c_str(), s.name.c_str(), s.num_layers, t.name.c_str(), t.num_layers,
              manifest->k, static_cast<long long>(k_width), static_cast<long long>(target_width),
              MapperWeightBytes(*manifest) / 1e9, (*prepared)->bytes() / 1e9, prepare_s);
  std::fflush(stdout);

  // Caches sized for the longest T; a view of T tokens uses the front of each layer buffer.
  const size_t source_layer_bytes = max_tokens * source_width * 2;
  const size_t target_layer_bytes = max_tokens * target_width * 2;
  DeviceArray source(2 * s.num_layers * source_layer_bytes, pattern);
  DeviceArray target(2 * t.num_layers * target_layer_bytes, pattern);
  // Baseline operands: per (layer, kind) weights, one shared X, per (layer, kind) outputs.
  const int batch = 2 * t.num_layers;
  DeviceArray gemm_a(static_cast<size_t>(batch) * k_width * target_width * 2, pattern);
  DeviceArray gemm_b(static_cast<size_t>(max_tokens) * k_width * 2, pattern);
  DeviceArray gemm_c(static_cast<size_t>(batch) * max_tokens * target_width * 2, pattern);

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

    const float alpha = 1.0f, beta = 0.0f;
    std::vector<double> gemm_ms;
    for (int r = 0; r < warmup + repeats; ++r) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      CHECK_CUBLAS(cublasGemmStridedBatchedEx(
          cublas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(target_width),
          static_cast<int>(tokens), static_cast<int>(k_width), &alpha, gemm_a.data(), CUDA_R_16BF,
          static_cast<int>(target_width), k_width * target_width, gemm_b.data(), CUDA_R_16BF,
          static_cast<int>(k_width), 0, &beta, gemm_c.data(), CUDA_R_16BF,
          static_cast<int>(target_width), tokens * target_width, batch, CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT));
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (r >= warmup) gemm_ms.push_back(ms);
    }
    // Every preset has |sigma| = k for K and V of every layer.
    const double flop = 2.0 * batch * tokens * static_cast<double>(k_width) * target_width;
    Row row{preset, tokens, Median(translate_ms),
            *std::min_element(translate_ms.begin(), translate_ms.end()), Median(gemm_ms),
            flop / 1e12};
    std::printf("%-20s T=%-6lld translate %9.3f ms (min %9.3f) %7.1f TFLOP/s | gemm %9.3f ms "
                "%7.1f TFLOP/s | ratio %.3f\n",
                preset.c_str(), static_cast<long long>(tokens), row.translate_ms,
                row.translate_min_ms, row.tflop / (row.translate_ms * 1e-3), row.gemm_ms,
                row.tflop / (row.gemm_ms * 1e-3), row.gemm_ms / row.translate_ms);
    std::fflush(stdout);
    rows->push_back(row);
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

  std::vector<Row> rows;
  for (absl::string_view preset : absl::StrSplit(absl::GetFlag(FLAGS_presets), ',')) {
    RunPreset(std::string(preset), token_counts, pattern, &rows);
  }
  std::string tsv = "preset\ttokens\ttranslate_ms\ttranslate_min_ms\ttranslate_tflops\tgemm_ms\t"
                    "gemm_tflops\tratio\n";
  for (const Row& r : rows) {
    absl::StrAppendFormat(&tsv, "%s\t%d\t%.4f\t%.4f\t%.1f\t%.4f\t%.1f\t%.3f\n", r.preset,
                          r.tokens, r.translate_ms, r.translate_min_ms,
                          r.tflop / (r.translate_ms * 1e-3), r.gemm_ms,
                          r.tflop / (r.gemm_ms * 1e-3), r.gemm_ms / r.translate_ms);
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) std::ofstream(out) << tsv;
  std::printf("\n%s", tsv.c_str());
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
