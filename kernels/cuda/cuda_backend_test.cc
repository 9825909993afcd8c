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
#include "kernels/testing/reference.h"

#if KVT_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvt {
namespace {

using ::kvt::testing::FreshSeed;
using ::kvt::testing::Kind;
using ::kvt::testing::MakeOutputCache;
using ::kvt::testing::MakeRandomCache;
using ::kvt::testing::MakeRandomMapper;
using ::kvt::testing::MakeTestRope;
using ::kvt::testing::MaxRelError;
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

struct Case {
  RandomMapperSpec spec;
  DType in_dtype = DType::kBF16;
  DType out_dtype = DType::kBF16;
  Layout in_layout = Layout::kHND;
  Layout out_layout = Layout::kHND;
  int64_t tokens = 37;
  uint64_t offset = 0;
  bool explicit_positions = false;
  int64_t chunk = 0;             // TranslateOptions::token_chunk
  int64_t workspace_bytes = 0;   // 0: the backend default
};

std::string Describe(const Case& c) {
  const RandomMapperSpec& s = c.spec;
  return absl::StrCat("L", s.source_layers, "x", s.source_heads, "x", s.source_head_dim, " -> L",
                      s.target_layers, "x", s.target_heads, "x", s.target_head_dim, " k=", s.k,
                      "/", s.k_v, " w=", DTypeName(s.weight_dtype), " rope ",
                      RopeScalingTypeName(s.source_rope.scaling.type), "/",
                      RopeStyleName(s.source_rope.style), " r=", s.source_rope.rotary_dim,
                      " -> ", RopeScalingTypeName(s.target_rope.scaling.type), "/",
                      RopeStyleName(s.target_rope.style), " r=", s.target_rope.rotary_dim, " ",
                      DTypeName(c.in_dtype), "/", LayoutName(c.in_layout), " -> ",
                      DTypeName(c.out_dtype), "/", LayoutName(c.out_layout), " T=", c.tokens,
                      " offset=", c.offset, c.explicit_positions ? " explicit" : "",
                      " chunk=", c.chunk, " workspace=", c.workspace_bytes);
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<int> devices = cuda::DeviceCount();
    ASSERT_TRUE(devices.ok()) << "this test needs a CUDA device: " << devices.status();
  }

  static std::unique_ptr<Backend> MakeCuda(int64_t workspace_bytes = 0) {
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
  // backend's output of the same translation).
  static void Compare(const char* what, const RandomMapper& mapper, const CacheView& source,
                      const Positions& positions, const MutableCacheView& target,
                      const MutableCacheView& cpu, DType out_dtype) {
    for (int l = 0; l < mapper.view.target.num_layers; ++l) {
      for (Kind kind : {Kind::kK, Kind::kV}) {
        const std::vector<double> actual = ReadLayer(target, l, kind);
        const std::vector<double> expected =
            ReferenceTranslate(mapper.view, l, kind, source, positions);
        EXPECT_LE(MaxRelError(actual, expected), TranslationTolerance(out_dtype))
            << what << " vs reference, layer " << l << (kind == Kind::kK ? " K" : " V");
        // Two fp32-accumulating backends differ by at most both their distances to the
        // reference.
        EXPECT_LE(MaxRelError(actual, ReadLayer(cpu, l, kind)),
                  2 * TranslationTolerance(out_dtype))
            << what << " vs cpu, layer " << l << (kind == Kind::kK ? " K" : " V");
      }
    }
  }

  // One random case through four paths: CUDA Translate on device caches, CUDA TranslateLayer
  // per layer on host caches (pinned staging), CUDA Translate with the source on the device and
  // the target in host memory, and the CPU backend; all against the reference.
  void CheckCase(const Case& c) {
    const uint64_t seed = FreshSeed(Describe(c).c_str());
    SCOPED_TRACE(absl::StrCat(Describe(c), " seed=", seed));
    std::mt19937_64 rng(seed);
    const RandomMapper mapper = MakeRandomMapper(c.spec, rng());
    const RandomMapperSpec& s = c.spec;
    const OwnedCache source = MakeRandomCache(s.source_layers, s.source_heads, s.source_head_dim,
                                              c.tokens, c.in_dtype, c.in_layout, rng());
    std::vector<uint64_t> explicit_positions(c.tokens);
    Positions positions;
    positions.offset = c.offset;
    if (c.explicit_positions) {
      std::uniform_int_distribution<uint64_t> dist(0, 2000000);
      for (uint64_t& p : explicit_positions) p = dist(rng);
      positions.explicit_positions = explicit_positions.data();
    }
    TranslateOptions options;
    options.token_chunk = c.chunk;

    CpuBackendOptions cpu_options;
    cpu_options.num_threads = 4;
    std::unique_ptr<Backend> cpu = NewCpuBackend(cpu_options);
    absl::StatusOr<std::shared_ptr<PreparedMapper>> cpu_prepared = cpu->Prepare(mapper.view);
    ASSERT_TRUE(cpu_prepared.ok()) << cpu_prepared.status();
    OwnedCache cpu_target = MakeOutputCache(s.target_layers, s.target_heads, s.target_head_dim,
                                            c.tokens, c.out_dtype, c.out_layout);
    ASSERT_TRUE(cpu->Translate(**cpu_prepared, source.view, positions, options,
                               &cpu_target.mutable_view)
                    .ok());

    std::unique_ptr<Backend> backend = MakeCuda(c.workspace_bytes);
    ASSERT_NE(backend, nullptr);
    absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend->Prepare(mapper.view);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    EXPECT_GT((*prepared)->bytes(), 0u);

    {  // Device-resident caches, all layers at once.
      auto device_source = DeviceCache::Upload(source.view);
      auto device_target = DeviceCache::Poisoned(s.target_layers, s.target_heads,
                                                 s.target_head_dim, c.tokens, c.out_dtype,
                                                 c.out_layout);
      absl::Status status = backend->Translate(**prepared, device_source->view, positions,
                                               options, &device_target->mutable_view);
      ASSERT_TRUE(status.ok()) << status;
      const OwnedCache result = device_target->Download();
      Compare("device Translate", mapper, source.view, positions, result.mutable_view,
              cpu_target.mutable_view, c.out_dtype);
    }
    {  // Host-memory caches, one target layer per call (the server's path).
      OwnedCache target = MakeOutputCache(s.target_layers, s.target_heads, s.target_head_dim,
                                          c.tokens, c.out_dtype, c.out_layout);
      for (int l = 0; l < s.target_layers; ++l) {
        absl::Status status = backend->TranslateLayer(**prepared, l, source.view, positions,
                                                      options, &target.mutable_view);
        ASSERT_TRUE(status.ok()) << status;
      }
      Compare("host TranslateLayer", mapper, source.view, positions, target.mutable_view,
              cpu_target.mutable_view, c.out_dtype);
    }
    {  // Mixed: device source, host target.
      auto device_source = DeviceCache::Upload(source.view);
      OwnedCache target = MakeOutputCache(s.target_layers, s.target_heads, s.target_head_dim,
                                          c.tokens, c.out_dtype, c.out_layout);
      absl::Status status = backend->Translate(**prepared, device_source->view, positions,
                                               options, &target.mutable_view);
      ASSERT_TRUE(status.ok()) << status;
      Compare("mixed Translate", mapper, source.view, positions, target.mutable_view,
              cpu_target.mutable_view, c.out_dtype);
    }
  }
};

std::vector<RopeConfig> EveryRope() {
  return {
      MakeTestRope(RopeScalingType::kNone),                            // neox default
      MakeTestRope(RopeScalingType::kNone, RopeStyle::kGptj),          // gptj
      MakeTestRope(RopeScalingType::kLinear),                          // linear
      MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 0, 500000),
      MakeTestRope(RopeScalingType::kYarn, RopeStyle::kNeox, 0, 1000000),
      MakeTestRope(RopeScalingType::kYarn, RopeStyle::kGptj, 8),       // partial, gptj
      MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kGptj, 12),    // partial
      MakeTestRope(RopeScalingType::kNone, RopeStyle::kNeox, 6),       // partial neox
  };
}

TEST_F(CudaBackendTest, EveryRopeTypeAndStyle) {
  const std::vector<RopeConfig> ropes = EveryRope();
  for (size_t i = 0; i < ropes.size(); ++i) {
    Case c;
    c.spec.source_layers = 3;
    c.spec.k = 2;
    c.spec.source_rope = ropes[i];
    c.spec.target_rope = ropes[(i + 3) % ropes.size()];
    c.offset = 1000 * i;
    CheckCase(c);
  }
}

TEST_F(CudaBackendTest, EveryDtypeLayoutAndWeightDtype) {
  for (DType in : {DType::kFP32, DType::kBF16, DType::kFP16}) {
    for (DType out : {DType::kFP32, DType::kBF16, DType::kFP16}) {
      for (Layout in_layout : {Layout::kHND, Layout::kNHD}) {
        for (Layout out_layout : {Layout::kHND, Layout::kNHD}) {
          Case c;
          c.spec.source_heads = 2;
          c.spec.target_heads = 3;
          c.spec.target_head_dim = 8;
          // Weights of the cache's dtype take the fast path (X in the cache's dtype); the
          // others convert to fp32 on the device.
          c.spec.weight_dtype = (in_layout == out_layout) ? in : DType::kBF16;
          c.spec.source_rope = MakeTestRope(RopeScalingType::kLinear);
          c.spec.target_rope = MakeTestRope(RopeScalingType::kNone, RopeStyle::kGptj, 4);
          c.in_dtype = in;
          c.out_dtype = out;
          c.in_layout = in_layout;
          c.out_layout = out_layout;
          c.tokens = 19;
          CheckCase(c);
        }
      }
    }
  }
}

TEST_F(CudaBackendTest, UnmatchedShapesAndOddHeadDim) {
  struct Shape {
    int ls, ns, ds, lt, nt, dt;
  };
  for (const Shape& shape : {Shape{4, 2, 16, 3, 3, 8}, Shape{3, 1, 32, 2, 4, 16},
                             Shape{2, 4, 8, 4, 1, 24}, Shape{3, 2, 14, 2, 3, 10}}) {
    for (int k = 1; k <= shape.ls; k += 2) {
      Case c;
      c.spec.source_layers = shape.ls;
      c.spec.source_heads = shape.ns;
      c.spec.source_head_dim = shape.ds;
      c.spec.target_layers = shape.lt;
      c.spec.target_heads = shape.nt;
      c.spec.target_head_dim = shape.dt;
      c.spec.k = k;
      c.spec.source_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, shape.ds / 2);
      c.spec.target_rope = MakeTestRope(RopeScalingType::kYarn, RopeStyle::kGptj);
      c.in_dtype = DType::kFP32;
      c.out_dtype = DType::kFP32;
      c.tokens = 29;
      c.offset = 17;
      CheckCase(c);
    }
  }
}

// |sigma_v| != |sigma_k|: the shorter list's blocks are zero-padded to one GEMM shape.
TEST_F(CudaBackendTest, SeparateSigmaLengths) {
  for (auto [k, k_v] : {std::pair<int, int>{1, 3}, std::pair<int, int>{4, 2}}) {
    Case c;
    c.spec.source_layers = 4;
    c.spec.k = k;
    c.spec.k_v = k_v;
    c.spec.source_rope = MakeTestRope(RopeScalingType::kLinear, RopeStyle::kGptj);
    c.spec.target_rope = MakeTestRope(RopeScalingType::kNone);
    c.in_dtype = DType::kFP32;
    c.out_dtype = DType::kFP32;
    c.tokens = 40;
    CheckCase(c);
  }
}

TEST_F(CudaBackendTest, NoBias) {
  Case c;
  c.spec.with_bias = false;
  c.spec.source_rope = MakeTestRope(RopeScalingType::kNone);
  c.spec.target_rope = MakeTestRope(RopeScalingType::kLinear);
  CheckCase(c);
}

TEST_F(CudaBackendTest, LargeAndExplicitPositions) {
  for (bool explicit_positions : {false, true}) {
    for (uint64_t offset : {uint64_t{0}, uint64_t{999983}, uint64_t{1} << 40}) {
      Case c;
      c.spec.source_rope = MakeTestRope(RopeScalingType::kYarn, RopeStyle::kNeox, 0, 1000000);
      c.spec.target_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 0, 500000);
      c.in_dtype = DType::kFP32;
      c.out_dtype = DType::kFP32;
      c.offset = offset;
      c.explicit_positions = explicit_positions;
      CheckCase(c);
    }
  }
}

// Token chunks and layer groups: small workspaces and chunk caps force many steps, and the
// staged paths' pinned double buffering runs through several slots.
TEST_F(CudaBackendTest, ChunksAndLayerGroups) {
  for (int64_t tokens : {1, 7, 64, 65, 300}) {
    for (int64_t chunk : {0, 1, 7, 64}) {
      for (int64_t workspace : {int64_t{0}, int64_t{64} << 10}) {
        Case c;
        c.spec.source_layers = 4;
        c.spec.target_layers = 5;
        c.spec.k = 3;
        c.spec.source_rope = MakeTestRope(RopeScalingType::kNone, RopeStyle::kGptj);
        c.spec.target_rope = MakeTestRope(RopeScalingType::kNone);
        c.tokens = tokens;
        c.chunk = chunk;
        c.workspace_bytes = workspace;
        c.offset = 5;
        c.in_layout = Layout::kNHD;
        c.in_dtype = DType::kFP32;
        c.out_dtype = DType::kFP32;
        CheckCase(c);
      }
    }
  }
}

// Real head shapes (8 x 128, Qwen3 / Llama), bf16: CUDA vs CPU on every token, the float64
// reference on a slice of 48 tokens (the whole would take minutes in double).
TEST_F(CudaBackendTest, RealHeadShapesBf16) {
  const uint64_t seed = FreshSeed("RealHeadShapesBf16");
  SCOPED_TRACE(absl::StrCat("seed=", seed));
  std::mt19937_64 rng(seed);
  RandomMapperSpec spec;
  spec.source_layers = 6;
  spec.source_heads = 8;
  spec.source_head_dim = 128;
  spec.target_layers = 4;
  spec.target_heads = 8;
  spec.target_head_dim = 128;
  spec.k = 3;
  spec.weight_dtype = DType::kBF16;
  spec.source_rope = MakeTestRope(RopeScalingType::kNone, RopeStyle::kNeox, 0, 1000000);
  spec.target_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 0, 500000);
  const RandomMapper mapper = MakeRandomMapper(spec, rng());
  const int64_t tokens = 1500;
  const OwnedCache source =
      MakeRandomCache(6, 8, 128, tokens, DType::kBF16, Layout::kHND, rng());
  Positions positions;
  positions.offset = 123;
  TranslateOptions options;

  std::unique_ptr<Backend> cpu = NewCpuBackend();
  auto cpu_prepared = cpu->Prepare(mapper.view);
  ASSERT_TRUE(cpu_prepared.ok()) << cpu_prepared.status();
  OwnedCache cpu_target = MakeOutputCache(4, 8, 128, tokens, DType::kBF16, Layout::kNHD);
  ASSERT_TRUE(
      cpu->Translate(**cpu_prepared, source.view, positions, options, &cpu_target.mutable_view)
          .ok());

  std::unique_ptr<Backend> backend = MakeCuda();
  ASSERT_NE(backend, nullptr);
  auto prepared = backend->Prepare(mapper.view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  auto device_source = DeviceCache::Upload(source.view);
  auto device_target = DeviceCache::Poisoned(4, 8, 128, tokens, DType::kBF16, Layout::kNHD);
  ASSERT_TRUE(backend
                  ->Translate(**prepared, device_source->view, positions, options,
                              &device_target->mutable_view)
                  .ok());
  const OwnedCache result = device_target->Download();

  const int64_t begin = 1000, end = 1048;
  const OwnedCache slice = SliceTokens(source.view, begin, end);
  const OwnedCache result_slice = SliceTokens(
      CacheView{result.view.dtype, result.view.layout, result.view.num_kv_heads,
                result.view.head_dim, result.view.num_tokens, result.view.k, result.view.v},
      begin, end);
  Positions slice_positions;
  slice_positions.offset = positions.offset + begin;
  for (int l = 0; l < 4; ++l) {
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
// three cuBLAS GEMMs with bias + ReLU kernels between them.

RandomMapperSpec MlpSpec(bool per_head, int hidden) {
  RandomMapperSpec spec;
  spec.kind = MapKind::kMlp;
  spec.mlp_per_head = per_head;
  spec.mlp_hidden = hidden;
  return spec;
}

// Both granularities, |sigma_k| != |sigma_v| (A1 rows zero-padded on the device), hidden widths
// below and above a warp, fp32 and bf16 (X and the hidden activations in bf16 on the tensor
// cores), through the device, host-staged and mixed paths.
TEST_F(CudaBackendTest, MlpBothGranularitiesFp32AndBf16) {
  for (bool per_head : {false, true}) {
    for (int hidden : {1, 8, 37}) {
      for (DType dtype : {DType::kFP32, DType::kBF16}) {
        Case c;
        c.spec = MlpSpec(per_head, hidden);
        c.spec.source_layers = 3;
        c.spec.target_layers = 2;
        c.spec.target_heads = 3;
        c.spec.target_head_dim = 8;
        c.spec.k = hidden == 8 ? 3 : 1;
        c.spec.k_v = 4 - c.spec.k;
        c.spec.weight_dtype = dtype;
        c.spec.source_rope = MakeTestRope(RopeScalingType::kYarn);
        c.spec.target_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kGptj);
        c.in_dtype = c.out_dtype = dtype;
        c.in_layout = per_head ? Layout::kNHD : Layout::kHND;
        c.out_layout = hidden == 37 ? Layout::kNHD : Layout::kHND;
        c.offset = 40;
        c.tokens = 45;
        SCOPED_TRACE(absl::StrCat(per_head ? "per_head" : "per_layer", " H=", hidden));
        CheckCase(c);
      }
    }
  }
}

// Weights of another dtype than the cache (converted to fp32 on the device per step, A1, A2 and
// A3), fp16, and an fp32 output of a bf16 cache.
TEST_F(CudaBackendTest, MlpMixedDtypesConvertWeights) {
  struct Dtypes {
    DType weights, in, out;
  };
  for (bool per_head : {false, true}) {
    for (const Dtypes& d : {Dtypes{DType::kBF16, DType::kFP32, DType::kFP32},
                            Dtypes{DType::kFP16, DType::kFP16, DType::kFP16},
                            Dtypes{DType::kBF16, DType::kBF16, DType::kFP32},
                            Dtypes{DType::kFP32, DType::kBF16, DType::kBF16}}) {
      Case c;
      c.spec = MlpSpec(per_head, 24);
      c.spec.source_heads = 2;
      c.spec.target_heads = 2;
      c.spec.weight_dtype = d.weights;
      c.spec.source_rope = MakeTestRope(RopeScalingType::kLinear);
      c.spec.target_rope = MakeTestRope(RopeScalingType::kNone, RopeStyle::kGptj, 4);
      c.in_dtype = d.in;
      c.out_dtype = d.out;
      c.tokens = 19;
      SCOPED_TRACE(per_head ? "per_head" : "per_layer");
      CheckCase(c);
    }
  }
}

// Small workspaces and token caps: the hidden activations force token chunks and layer groups.
TEST_F(CudaBackendTest, MlpChunksAndLayerGroups) {
  for (bool per_head : {false, true}) {
    for (int64_t tokens : {1, 65, 300}) {
      for (int64_t chunk : {0, 7}) {
        for (int64_t workspace : {int64_t{0}, int64_t{96} << 10}) {
          Case c;
          c.spec = MlpSpec(per_head, 40);
          c.spec.source_layers = 4;
          c.spec.target_layers = 5;
          c.spec.k = 3;
          c.spec.k_v = 2;
          c.spec.source_rope = MakeTestRope(RopeScalingType::kNone, RopeStyle::kGptj);
          c.spec.target_rope = MakeTestRope(RopeScalingType::kNone);
          c.tokens = tokens;
          c.chunk = chunk;
          c.workspace_bytes = workspace;
          c.offset = 5;
          c.in_layout = Layout::kNHD;
          c.in_dtype = DType::kFP32;
          c.out_dtype = DType::kFP32;
          SCOPED_TRACE(per_head ? "per_head" : "per_layer");
          CheckCase(c);
        }
      }
    }
  }
}

// Real head shapes (8 x 128), bf16, the format's default hidden width per_layer and a smaller
// one per_head: CUDA vs CPU on every token, the float64 reference on a slice of 16 tokens.
TEST_F(CudaBackendTest, MlpRealHeadShapesBf16) {
  for (bool per_head : {false, true}) {
    const uint64_t seed = FreshSeed(per_head ? "MlpRealHeadShapesBf16 per_head"
                                             : "MlpRealHeadShapesBf16 per_layer");
    SCOPED_TRACE(absl::StrCat(per_head ? "per_head" : "per_layer", " seed=", seed));
    std::mt19937_64 rng(seed);
    RandomMapperSpec spec = MlpSpec(per_head, per_head ? 256 : 1024);
    spec.source_layers = 6;
    spec.source_heads = 8;
    spec.source_head_dim = 128;
    spec.target_layers = 3;
    spec.target_heads = 8;
    spec.target_head_dim = 128;
    spec.k = 3;
    spec.weight_dtype = DType::kBF16;
    spec.source_rope = MakeTestRope(RopeScalingType::kNone, RopeStyle::kNeox, 0, 1000000);
    spec.target_rope = MakeTestRope(RopeScalingType::kLlama3, RopeStyle::kNeox, 0, 500000);
    const RandomMapper mapper = MakeRandomMapper(spec, rng());
    const int64_t tokens = 700;
    const OwnedCache source =
        MakeRandomCache(6, 8, 128, tokens, DType::kBF16, Layout::kHND, rng());
    Positions positions;
    positions.offset = 321;
    TranslateOptions options;

    std::unique_ptr<Backend> cpu = NewCpuBackend();
    auto cpu_prepared = cpu->Prepare(mapper.view);
    ASSERT_TRUE(cpu_prepared.ok()) << cpu_prepared.status();
    OwnedCache cpu_target = MakeOutputCache(3, 8, 128, tokens, DType::kBF16, Layout::kNHD);
    ASSERT_TRUE(cpu->Translate(**cpu_prepared, source.view, positions, options,
                               &cpu_target.mutable_view)
                    .ok());

    std::unique_ptr<Backend> backend = MakeCuda();
    ASSERT_NE(backend, nullptr);
    auto prepared = backend->Prepare(mapper.view);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    auto device_source = DeviceCache::Upload(source.view);
    auto device_target = DeviceCache::Poisoned(3, 8, 128, tokens, DType::kBF16, Layout::kNHD);
    absl::Status status = backend->Translate(**prepared, device_source->view, positions, options,
                                             &device_target->mutable_view);
    ASSERT_TRUE(status.ok()) << status;
    const OwnedCache result = device_target->Download();

    const int64_t begin = 500, end = 516;
    const OwnedCache slice = SliceTokens(source.view, begin, end);
    const OwnedCache result_slice = SliceTokens(
        CacheView{result.view.dtype, result.view.layout, result.view.num_kv_heads,
                  result.view.head_dim, result.view.num_tokens, result.view.k, result.view.v},
        begin, end);
    Positions slice_positions;
    slice_positions.offset = positions.offset + begin;
    for (int l = 0; l < 3; ++l) {
      for (Kind kind : {Kind::kK, Kind::kV}) {
        EXPECT_LE(MaxRelError(ReadLayer(result.mutable_view, l, kind),
                              ReadLayer(cpu_target.mutable_view, l, kind)),
                  2 * TranslationTolerance(DType::kBF16))
            << "vs cpu, layer " << l;
        EXPECT_LE(
            MaxRelError(ReadLayer(result_slice.view, l, kind),
                        ReferenceTranslate(mapper.view, l, kind, slice.view, slice_positions)),
            TranslationTolerance(DType::kBF16))
            << "vs reference, layer " << l;
      }
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
