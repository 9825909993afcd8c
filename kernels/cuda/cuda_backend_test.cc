// GPU parity of the CUDA backend: CUDA vs the CPU backend's exact (sgemm) path vs the float64
// reference on fresh random inputs, ridge and MLP mappers (per_layer and per_head), every dtype,
// layout and RoPE type, device-, host- and mixed-resident caches, whole and per layer, split
// requests and another process's CUDA IPC memory; outputs poisoned (NaN) before every run so an
// element the kernels do not write fails. Needs a GPU: tagged manual, run by tests/gpu/run.sh.
#include "kernels/cuda/cuda_backend.h"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
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
#include "kernels/cuda/cuda_plan.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ipc.h"
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

// The CPU backend on its exact path: sgemm in fp32 whatever the CPU, never oneDNN's bf16
// (which rounds x and the hidden activations to bf16 and would need bf16's tolerance).
std::unique_ptr<Backend> MakeCpuSgemm() {
  CpuBackendOptions options;
  options.num_threads = 4;
  options.gemm_path = CpuGemmPath::kSgemm;
  return NewCpuBackend(options);
}

// The suite's tolerance for CUDA on `c` against the reference: SPEC 3's for the output dtype,
// or the case's 16-bit GEMM exception where CUDA's GEMMs read that dtype (cache, weights and
// output all bf16 or all fp16: the stripped input and MLP activations are rounded to it, as
// oneDNN rounds them to bf16).
double CudaTolerance(const ConformanceCase& c) {
  const DType gemm = cuda::GemmDType(c.in_dtype, c.spec.weight_dtype, c.out_dtype);
  const double exception = gemm == DType::kBF16   ? c.bf16_gemm_tolerance
                           : gemm == DType::kFP16 ? c.fp16_gemm_tolerance
                                                  : 0;
  return exception > 0 ? exception : TranslationTolerance(c.out_dtype);
}

// Every layer and kind of `target` against the reference within `tolerance`, and against `cpu`
// (the CPU sgemm output of the same translation, within SPEC 3 of the reference): the two
// differ by at most the sum of their distances to the reference.
void ExpectMatchesReferenceAndCpu(const char* what, const ConformanceInputs& inputs,
                                  const MutableCacheView& target, const MutableCacheView& cpu,
                                  DType out_dtype, double tolerance) {
  ExpectMatchesReference(what, inputs, target, tolerance);
  for (int l = 0; l < inputs.mapper.view.target.num_layers; ++l) {
    for (Kind kind : {Kind::kK, Kind::kV}) {
      EXPECT_LE(MaxRelError(ReadLayer(target, l, kind), ReadLayer(cpu, l, kind)),
                tolerance + TranslationTolerance(out_dtype))
          << what << " vs cpu sgemm, layer " << l << (kind == Kind::kK ? " K" : " V");
    }
  }
}

absl::Status HasDevice() {
  absl::StatusOr<int> devices = cuda::DeviceCount();
  if (devices.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("this test needs a CUDA device: ", devices.status().ToString()));
}

// A device copy of `target` after `run` wrote it, poisoned first.
template <typename Run>
OwnedCache OnDeviceTarget(const ConformanceCase& c, Run run) {
  const RandomMapperSpec& s = c.spec;
  auto device_target = DeviceCache::Poisoned(s.target_layers, s.target_heads, s.target_head_dim,
                                             c.tokens, c.out_dtype, c.out_layout);
  run(&device_target->mutable_view);
  return device_target->Download();
}

// One conformance case through every residency CUDA serves, each against the reference and the
// CPU's sgemm output: whole-cache Translate on device caches, per-layer TranslateLayer on device
// caches (kvtd's layer loop), per-layer on host caches (pinned staging), and both mixes.
void CheckOnCuda(const ConformanceCase& c, uint64_t seed) {
  const ConformanceInputs inputs = MakeConformanceInputs(c, seed);
  const CacheView& source = inputs.source.view;
  const int layers = c.spec.target_layers;
  const double tolerance = CudaTolerance(c);

  std::unique_ptr<Backend> cpu = MakeCpuSgemm();
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
  const auto expect = [&](const char* what, const OwnedCache& result) {
    ExpectMatchesReferenceAndCpu(what, inputs, result.mutable_view, cpu_target.mutable_view,
                                 c.out_dtype, tolerance);
  };
  const auto whole = [&](const CacheView& in, MutableCacheView* out) {
    absl::Status status =
        backend->Translate(**prepared, in, inputs.positions, inputs.options, out);
    EXPECT_TRUE(status.ok()) << status;
  };
  const auto per_layer = [&](const CacheView& in, MutableCacheView* out) {
    for (int l = 0; l < layers; ++l) {
      absl::Status status =
          backend->TranslateLayer(**prepared, l, in, inputs.positions, inputs.options, out);
      EXPECT_TRUE(status.ok()) << "layer " << l << ": " << status;
    }
  };
  const auto device_source = DeviceCache::Upload(source);
  const CacheView& on_device = device_source->view;
  expect("device Translate",
         OnDeviceTarget(c, [&](MutableCacheView* out) { whole(on_device, out); }));
  expect("device TranslateLayer",
         OnDeviceTarget(c, [&](MutableCacheView* out) { per_layer(on_device, out); }));
  expect("host source, device target",
         OnDeviceTarget(c, [&](MutableCacheView* out) { whole(source, out); }));
  {
    OwnedCache target = inputs.NewTarget(c);
    per_layer(source, &target.mutable_view);
    expect("host TranslateLayer", target);
  }
  {
    OwnedCache target = inputs.NewTarget(c);
    whole(on_device, &target.mutable_view);
    expect("device source, host target", target);
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

  std::unique_ptr<Backend> cpu = MakeCpuSgemm();
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
          << "vs cpu sgemm, layer " << l;
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

// The map is token-wise: [0, T) in one call equals [0, a) then [a, T) with positions carried,
// on device caches, for offsets and explicit positions, ridge and MLP. Pieces of other shapes
// may take other cuBLAS kernels (another summation order): within fp32's 1e-5, not bit-equal.
void CheckSplitEqualsWhole(const RandomMapperSpec& base, const char* name) {
  const uint64_t seed = FreshSeed(name);
  SCOPED_TRACE(absl::StrCat(name, " seed=", seed));
  std::mt19937_64 rng(seed);
  RandomMapperSpec spec = base;
  spec.source_layers = 3;
  spec.k = 2;
  spec.source_rope = MakeTestRope(RopeScalingType::kYarn);
  spec.target_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kGptj, 8);
  const RandomMapper mapper = MakeRandomMapper(spec, rng());
  const int64_t tokens = 150;
  const OwnedCache source = MakeRandomCache(3, 2, 16, tokens, DType::kBF16, Layout::kHND, rng());
  std::vector<uint64_t> explicit_positions(tokens);
  for (uint64_t& p : explicit_positions) p = rng() % 1000000;
  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);
  auto prepared = backend->Prepare(mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  // One piece [begin, end) of the request on device caches, downloaded.
  const auto translate = [&](int64_t begin, int64_t end, const Positions& positions) {
    const OwnedCache piece = SliceTokens(source.view, begin, end);
    auto device_source = DeviceCache::Upload(piece.view);
    auto device_target = DeviceCache::Poisoned(2, 2, 16, end - begin, DType::kFP32, Layout::kNHD);
    absl::Status status = backend->Translate(**prepared, device_source->view, positions,
                                             TranslateOptions(), &device_target->mutable_view);
    EXPECT_TRUE(status.ok()) << status;
    return device_target->Download();
  };
  for (bool use_explicit : {false, true}) {
    Positions whole_positions;
    whole_positions.offset = 1000;
    if (use_explicit) whole_positions.explicit_positions = explicit_positions.data();
    const OwnedCache whole = translate(0, tokens, whole_positions);
    for (int64_t split : {int64_t{1}, int64_t{61}, tokens - 1}) {
      SCOPED_TRACE(absl::StrCat("split=", split, use_explicit ? " explicit" : " offset"));
      Positions second_positions;
      second_positions.offset = 1000 + split;
      if (use_explicit) second_positions.explicit_positions = explicit_positions.data() + split;
      const OwnedCache first = translate(0, split, whole_positions);
      const OwnedCache second = translate(split, tokens, second_positions);
      for (int l = 0; l < 2; ++l) {
        for (Kind kind : {Kind::kK, Kind::kV}) {
          std::vector<double> joined = ReadLayer(first.mutable_view, l, kind);
          const std::vector<double> tail = ReadLayer(second.mutable_view, l, kind);
          joined.insert(joined.end(), tail.begin(), tail.end());
          const std::vector<double> ours = ReadLayer(whole.mutable_view, l, kind);
          EXPECT_LE(MaxRelError(joined, ours), TranslationTolerance(DType::kFP32))
              << "split vs whole, layer " << l;
          EXPECT_LE(MaxRelError(ours, ReferenceTranslate(mapper.view, l, kind, source.view,
                                                         whole_positions)),
                    TranslationTolerance(DType::kFP32))
              << "whole vs reference, layer " << l;
        }
      }
    }
  }
}

TEST_F(CudaBackendTest, SplitTranslationEqualsWhole) {
  CheckSplitEqualsWhole(RandomMapperSpec(), "SplitTranslationEqualsWhole ridge");
  RandomMapperSpec per_head;
  per_head.ridge_per_head = true;
  CheckSplitEqualsWhole(per_head, "SplitTranslationEqualsWhole ridge per_head");
  CheckSplitEqualsWhole(MlpSpec(true, 24), "SplitTranslationEqualsWhole mlp");
}

// ---- Another process's CUDA IPC memory, which the backend reads and writes in place (what a
// CUDA kvtd would do with a registered region instead of staging it through host memory).

// Set in the exporting child: "<bytes>,<slack>,<read fd>,<write fd>".
constexpr char kExporterEnv[] = "KVT_CUDA_IPC_EXPORTER";

// The exporting process: reads <bytes> from <read fd> into a device allocation <slack> bytes
// larger on each side, at offset <slack> (a tensor inside a caching allocator's block), writes
// the handle of that interior pointer and its offset from the base to <write fd>, and holds the
// allocation until <read fd> closes. Exit status 0 only if all of it worked.
int RunExporter(const char* spec) {
  unsigned long long bytes = 0, slack = 0;
  int in = -1, out = -1;
  if (std::sscanf(spec, "%llu,%llu,%d,%d", &bytes, &slack, &in, &out) != 4) return 10;
  std::vector<char> data(bytes);
  for (size_t got = 0; got < bytes;) {
    const ssize_t n = read(in, data.data() + got, bytes - got);
    if (n <= 0) return 11;
    got += static_cast<size_t>(n);
  }
  absl::StatusOr<void*> base = cuda::AllocateDevice(0, bytes + 2 * slack);
  if (!base.ok()) return 12;
  char* inside = static_cast<char*>(*base) + slack;
  if (!cuda::CopyToDevice(0, data.data(), inside, bytes).ok()) return 13;
  absl::StatusOr<cuda::IpcExport> exported = cuda::ExportIpcHandle(0, inside);
  if (!exported.ok() || exported->handle.size() != cuda::kIpcHandleBytes) return 14;
  if (write(out, exported->handle.data(), cuda::kIpcHandleBytes) !=
          static_cast<ssize_t>(cuda::kIpcHandleBytes) ||
      write(out, &exported->offset, sizeof(uint64_t)) != sizeof(uint64_t)) {
    return 15;
  }
  char byte;
  while (read(in, &byte, 1) > 0) {
  }
  cuda::FreeDevice(0, *base);
  return 0;
}

TEST(CudaIpcExporter, DISABLED_Export) {
  const char* spec = std::getenv(kExporterEnv);
  if (spec != nullptr) std::_Exit(RunExporter(spec));
}

// This binary re-run as the exporter; the parent talks to it through two pipes.
struct Exporter {
  pid_t pid = -1;
  int to_child = -1, from_child = -1;

  bool Start(size_t bytes, size_t slack) {
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) return false;
    const std::string spec = absl::StrCat(bytes, ",", slack, ",", down[0], ",", up[1]);
    // A child that died must fail Send, not kill this process.
    signal(SIGPIPE, SIG_IGN);
    pid = fork();
    if (pid == 0) {
      // Only the child's own ends stay open: its copy of the write end would keep its reads
      // from ever seeing the parent close the pipe.
      close(down[1]);
      close(up[0]);
      setenv(kExporterEnv, spec.c_str(), 1);
      execl("/proc/self/exe", "cuda_backend_test", "--gtest_also_run_disabled_tests",
            "--gtest_filter=CudaIpcExporter.DISABLED_Export", static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    close(down[0]);
    close(up[1]);
    to_child = down[1];
    from_child = up[0];
    return pid > 0;
  }
  bool Send(const std::vector<char>& data) const {
    for (size_t sent = 0; sent < data.size();) {
      const ssize_t n = write(to_child, data.data() + sent, data.size() - sent);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }
  bool Receive(void* into, size_t bytes) const {
    for (size_t got = 0; got < bytes;) {
      const ssize_t n = read(from_child, static_cast<char*>(into) + got, bytes - got);
      if (n <= 0) return false;
      got += static_cast<size_t>(n);
    }
    return true;
  }
  // Lets the child free its allocation and exit; its exit status.
  int Finish() {
    close(to_child);
    close(from_child);
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

// Layer-major views (K then V per layer, as a RegionRef packs them) of `layers` layers at `at`.
template <typename View, typename Pointer>
View PackedView(Pointer at, int layers, int heads, int head_dim, int64_t tokens, DType dtype,
                Layout layout) {
  View view;
  view.dtype = dtype;
  view.layout = layout;
  view.num_kv_heads = heads;
  view.head_dim = head_dim;
  view.num_tokens = tokens;
  const int64_t layer_bytes = tokens * heads * head_dim * static_cast<int64_t>(DTypeSize(dtype));
  for (int l = 0; l < layers; ++l) {
    view.k.push_back(at + 2 * l * layer_bytes);
    view.v.push_back(at + (2 * l + 1) * layer_bytes);
  }
  return view;
}

TEST_F(CudaBackendTest, ReadsAndWritesAnotherProcesssIpcMemory) {
  const uint64_t seed = FreshSeed("ReadsAndWritesAnotherProcesssIpcMemory");
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937_64 rng(seed);
  RandomMapperSpec spec;
  spec.source_layers = 3;
  spec.target_layers = 4;
  spec.k = 2;
  spec.weight_dtype = DType::kBF16;
  spec.source_rope = MakeTestRope(RopeScalingType::kYarn);
  spec.target_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kGptj);
  const RandomMapper mapper = MakeRandomMapper(spec, rng());
  const int64_t tokens = 77;
  const OwnedCache source = MakeRandomCache(3, 2, 16, tokens, DType::kBF16, Layout::kHND, rng());
  const int64_t layer_in = tokens * 2 * 16 * 2, layer_out = layer_in;
  const int64_t source_bytes = 3 * 2 * layer_in, target_bytes = 4 * 2 * layer_out;
  // The exporter's buffer: the packed source, then room for the target.
  std::vector<char> packed(source_bytes + target_bytes, 0);
  for (int l = 0; l < 3; ++l) {
    std::memcpy(packed.data() + 2 * l * layer_in, source.view.k[l], layer_in);
    std::memcpy(packed.data() + (2 * l + 1) * layer_in, source.view.v[l], layer_in);
  }
  constexpr size_t kSlack = 4352;  // not the base, and not a multiple of the 2 MiB granule
  Exporter exporter;
  ASSERT_TRUE(exporter.Start(packed.size(), kSlack));
  ASSERT_TRUE(exporter.Send(packed));
  std::string handle(cuda::kIpcHandleBytes, '\0');
  uint64_t offset = 0;
  ASSERT_TRUE(exporter.Receive(handle.data(), handle.size()) &&
              exporter.Receive(&offset, sizeof(offset)))
      << "the exporting process failed; exit status " << exporter.Finish();
  EXPECT_EQ(offset, kSlack) << "the exported pointer's offset from its allocation base";

  absl::StatusOr<cuda::IpcMapping> mapping =
      cuda::OpenIpcHandle(handle, 0, offset + packed.size());
  ASSERT_TRUE(mapping.ok()) << mapping.status();
  EXPECT_GE(mapping->allocation_bytes, packed.size() + 2 * kSlack);
  char* region = mapping->device_ptr + offset;  // offsets count from the allocation base
  ASSERT_TRUE(cuda::PoisonDeviceBuffer(region + source_bytes, target_bytes).ok());
  const CacheView in = PackedView<CacheView, const char*>(region, 3, 2, 16, tokens, DType::kBF16,
                                                          Layout::kHND);
  MutableCacheView out = PackedView<MutableCacheView, char*>(region + source_bytes, 4, 2, 16,
                                                             tokens, DType::kBF16, Layout::kHND);
  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);
  auto prepared = backend->Prepare(mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  Positions positions;
  positions.offset = 31;
  absl::Status status = backend->Translate(**prepared, in, positions, TranslateOptions(), &out);
  ASSERT_TRUE(status.ok()) << status;
  OwnedCache result = MakeOutputCache(4, 2, 16, tokens, DType::kBF16, Layout::kHND);
  for (int l = 0; l < 4; ++l) {
    ASSERT_TRUE(cuda::CopyToHost(0, out.k[l], result.mutable_view.k[l], layer_out).ok());
    ASSERT_TRUE(cuda::CopyToHost(0, out.v[l], result.mutable_view.v[l], layer_out).ok());
  }
  cuda::CloseIpcHandle(*mapping);
  EXPECT_EQ(exporter.Finish(), 0) << "the exporting process's exit status";
  for (int l = 0; l < 4; ++l) {
    for (Kind kind : {Kind::kK, Kind::kV}) {
      EXPECT_LE(MaxRelError(ReadLayer(result.mutable_view, l, kind),
                            ReferenceTranslate(mapper.view, l, kind, source.view, positions)),
                TranslationTolerance(DType::kBF16))
          << "layer " << l;
    }
  }
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

// Head-local ridge at real head shapes (8 x 128, k = 3, window 1 and 2, one bf16 batched GEMM of
// 2 x layers x 8 heads): CUDA vs CPU on every token, the float64 reference on a slice.
TEST_F(CudaBackendTest, RidgePerHeadRealHeadShapesBf16) {
  for (int window : {1, 2}) {
    const std::string name = absl::StrCat("RidgePerHeadRealHeadShapesBf16 window ", window);
    const uint64_t seed = FreshSeed(name.c_str());
    SCOPED_TRACE(absl::StrCat("window ", window, " seed=", seed));
    RandomMapperSpec spec = RealHeadShapes(RandomMapperSpec(), 3);
    spec.ridge_per_head = true;
    spec.window = window;
    CheckLongCache(spec, /*tokens=*/700, /*offset=*/321, /*begin=*/500, /*end=*/516, seed);
  }
}

// Streamed page-in of a head-local ridge mapper: the estimate equals bytes() (the chain table
// included), and layer l translates right after PrepareLayer(l), n_s = 2 n_t and padded sigma.
TEST_F(CudaBackendTest, RidgePerHeadStreamedPrepareCountsEveryWeight) {
  const uint64_t seed = FreshSeed("RidgePerHeadStreamedPrepareCountsEveryWeight");
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937_64 rng(seed);
  RandomMapperSpec spec;
  spec.ridge_per_head = true;
  spec.source_layers = 4;
  spec.source_heads = 4;
  spec.target_layers = 3;
  spec.k = 2;
  spec.k_v = 3;
  spec.window = 2;
  spec.weight_dtype = DType::kBF16;
  const RandomMapper mapper = MakeRandomMapper(spec, rng());
  const OwnedCache source = MakeRandomCache(4, 4, 16, 50, DType::kBF16, Layout::kNHD, rng());
  OwnedCache target = MakeOutputCache(3, 2, 16, 50, DType::kBF16, Layout::kHND);
  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend->BeginPrepare(mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ((*prepared)->bytes(), backend->PreparedBytesEstimate(mapper.view));
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
