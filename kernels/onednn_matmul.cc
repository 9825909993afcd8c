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
  std::map<std::pair<int64_t, int64_t>, memory::desc> weights  // (k, n) -> blocked layout
      ABSL_GUARDED_BY(mu);
  struct Entry {
    dnnl::matmul primitive;
    memory::desc weights;
    memory::desc scratchpad;
    uint64_t scratchpad_bytes = 0;
  };
  // (m, k, n, lda, ldy, bias, relu, bf16_out)
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool>;
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

// The blocked bf16 layout of a k x n weight matrix (format "any", as oneDNN chooses it).
absl::StatusOr<memory::desc> WeightsDesc(int64_t k, int64_t n) {
  Caches& caches = GetCaches();
  {
    MutexLock lock(&caches.mu);
    auto it = caches.weights.find({k, n});
    if (it != caches.weights.end()) return it->second;
  }
  try {
    ScopedOmpThreads one(1);
    const memory::desc src({kPackRows, k}, Dt::bf16, Tag::ab);
    const memory::desc weights({k, n}, Dt::bf16, Tag::any);
    const memory::desc dst({kPackRows, n}, Dt::f32, Tag::ab);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, weights, dst), attr, Engine());
    memory::desc chosen = pd.weights_desc();
    MutexLock lock(&caches.mu);
    caches.weights.emplace(std::make_pair(k, n), chosen);
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
  static const bool available = WeightsDesc(32, 32).ok();
  return available;
}

ScopedOmpThreads::ScopedOmpThreads(int threads) : saved_(omp_get_max_threads()) {
  if (saved_ != threads) omp_set_num_threads(threads);
}

ScopedOmpThreads::~ScopedOmpThreads() {
  if (omp_get_max_threads() != saved_) omp_set_num_threads(saved_);
}

PackedBf16Weights::~PackedBf16Weights() { std::free(data_); }

absl::StatusOr<uint64_t> PackedBf16WeightBytes(int64_t k, int64_t n) {
  absl::StatusOr<memory::desc> desc = WeightsDesc(k, n);
  if (!desc.ok()) return desc.status();
  return static_cast<uint64_t>(desc->get_size());
}

absl::StatusOr<std::unique_ptr<PackedBf16Weights>> PackBf16Weights(DType dtype, const void* src,
                                                                   int64_t k, int64_t n) {
  absl::StatusOr<memory::desc> desc = WeightsDesc(k, n);
  if (!desc.ok()) return desc.status();
  auto packed = std::make_unique<PackedBf16Weights>();
  packed->k_ = k;
  packed->n_ = n;
  packed->bytes_ = desc->get_size();
  packed->data_ = std::aligned_alloc(64, (packed->bytes_ + 63) / 64 * 64);
  if (packed->data_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", packed->bytes_, " bytes of packed bf16 weights"));
  }
  // Plain bf16 first (fp16 / fp32 rounded to nearest even), then oneDNN's reorder.
  std::vector<uint16_t> plain;
  const void* bf16 = src;
  if (dtype != DType::kBF16) {
    plain.resize(static_cast<size_t>(k * n));
    std::vector<float> row(static_cast<size_t>(n));
    const size_t element = DTypeSize(dtype);
    for (int64_t r = 0; r < k; ++r) {
      ToFloat(dtype, static_cast<const char*>(src) + r * n * element, row.data(), n);
      FromFloat(DType::kBF16, row.data(), plain.data() + r * n, n);
    }
    bf16 = plain.data();
  }
  try {
    ScopedOmpThreads one(1);  // a reorder of one matrix; callers parallelise over matrices
    const memory::desc plain_desc({k, n}, Dt::bf16, Tag::ab);
    memory from(plain_desc, Engine(), const_cast<void*>(bf16));
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

// The matmul primitive descriptor Bf16Matmul uses for a shape (throws dnnl::error).
dnnl::matmul::primitive_desc MatmulDesc(int64_t m, int64_t k, int64_t n, int64_t lda,
                                        int64_t ldy, const memory::desc& weights, bool bias,
                                        bool relu, bool bf16_out) {
  const memory::desc src({m, k}, Dt::bf16, {lda, 1});
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

}  // namespace

absl::StatusOr<std::string> Bf16MatmulImplementation(int64_t m, int64_t k, int64_t n, bool bias,
                                                     bool relu, bool bf16_out) {
  absl::StatusOr<memory::desc> weights = WeightsDesc(k, n);
  if (!weights.ok()) return weights.status();
  try {
    ScopedOmpThreads one(1);
    return std::string(MatmulDesc(m, k, n, k, n, *weights, bias, relu, bf16_out).impl_info_str());
  } catch (const dnnl::error& e) {
    return FromDnnl(e, "bf16 matmul");
  }
}

absl::Status Bf16Matmul(int64_t m, const uint16_t* x, int64_t lda, const PackedBf16Weights& w,
                        const float* bias, bool relu, bool bf16_out, void* y, int64_t ldy) {
  const int64_t k = w.k(), n = w.n();
  Caches& caches = GetCaches();
  const Caches::Key key{m, k, n, lda, ldy, bias != nullptr, relu, bf16_out};
  std::shared_ptr<const Caches::Entry> entry;
  {
    MutexLock lock(&caches.mu);
    auto it = caches.primitives.find(key);
    if (it != caches.primitives.end()) entry = it->second;
  }
  try {
    if (entry == nullptr) {
      absl::StatusOr<memory::desc> weights = WeightsDesc(k, n);
      if (!weights.ok()) return weights.status();
      const dnnl::matmul::primitive_desc pd =
          MatmulDesc(m, k, n, lda, ldy, *weights, bias != nullptr, relu, bf16_out);
      auto created = std::make_shared<Caches::Entry>();
      created->primitive = dnnl::matmul(pd);
      created->weights = *weights;
      created->scratchpad = pd.scratchpad_desc();
      created->scratchpad_bytes = pd.scratchpad_desc().get_size();
      entry = created;
      MutexLock lock(&caches.mu);
      if (caches.primitives.size() >= kMaxPrimitives) caches.primitives.clear();
      caches.primitives.emplace(key, entry);
      caches.implementations.insert(pd.impl_info_str());
    }
    std::vector<uint8_t>& scratchpad = ThreadScratchpad();
    if (scratchpad.size() < entry->scratchpad_bytes + 64) {
      scratchpad.resize(entry->scratchpad_bytes + 64);
    }
    dnnl::engine& engine = Engine();
    // Memory objects over the caller's buffers: cheap, no copies.
    memory src_mem(memory::desc({m, k}, Dt::bf16, {lda, 1}), engine, const_cast<uint16_t*>(x));
    memory weights_mem(entry->weights, engine, const_cast<void*>(w.data()));
    memory dst_mem(memory::desc({m, n}, bf16_out ? Dt::bf16 : Dt::f32, {ldy, 1}), engine, y);
    memory scratch_mem(entry->scratchpad, engine, scratchpad.data());
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, src_mem},
                                            {DNNL_ARG_WEIGHTS, weights_mem},
                                            {DNNL_ARG_DST, dst_mem},
                                            {DNNL_ARG_SCRATCHPAD, scratch_mem}};
    if (bias != nullptr) {
      args.emplace(DNNL_ARG_BIAS, memory(memory::desc({1, n}, Dt::f32, Tag::ab), engine,
                                         const_cast<float*>(bias)));
    }
    dnnl::stream& stream = ThreadStream();
    entry->primitive.execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    return FromDnnl(e, "bf16 matmul");
  }
  return absl::OkStatus();
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
