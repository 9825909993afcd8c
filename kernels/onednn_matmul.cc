#include "kernels/onednn_matmul.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "kernels/dtype.h"
#include "oneapi/dnnl/dnnl.hpp"

// libgomp's (the OpenMP runtime Debian's oneDNN is built on), declared here rather than by
// <omp.h>, which clang finds only with its own libomp headers (fuzz/Makefile builds with clang).
extern "C" {
int omp_get_max_threads(void);
void omp_set_num_threads(int num_threads);
}

namespace kvt {
namespace {

using dnnl::memory;
using Tag = memory::format_tag;
using Dt = memory::data_type;

// Rows of the matmul the weights' blocked layout is chosen for. oneDNN's brgemm matmul picks
// it from k and n (checked for m = 1 .. 512 on AVX-512 BF16); an execution primitive of any m
// is created with exactly this layout, so a different choice would only change which oneDNN
// implementation runs, never the result.
constexpr int64_t kPackRows = 512;
// Execution primitives kept before the cache starts over (shapes are few in practice: the
// backend rounds piece rows up to a multiple of 16, so a mapper has at most chunk / 16 row
// counts per weight shape).
constexpr size_t kMaxPrimitives = 4096;

dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

struct Caches {
  Mutex mu;
  std::map<std::tuple<int64_t, int64_t, Dt>, memory::desc> weights  // (k, n, dt) -> layout
      ABSL_GUARDED_BY(mu);
  struct Entry {
    dnnl::matmul primitive;
    memory::desc weights;
    memory::desc scratchpad;
    uint64_t scratchpad_bytes = 0;
  };
  // (src and weights dtype, m, k, n, lda, ldy, bias, relu, bf16_out)
  using Key = std::tuple<Dt, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool>;
  std::map<Key, std::shared_ptr<const Entry>> primitives ABSL_GUARDED_BY(mu);
  std::set<std::string> implementations ABSL_GUARDED_BY(mu);
};

Caches& GetCaches() {
  static Caches* caches = new Caches;
  return *caches;
}

absl::Status FromDnnl(const dnnl::error& e, const char* what) {
  return absl::InternalError(absl::StrCat("oneDNN ", what, ": ", e.what(), " (status ",
                                          static_cast<int>(e.status), ")"));
}

// oneDNN's data type of a packed-weights dtype (kBF16 or kFP32).
Dt DnnlType(DType dtype) { return dtype == DType::kFP32 ? Dt::f32 : Dt::bf16; }

// The blocked layout of a k x n weight matrix of `dt` (format "any", as oneDNN chooses it).
absl::StatusOr<memory::desc> WeightsDesc(int64_t k, int64_t n, Dt dt) {
  Caches& caches = GetCaches();
  {
    MutexLock lock(&caches.mu);
    auto it = caches.weights.find({k, n, dt});
    if (it != caches.weights.end()) return it->second;
  }
  try {
    ScopedOmpThreads one(1);
    const memory::desc src({kPackRows, k}, dt, Tag::ab);
    const memory::desc weights({k, n}, dt, Tag::any);
    const memory::desc dst({kPackRows, n}, Dt::f32, Tag::ab);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, weights, dst), attr, Engine());
    memory::desc chosen = pd.weights_desc();
    MutexLock lock(&caches.mu);
    caches.weights.emplace(std::make_tuple(k, n, dt), chosen);
    return chosen;
  } catch (const dnnl::error& e) {
    return FromDnnl(e, "matmul weights layout");
  }
}

// Per-thread user scratchpad (primitives are shared between threads, so none may own one).
std::vector<uint8_t>& ThreadScratchpad() {
  thread_local std::vector<uint8_t> scratchpad;
  return scratchpad;
}

dnnl::stream& ThreadStream() {
  thread_local dnnl::stream stream(Engine());
  return stream;
}

}  // namespace

std::string OnednnIsaName() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_mic:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_mic_4ops:
      return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return absl::StrCat("isa_", static_cast<int>(dnnl::get_effective_cpu_isa()));
  }
}

std::string OnednnVersion() {
  const dnnl_version_t* v = dnnl_version();
  return absl::StrCat(v->major, ".", v->minor, ".", v->patch);
}

bool OnednnHasBf16Hardware() {
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  return isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
}

bool OnednnBf16MatmulAvailable() {
  static const bool available = WeightsDesc(32, 32, Dt::bf16).ok();
  return available;
}

ScopedOmpThreads::ScopedOmpThreads(int threads) : saved_(omp_get_max_threads()) {
  if (saved_ != threads) omp_set_num_threads(threads);
}

ScopedOmpThreads::~ScopedOmpThreads() {
  if (omp_get_max_threads() != saved_) omp_set_num_threads(saved_);
}

PackedWeights::~PackedWeights() { std::free(data_); }

absl::StatusOr<uint64_t> PackedWeightBytes(DType packed, int64_t k, int64_t n) {
  absl::StatusOr<memory::desc> desc = WeightsDesc(k, n, DnnlType(packed));
  if (!desc.ok()) return desc.status();
  return static_cast<uint64_t>(desc->get_size());
}

absl::StatusOr<std::unique_ptr<PackedWeights>> PackWeights(DType packed_as, DType dtype,
                                                           const void* src, int64_t k,
                                                           int64_t n) {
  if (packed_as != DType::kBF16 && packed_as != DType::kFP32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "oneDNN weights are packed as bf16 or fp32, not ", DTypeName(packed_as)));
  }
  const Dt dt = DnnlType(packed_as);
  absl::StatusOr<memory::desc> desc = WeightsDesc(k, n, dt);
  if (!desc.ok()) return desc.status();
  auto packed = std::make_unique<PackedWeights>();
  packed->dtype_ = packed_as;
  packed->k_ = k;
  packed->n_ = n;
  packed->bytes_ = desc->get_size();
  packed->data_ = std::aligned_alloc(64, (packed->bytes_ + 63) / 64 * 64);
  if (packed->data_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", packed->bytes_,
                                                     " bytes of packed weights"));
  }
  // Plain rows of the packed dtype first (converted, bf16 rounded to nearest even), then
  // oneDNN's reorder into the blocked layout.
  std::vector<uint8_t> plain;
  const void* rows = src;
  if (dtype != packed_as) {
    const size_t in_element = DTypeSize(dtype), out_element = DTypeSize(packed_as);
    plain.resize(static_cast<size_t>(k * n) * out_element);
    std::vector<float> row(static_cast<size_t>(n));
    for (int64_t r = 0; r < k; ++r) {
      ToFloat(dtype, static_cast<const char*>(src) + r * n * in_element, row.data(), n);
      FromFloat(packed_as, row.data(), plain.data() + r * n * out_element, n);
    }
    rows = plain.data();
  }
  try {
    ScopedOmpThreads one(1);  // a reorder of one matrix; callers parallelise over matrices
    const memory::desc plain_desc({k, n}, dt, Tag::ab);
    memory from(plain_desc, Engine(), const_cast<void*>(rows));
    memory to(*desc, Engine(), packed->data_);
    dnnl::stream stream(Engine());
    dnnl::reorder(from, to).execute(stream, from, to);
    stream.wait();
  } catch (const dnnl::error& e) {
    return FromDnnl(e, "weights reorder");
  }
  return packed;
}

namespace {

// The matmul primitive descriptor of a shape: x and w of `dt`, y fp32 or bf16 (throws
// dnnl::error).
dnnl::matmul::primitive_desc MatmulDesc(Dt dt, int64_t m, int64_t k, int64_t n, int64_t lda,
                                        int64_t ldy, const memory::desc& weights, bool bias,
                                        bool relu, bool bf16_out) {
  const memory::desc src({m, k}, dt, {lda, 1});
  const memory::desc dst({m, n}, bf16_out ? Dt::bf16 : Dt::f32, {ldy, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (relu) {
    dnnl::post_ops ops;
    ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
    attr.set_post_ops(ops);
  }
  const dnnl::matmul::desc desc =
      bias ? dnnl::matmul::desc(src, weights, memory::desc({1, n}, Dt::f32, Tag::ab), dst)
           : dnnl::matmul::desc(src, weights, dst);
  return dnnl::matmul::primitive_desc(desc, attr, Engine());
}

absl::StatusOr<std::string> Implementation(Dt dt, int64_t m, int64_t k, int64_t n, bool bias,
                                           bool relu, bool bf16_out) {
  absl::StatusOr<memory::desc> weights = WeightsDesc(k, n, dt);
  if (!weights.ok()) return weights.status();
  try {
    ScopedOmpThreads one(1);
    return std::string(
        MatmulDesc(dt, m, k, n, k, n, *weights, bias, relu, bf16_out).impl_info_str());
  } catch (const dnnl::error& e) {
    return FromDnnl(e, "matmul");
  }
}

// The cached primitive of a shape, created on first use.
absl::StatusOr<std::shared_ptr<const Caches::Entry>> Primitive(const Caches::Key& key) {
  Caches& caches = GetCaches();
  {
    MutexLock lock(&caches.mu);
    auto it = caches.primitives.find(key);
    if (it != caches.primitives.end()) return it->second;
  }
  const auto& [dt, m, k, n, lda, ldy, bias, relu, bf16_out] = key;
  absl::StatusOr<memory::desc> weights = WeightsDesc(k, n, dt);
  if (!weights.ok()) return weights.status();
  const dnnl::matmul::primitive_desc pd =
      MatmulDesc(dt, m, k, n, lda, ldy, *weights, bias, relu, bf16_out);
  auto created = std::make_shared<Caches::Entry>();
  created->primitive = dnnl::matmul(pd);
  created->weights = *weights;
  created->scratchpad = pd.scratchpad_desc();
  created->scratchpad_bytes = pd.scratchpad_desc().get_size();
  MutexLock lock(&caches.mu);
  if (caches.primitives.size() >= kMaxPrimitives) caches.primitives.clear();
  caches.primitives.emplace(key, created);
  caches.implementations.insert(pd.impl_info_str());
  return created;
}

// y = act(x w + bias) on the primitive of `dt` (see Bf16Matmul / F32Matmul).
absl::Status Matmul(Dt dt, int64_t m, const void* x, int64_t lda, const PackedWeights& w,
                    const float* bias, bool relu, bool bf16_out, void* y, int64_t ldy) {
  if (DnnlType(w.dtype()) != dt) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights packed as ", DTypeName(w.dtype()), " for a matmul of another type"));
  }
  const int64_t k = w.k(), n = w.n();
  try {
    absl::StatusOr<std::shared_ptr<const Caches::Entry>> entry =
        Primitive({dt, m, k, n, lda, ldy, bias != nullptr, relu, bf16_out});
    if (!entry.ok()) return entry.status();
    std::vector<uint8_t>& scratchpad = ThreadScratchpad();
    if (scratchpad.size() < (*entry)->scratchpad_bytes + 64) {
      scratchpad.resize((*entry)->scratchpad_bytes + 64);
    }
    dnnl::engine& engine = Engine();
    // Memory objects over the caller's buffers: cheap, no copies.
    memory src_mem(memory::desc({m, k}, dt, {lda, 1}), engine, const_cast<void*>(x));
    memory weights_mem((*entry)->weights, engine, const_cast<void*>(w.data()));
    memory dst_mem(memory::desc({m, n}, bf16_out ? Dt::bf16 : Dt::f32, {ldy, 1}), engine, y);
    memory scratch_mem((*entry)->scratchpad, engine, scratchpad.data());
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, src_mem},
                                            {DNNL_ARG_WEIGHTS, weights_mem},
                                            {DNNL_ARG_DST, dst_mem},
                                            {DNNL_ARG_SCRATCHPAD, scratch_mem}};
    if (bias != nullptr) {
      args.emplace(DNNL_ARG_BIAS, memory(memory::desc({1, n}, Dt::f32, Tag::ab), engine,
                                         const_cast<float*>(bias)));
    }
    dnnl::stream& stream = ThreadStream();
    (*entry)->primitive.execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    return FromDnnl(e, "matmul");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> Bf16MatmulImplementation(int64_t m, int64_t k, int64_t n, bool bias,
                                                     bool relu, bool bf16_out) {
  return Implementation(Dt::bf16, m, k, n, bias, relu, bf16_out);
}

absl::StatusOr<std::string> F32MatmulImplementation(int64_t m, int64_t k, int64_t n) {
  return Implementation(Dt::f32, m, k, n, false, false, false);
}

absl::Status Bf16Matmul(int64_t m, const uint16_t* x, int64_t lda, const PackedWeights& w,
                        const float* bias, bool relu, bool bf16_out, void* y, int64_t ldy) {
  return Matmul(Dt::bf16, m, x, lda, w, bias, relu, bf16_out, y, ldy);
}

absl::Status F32Matmul(int64_t m, const float* x, int64_t lda, const PackedWeights& w,
                       const float* bias, bool relu, float* y, int64_t ldy) {
  return Matmul(Dt::f32, m, x, lda, w, bias, relu, false, y, ldy);
}

std::vector<std::string> OnednnImplementations() {
  Caches& caches = GetCaches();
  MutexLock lock(&caches.mu);
  return std::vector<std::string>(caches.implementations.begin(), caches.implementations.end());
}

int64_t OnednnCachedPrimitives() {
  Caches& caches = GetCaches();
  MutexLock lock(&caches.mu);
  return static_cast<int64_t>(caches.primitives.size());
}

}  // namespace kvt
