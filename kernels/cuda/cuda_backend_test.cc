// GPU parity of the CUDA backend: CUDA vs the CPU backend vs the float64 reference on fresh
// random inputs, ridge and MLP mappers (per_layer and per_head), every dtype, layout and RoPE
// type, device- and host-resident caches, outputs poisoned (NaN) before every run so an element
// the kernels do not write fails. Needs a GPU: tagged manual, run by tests/gpu/run.sh.
#include "kernels/cuda/cuda_backend.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/device.h"
#include "kernels/dtype.h"
#include "kernels/testing/backend_conformance.h"
#include "kernels/testing/reference.h"

#if KVT_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvt {
namespace {

using ::kvt::testing::BackendConformanceTest;
using ::kvt::testing::ConformanceBackend;
using ::kvt::testing::ConformanceBackendName;
using ::kvt::testing::ConformanceCase;
using ::kvt::testing::ConformanceInputs;
using ::kvt::testing::ExpectMatchesReference;
using ::kvt::testing::FreshSeed;
using ::kvt::testing::Kind;
using ::kvt::testing::MakeConformanceInputs;
using ::kvt::testing::MakeOutputCache;
using ::kvt::testing::MakeRandomCache;
using ::kvt::testing::MakeRandomMapper;
using ::kvt::testing::MakeTestRope;
using ::kvt::testing::MaxRelError;
using ::kvt::testing::MlpSpec;
using ::kvt::testing::OwnedCache;
using ::kvt::testing::RandomMapper;
using ::kvt::testing::RandomMapperSpec;
using ::kvt::testing::ReadLayer;
using ::kvt::testing::ReferenceTranslate;
using ::kvt::testing::SliceTokens;
using ::kvt::testing::TranslationTolerance;
using ::testing::HasSubstr;

#if KVT_HAVE_CUDA

#define CUDA_CHECK(expr)                                                                   \
  do {                                                                                     \
    const cudaError_t error_ = (expr);                                                     \
    if (error_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr,                    \
                   cudaGetErrorString(error_));                                            \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

// A cache in device memory: per layer K and V buffers of the same shape as a host cache.
class DeviceCache {
 public:
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;
  ~DeviceCache() {
    for (void* p : buffers_) cudaFree(p);
  }

  // A device copy of `host`.
  static std::unique_ptr<DeviceCache> Upload(const CacheView& host) {
    auto cache = Allocate(static_cast<int>(host.k.size()), host.num_kv_heads, host.head_dim,
                          host.num_tokens, host.dtype, host.layout);
    for (size_t l = 0; l < host.k.size(); ++l) {
      CUDA_CHECK(cudaMemcpy(cache->mutable_view.k[l], host.k[l], cache->layer_bytes_,
                            cudaMemcpyHostToDevice));
      CUDA_CHECK(cudaMemcpy(cache->mutable_view.v[l], host.v[l], cache->layer_bytes_,
                            cudaMemcpyHostToDevice));
    }
    // Pageable copies may return before the DMA lands; the backend's streams do not wait.
    CUDA_CHECK(cudaDeviceSynchronize());
    return cache;
  }

  // Every byte 0xFF (NaN in every dtype), written by the device poison kernel.
  static std::unique_ptr<DeviceCache> Poisoned(int layers, int heads, int head_dim,
                                               int64_t tokens, DType dtype, Layout layout) {
    auto cache = Allocate(layers, heads, head_dim, tokens, dtype, layout);
    cache->Poison();
    return cache;
  }

  void Poison() {
    for (void* p : buffers_) {
      absl::Status s = cuda::PoisonDeviceBuffer(p, layer_bytes_);
      if (!s.ok()) {
        std::fprintf(stderr, "poison: %s\n", s.ToString().c_str());
        std::abort();
      }
    }
  }

  OwnedCache Download() const {
    OwnedCache host = MakeOutputCache(static_cast<int>(view.k.size()), view.num_kv_heads,
                                      view.head_dim, view.num_tokens, view.dtype, view.layout);
    for (size_t l = 0; l < view.k.size(); ++l) {
      CUDA_CHECK(cudaMemcpy(host.mutable_view.k[l], view.k[l], layer_bytes_,
                            cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(host.mutable_view.v[l], view.v[l], layer_bytes_,
                            cudaMemcpyDeviceToHost));
    }
    return host;
  }

  CacheView view;
  MutableCacheView mutable_view;

 private:
  DeviceCache() = default;

  static std::unique_ptr<DeviceCache> Allocate(int layers, int heads, int head_dim,
                                               int64_t tokens, DType dtype, Layout layout) {
    std::unique_ptr<DeviceCache> cache(new DeviceCache());
    cache->layer_bytes_ =
        std::max<size_t>(1, static_cast<size_t>(tokens) * heads * head_dim * DTypeSize(dtype));
    for (MutableCacheView* v : {&cache->mutable_view}) {
      v->dtype = dtype;
      v->layout = layout;
      v->num_kv_heads = heads;
      v->head_dim = head_dim;
      v->num_tokens = tokens;
    }
    for (int l = 0; l < layers; ++l) {
      for (std::vector<void*>* kind : {&cache->mutable_view.k, &cache->mutable_view.v}) {
        void* p = nullptr;
        CUDA_CHECK(cudaMalloc(&p, cache->layer_bytes_));
        cache->buffers_.push_back(p);
        kind->push_back(p);
      }
    }
    CacheView& view = cache->view;
    view.dtype = dtype;
    view.layout = layout;
    view.num_kv_heads = heads;
    view.head_dim = head_dim;
    view.num_tokens = tokens;
    view.k.assign(cache->mutable_view.k.begin(), cache->mutable_view.k.end());
    view.v.assign(cache->mutable_view.v.begin(), cache->mutable_view.v.end());
    return cache;
  }

  size_t layer_bytes_ = 0;
  std::vector<void*> buffers_;
};

// The CUDA backend under every test here: refuses without a device (this test needs one).
std::unique_ptr<Backend> MakeCuda(int64_t workspace_bytes = 0) {
  CudaBackendOptions options;
  if (workspace_bytes > 0) options.workspace_bytes = workspace_bytes;
  absl::StatusOr<std::unique_ptr<Backend>> backend = NewCudaBackend(options);
  if (!backend.ok()) {
    ADD_FAILURE() << backend.status();
    return nullptr;
  }
  return *std::move(backend);
}

// Every layer and kind of `target` against the reference, and against `cpu` (the CPU
// backend's output of the same translation): two fp32-accumulating backends differ by at most
// both their distances to the reference.
void ExpectMatchesReferenceAndCpu(const char* what, const ConformanceInputs& inputs,
                                  const MutableCacheView& target, const MutableCacheView& cpu,
                                  DType out_dtype) {
  ExpectMatchesReference(what, inputs, target, TranslationTolerance(out_dtype));
  for (int l = 0; l < inputs.mapper.view.target.num_layers; ++l) {
    for (Kind kind : {Kind::kK, Kind::kV}) {
      EXPECT_LE(MaxRelError(ReadLayer(target, l, kind), ReadLayer(cpu, l, kind)),
                2 * TranslationTolerance(out_dtype))
          << what << " vs cpu, layer " << l << (kind == Kind::kK ? " K" : " V");
    }
  }
}

absl::Status HasDevice() {
  absl::StatusOr<int> devices = cuda::DeviceCount();
  if (devices.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this test needs a CUDA device: ", devices.status().ToString()));
}

// One conformance case through four paths: CUDA Translate on device caches, CUDA TranslateLayer
// per layer on host caches (pinned staging), CUDA Translate with the source on the device and
// the target in host memory, and the CPU backend; all against the reference.
void CheckOnCuda(const ConformanceCase& c, uint64_t seed) {
  const ConformanceInputs inputs = MakeConformanceInputs(c, seed);
  const RandomMapperSpec& s = c.spec;
  const CacheView& source = inputs.source.view;

  CpuBackendOptions cpu_options;
  cpu_options.num_threads = 4;
  std::unique_ptr<Backend> cpu = NewCpuBackend(cpu_options);
  absl::StatusOr<std::shared_ptr<PreparedMapper>> cpu_prepared = cpu->Prepare(inputs.mapper.view);
  ASSERT_TRUE(cpu_prepared.ok()) << cpu_prepared.status();
  OwnedCache cpu_target = inputs.NewTarget(c);
  ASSERT_TRUE(cpu->Translate(**cpu_prepared, source, inputs.positions, inputs.options,
                             &cpu_target.mutable_view)
                  .ok());

  std::unique_ptr<Backend> backend = MakeCuda(c.workspace_bytes);
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend->Prepare(inputs.mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_GT((*prepared)->bytes(), 0u);

  {  // Device-resident caches, all layers at once.
    auto device_source = DeviceCache::Upload(source);
    auto device_target = DeviceCache::Poisoned(s.target_layers, s.target_heads, s.target_head_dim,
                                               c.tokens, c.out_dtype, c.out_layout);
    absl::Status status = backend->Translate(**prepared, device_source->view, inputs.positions,
                                             inputs.options, &device_target->mutable_view);
    ASSERT_TRUE(status.ok()) << status;
    const OwnedCache result = device_target->Download();
    ExpectMatchesReferenceAndCpu("device Translate", inputs, result.mutable_view,
                                 cpu_target.mutable_view, c.out_dtype);
  }
  {  // Host-memory caches, one target layer per call (the server's path).
    OwnedCache target = inputs.NewTarget(c);
    for (int l = 0; l < s.target_layers; ++l) {
      absl::Status status = backend->TranslateLayer(**prepared, l, source, inputs.positions,
                                                    inputs.options, &target.mutable_view);
      ASSERT_TRUE(status.ok()) << status;
    }
    ExpectMatchesReferenceAndCpu("host TranslateLayer", inputs, target.mutable_view,
                                 cpu_target.mutable_view, c.out_dtype);
  }
  {  // Mixed: device source, host target.
    auto device_source = DeviceCache::Upload(source);
    OwnedCache target = inputs.NewTarget(c);
    absl::Status status = backend->Translate(**prepared, device_source->view, inputs.positions,
                                             inputs.options, &target.mutable_view);
    ASSERT_TRUE(status.ok()) << status;
    ExpectMatchesReferenceAndCpu("mixed Translate", inputs, target.mutable_view,
                                 cpu_target.mutable_view, c.out_dtype);
  }
}

ConformanceBackend Cuda() {
  ConformanceBackend backend;
  backend.name = "Cuda";
  backend.cache_dtype = DType::kBF16;
  backend.has_workspace = true;
  backend.ready = HasDevice;
  backend.check = CheckOnCuda;
  return backend;
}

// The shared case table (kernels/testing/backend_conformance.cc).
INSTANTIATE_TEST_SUITE_P(Cuda, BackendConformanceTest, ::testing::Values(Cuda()),
                         ConformanceBackendName);

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const absl::Status device = HasDevice();
    ASSERT_TRUE(device.ok()) << device.message();
  }
};

// Real head shapes (8 x 128, Qwen3 / Llama) on `spec`: 6 source layers, k = 3, bf16 weights and
// caches.
RandomMapperSpec RealHeadShapes(RandomMapperSpec spec, int target_layers) {
  spec.source_layers = 6;
  spec.source_heads = 8;
  spec.source_head_dim = 128;
  spec.target_layers = target_layers;
  spec.target_heads = 8;
  spec.target_head_dim = 128;
  spec.k = 3;
  spec.weight_dtype = DType::kBF16;
  spec.source_rope = MakeTestRope(RopeScalingType::kNone, RopeStyle::kNeox, 0, 1000000);
  spec.target_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 0, 500000);
  return spec;
}

// CUDA vs CPU on every token of a long bf16 cache on device, the float64 reference on tokens
// [begin, end) only (the whole would take minutes in double).
void CheckLongCache(const RandomMapperSpec& spec, int64_t tokens, uint64_t offset, int64_t begin,
                    int64_t end, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const RandomMapper mapper = MakeRandomMapper(spec, rng());
  const int layers = spec.target_layers;
  const OwnedCache source =
      MakeRandomCache(spec.source_layers, spec.source_heads, spec.source_head_dim, tokens,
                      DType::kBF16, Layout::kHND, rng());
  Positions positions;
  positions.offset = offset;
  TranslateOptions options;

  std::unique_ptr<Backend> cpu = NewCpuBackend();
  auto cpu_prepared = cpu->Prepare(mapper.view);
  ASSERT_TRUE(cpu_prepared.ok()) << cpu_prepared.status();
  OwnedCache cpu_target = MakeOutputCache(layers, spec.target_heads, spec.target_head_dim, tokens,
                                          DType::kBF16, Layout::kNHD);
  ASSERT_TRUE(
      cpu->Translate(**cpu_prepared, source.view, positions, options, &cpu_target.mutable_view)
          .ok());

  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);
  auto prepared = backend->Prepare(mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  auto device_source = DeviceCache::Upload(source.view);
  auto device_target = DeviceCache::Poisoned(layers, spec.target_heads, spec.target_head_dim,
                                             tokens, DType::kBF16, Layout::kNHD);
  absl::Status status = backend->Translate(**prepared, device_source->view, positions, options,
                                           &device_target->mutable_view);
  ASSERT_TRUE(status.ok()) << status;
  const OwnedCache result = device_target->Download();

  const OwnedCache slice = SliceTokens(source.view, begin, end);
  const OwnedCache result_slice = SliceTokens(
      CacheView{result.view.dtype, result.view.layout, result.view.num_kv_heads,
                result.view.head_dim, result.view.num_tokens, result.view.k, result.view.v},
      begin, end);
  Positions slice_positions;
  slice_positions.offset = positions.offset + begin;
  for (int l = 0; l < layers; ++l) {
    for (Kind kind : {Kind::kK, Kind::kV}) {
      EXPECT_LE(MaxRelError(ReadLayer(result.mutable_view, l, kind),
                            ReadLayer(cpu_target.mutable_view, l, kind)),
                2 * TranslationTolerance(DType::kBF16))
          << "vs cpu, layer " << l;
      EXPECT_LE(MaxRelError(ReadLayer(result_slice.view, l, kind),
                            ReferenceTranslate(mapper.view, l, kind, slice.view, slice_positions)),
                TranslationTolerance(DType::kBF16))
          << "vs reference, layer " << l;
    }
  }
}

TEST_F(CudaBackendTest, RealHeadShapesBf16) {
  const uint64_t seed = FreshSeed("RealHeadShapesBf16");
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  CheckLongCache(RealHeadShapes(RandomMapperSpec(), 4), /*tokens=*/1500, /*offset=*/123,
                 /*begin=*/1000, /*end=*/1048, seed);
}

// Concurrent calls on one backend each take their own stream and workspace.
TEST_F(CudaBackendTest, ConcurrentCalls) {
  const uint64_t seed = FreshSeed("ConcurrentCalls");
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937_64 rng(seed);
  RandomMapperSpec spec;
  spec.source_layers = 3;
  spec.k = 2;
  spec.source_rope = MakeTestRope(RopeScalingType::kYarn);
  spec.target_rope = MakeTestRope(RopeScalingType::kNone, RopeStyle::kGptj);
  const RandomMapper mapper = MakeRandomMapper(spec, rng());
  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);
  auto prepared = backend->Prepare(mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  constexpr int kThreads = 4;
  std::vector<OwnedCache> sources, targets;
  for (int i = 0; i < kThreads; ++i) {
    sources.push_back(MakeRandomCache(3, 2, 16, 200 + 37 * i, DType::kFP32, Layout::kHND, rng()));
    targets.push_back(MakeOutputCache(2, 2, 16, 200 + 37 * i, DType::kFP32, Layout::kNHD));
  }
  std::vector<absl::Status> statuses(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      Positions positions;
      positions.offset = 10 * i;
      for (int repeat = 0; repeat < 5 && statuses[i].ok(); ++repeat) {
        statuses[i] = backend->Translate(**prepared, sources[i].view, positions,
                                         TranslateOptions(), &targets[i].mutable_view);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i];
    Positions positions;
    positions.offset = 10 * i;
    for (int l = 0; l < 2; ++l) {
      for (Kind kind : {Kind::kK, Kind::kV}) {
        EXPECT_LE(MaxRelError(ReadLayer(targets[i].mutable_view, l, kind),
                              ReferenceTranslate(mapper.view, l, kind, sources[i].view, positions)),
                  TranslationTolerance(DType::kFP32));
      }
    }
  }
}

// Streamed page-in: layer l translates right after PrepareLayer(l), before later layers have
// their weights; the estimate the pager reserves by is exact.
TEST_F(CudaBackendTest, StreamedPrepareTranslatesLayerByLayer) {
  const uint64_t seed = FreshSeed("StreamedPrepareTranslatesLayerByLayer");
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937_64 rng(seed);
  RandomMapperSpec spec;
  spec.source_layers = 4;
  spec.target_layers = 5;
  spec.k = 2;
  spec.k_v = 3;
  spec.weight_dtype = DType::kBF16;
  spec.source_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 0, 500000);
  spec.target_rope = MakeTestRope(RopeScalingType::kYarn, RopeStyle::kGptj);
  const RandomMapper mapper = MakeRandomMapper(spec, rng());
  const OwnedCache source = MakeRandomCache(4, 2, 16, 50, DType::kBF16, Layout::kNHD, rng());
  OwnedCache target = MakeOutputCache(5, 2, 16, 50, DType::kBF16, Layout::kHND);
  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend->BeginPrepare(mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ((*prepared)->bytes(), backend->PreparedBytesEstimate(mapper.view));
  EXPECT_GT(backend->DeviceMemoryBytes(), (*prepared)->bytes());
  Positions positions;
  positions.offset = 77;
  for (int l = 0; l < 5; ++l) {
    ASSERT_TRUE(backend->PrepareLayer(**prepared, l).ok());
    ASSERT_TRUE(backend
                    ->TranslateLayer(**prepared, l, source.view, positions, TranslateOptions(),
                                     &target.mutable_view)
                    .ok());
    for (Kind kind : {Kind::kK, Kind::kV}) {
      EXPECT_LE(MaxRelError(ReadLayer(target.mutable_view, l, kind),
                            ReferenceTranslate(mapper.view, l, kind, source.view, positions)),
                TranslationTolerance(DType::kBF16))
          << "layer " << l;
    }
  }
  EXPECT_EQ(backend->PrepareLayer(**prepared, 5).code(), absl::StatusCode::kInvalidArgument);
}

// ---- MLP mappers (kind: mlp): the ridge gather / strip and epilogue (c3 as its bias) around
// three cuBLAS GEMMs with bias + ReLU kernels between them. Their case table is the shared
// suite's; here the real shapes, streaming and refusals.

// Real head shapes (8 x 128), bf16, the format's default hidden width per_layer and a smaller
// one per_head: CUDA vs CPU on every token, the float64 reference on a slice of 16 tokens.
TEST_F(CudaBackendTest, MlpRealHeadShapesBf16) {
  for (bool per_head : {false, true}) {
    const uint64_t seed = FreshSeed(per_head ? "MlpRealHeadShapesBf16 per_head"
                                             : "MlpRealHeadShapesBf16 per_layer");
    SCOPED_TRACE(absl::StrCat(per_head ? "per_head" : "per_layer", " seed=", seed));
    CheckLongCache(RealHeadShapes(MlpSpec(per_head, per_head ? 256 : 1024), 3), /*tokens=*/700,
                   /*offset=*/321, /*begin=*/500, /*end=*/516, seed);
  }
}

// Streamed page-in of an MLP mapper: the estimate the pager reserves by equals bytes() (every
// MLP weight and bias counted), and layer l translates right after PrepareLayer(l).
TEST_F(CudaBackendTest, MlpStreamedPrepareCountsEveryWeight) {
  for (bool per_head : {false, true}) {
    const uint64_t seed = FreshSeed("MlpStreamedPrepareCountsEveryWeight");
    SCOPED_TRACE(absl::StrCat(per_head ? "per_head" : "per_layer", " seed=", seed));
    std::mt19937_64 rng(seed);
    RandomMapperSpec spec = MlpSpec(per_head, 16);
    spec.source_layers = 4;
    spec.target_layers = 3;
    spec.k = 2;
    spec.k_v = 3;
    spec.weight_dtype = DType::kBF16;
    spec.source_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 0, 500000);
    spec.target_rope = MakeTestRope(RopeScalingType::kYarn, RopeStyle::kGptj);
    const RandomMapper mapper = MakeRandomMapper(spec, rng());
    const OwnedCache source = MakeRandomCache(4, 2, 16, 50, DType::kBF16, Layout::kNHD, rng());
    OwnedCache target = MakeOutputCache(3, 2, 16, 50, DType::kBF16, Layout::kHND);
    std::unique_ptr<Backend> backend = MakeCuda();
    ASSERT_NE(backend, nullptr);
    absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared =
        backend->BeginPrepare(mapper.view);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    EXPECT_EQ((*prepared)->bytes(), backend->PreparedBytesEstimate(mapper.view));
    // At least every weight in bf16 and every bias in fp32.
    uint64_t weights = 0;
    for (const LayerMapView& layer : mapper.view.layers) {
      for (const MlpView* c : {&layer.mlp_k, &layer.mlp_v}) {
        weights += 2 * (c->a1.rows * c->a1.cols + c->a2.rows * c->a2.cols +
                        c->a3.rows * c->a3.cols) +
                   4 * (c->c1.cols * c->c1.rows + c->c2.rows * c->c2.cols +
                        c->c3.rows * c->c3.cols);
      }
    }
    EXPECT_GE((*prepared)->bytes(), weights);
    Positions positions;
    positions.offset = 77;
    for (int l = 0; l < 3; ++l) {
      ASSERT_TRUE(backend->PrepareLayer(**prepared, l).ok());
      absl::Status status = backend->TranslateLayer(**prepared, l, source.view, positions,
                                                    TranslateOptions(), &target.mutable_view);
      ASSERT_TRUE(status.ok()) << status;
      for (Kind kind : {Kind::kK, Kind::kV}) {
        EXPECT_LE(MaxRelError(ReadLayer(target.mutable_view, l, kind),
                              ReferenceTranslate(mapper.view, l, kind, source.view, positions)),
                  TranslationTolerance(DType::kBF16))
            << "layer " << l;
      }
    }
  }
}

TEST_F(CudaBackendTest, MlpBadMappersNameTheField) {
  const RandomMapper mapper = MakeRandomMapper(MlpSpec(false, 8), 3);
  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);
  MapperView bad = mapper.view;
  bad.layers[1].mlp_k.a2.rows = 7;
  absl::StatusOr<std::shared_ptr<PreparedMapper>> refused = backend->Prepare(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("layers[1].mlp_k.a2"));
  // Valid chains of two hidden widths: fine for the CPU, one GEMM shape for the GPU.
  const RandomMapper narrow = MakeRandomMapper(MlpSpec(false, 4), 4);
  MapperView mixed = mapper.view;
  mixed.layers[1].mlp_v = narrow.view.layers[1].mlp_v;
  refused = backend->Prepare(mixed);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("layers[1].mlp_v has heads=1 hidden=4"));
}

TEST_F(CudaBackendTest, BadInputsNameTheField) {
  RandomMapperSpec spec;
  const RandomMapper mapper = MakeRandomMapper(spec, 1);
  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);

  // A mapper with a wrongly shaped weight is refused by Prepare.
  MapperView bad = mapper.view;
  bad.layers[1].w_v.rows += 1;
  absl::StatusOr<std::shared_ptr<PreparedMapper>> refused = backend->Prepare(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("layers[1].w_v"));

  auto prepared = backend->Prepare(mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  OwnedCache source = MakeRandomCache(2, 2, 16, 10, DType::kBF16, Layout::kHND, 2);
  OwnedCache target = MakeOutputCache(2, 2, 16, 10, DType::kBF16, Layout::kHND);
  Positions positions;

  // A mapper another backend prepared.
  std::unique_ptr<Backend> cpu = NewCpuBackend();
  auto cpu_prepared = cpu->Prepare(mapper.view);
  ASSERT_TRUE(cpu_prepared.ok());
  absl::Status status = backend->Translate(**cpu_prepared, source.view, positions,
                                           TranslateOptions(), &target.mutable_view);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("not prepared by the cuda backend"));

  // Wrong head count, missing layer pointer, out-of-range layer.
  CacheView wrong = source.view;
  wrong.num_kv_heads = 3;
  status = backend->Translate(**prepared, wrong, positions, TranslateOptions(),
                              &target.mutable_view);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("source.num_kv_heads=3"));
  CacheView missing = source.view;
  missing.v[1] = nullptr;
  status = backend->Translate(**prepared, missing, positions, TranslateOptions(),
                              &target.mutable_view);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("source.v[1] is null"));
  status = backend->TranslateLayer(**prepared, 7, source.view, positions, TranslateOptions(),
                                   &target.mutable_view);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("target_layer=7"));
}

#else  // !KVT_HAVE_CUDA

TEST(CudaBackendTest, NeedsACudaBuild) {
  GTEST_SKIP() << "built without the CUDA toolkit: nothing to test";
}

#endif  // KVT_HAVE_CUDA

}  // namespace
}  // namespace kvt
