#include "kernels/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "kernels/dtype.h"
#include "kernels/onednn_matmul.h"
#include "kernels/rope.h"
#include "kernels/translation_plan.h"

namespace kvt {
namespace {

// Tokens per piece below which another thread costs more than it saves.
constexpr int64_t kMinTokensPerThread = 16;
// oneDNN path: GEMM rows are rounded up to this (padding rows zero), which bounds the distinct
// shapes, hence primitives, to chunk / 16 per weight shape.
constexpr int64_t kRowQuantum = 16;

// One K or V chain's weights in fp32, slot i for GemmStage::index i (ridge W / b in slot 0, an
// MLP's A1..A3 / c1..c3 in 0..2; chains stacked as in MlpView): owned conversions, or the
// store's bytes when already fp32. A null bias is none.
// A stage's matrix packed by oneDNN: one block per chain.
using PackedChains = std::vector<const PackedWeights*>;

struct Fp32Kind {
  std::array<const float*, 3> matrix = {};  // sgemm engine
  std::array<const float*, 3> bias = {};
  std::array<PackedChains, 3> packed;  // oneDNN fp32 engine: the matrices packed as fp32
};

// The oneDNN path's: each matrix packed in bf16 per chain, biases in fp32, all added by the
// matmuls (the hidden ones with the ReLU fused; the epilogue then only rotates and converts).
struct Bf16Kind {
  std::array<PackedChains, 3> matrix;
  std::array<const float*, 3> bias = {};
};

// h = relu(h + c) over a rows x cols block (leading dimension ld), in the one pass over the GEMM
// output that follows it.
void BiasRelu(const float* c, int64_t rows, int64_t cols, int64_t ld, float* h) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = h + i * ld;
    for (int64_t j = 0; j < cols; ++j) {
      const float v = row[j] + c[j];
      row[j] = v > 0.0f ? v : 0.0f;
    }
  }
}

void Sgemm(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
           int64_t ldb, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m),
              static_cast<int>(n), static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), 0.0f, c, static_cast<int>(ldc));
}

// A buffer that only grows and is never zero-filled: every element is written before it is
// read.
template <typename T = float>
class Scratch {
 public:
  T* Get(int64_t count) {
    if (count > size_) {
      data_.reset(new T[count]);
      size_ = count;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<T[]> data_;
  int64_t size_ = 0;
};

// One thread's working memory for a piece of tokens.
struct Workspace {
  Scratch<> x;       // gathered, stripped inputs: rows x KindPlan::gathered_width
  Scratch<> y;       // GEMM output: rows x (n_t d_t)
  Scratch<> h1, h2;  // MLP hidden activations: rows x H each
  Scratch<> tables;  // both models' RoPE for the piece (RopeTableLayout)
  // oneDNN path: the same inputs and hidden activations in bf16, and one source block in fp32
  // while its RoPE is stripped.
  Scratch<uint16_t> x16, h1_16, h2_16;
  Scratch<> block;
  Scratch<uint16_t> block16;  // head-local: one block in bf16 before it is scattered to chains
  Scratch<> y_head;  // one per_head chain's output: rows x d_t
};

class CpuPreparedMapper : public PreparedMapper {
 public:
  const MapperView& view() const override { return plan_.mapper(); }
  uint64_t bytes() const override { return bytes_; }

  TranslationPlan plan_;
  std::vector<std::array<Fp32Kind, 2>> fp32_;  // sgemm: everything; oneDNN: biases (+ packed)
  std::vector<std::unique_ptr<float[]>> owned_;
  CpuGemmPath path_ = CpuGemmPath::kSgemm;     // kOnednnBf16, kOnednnF32 or kSgemm
  std::vector<std::array<Bf16Kind, 2>> bf16_;  // oneDNN bf16 path
  std::vector<std::unique_ptr<PackedWeights>> packed_;
  uint64_t bytes_ = 0;
};

bool IsFp32(const WeightView& w) { return w.data == nullptr || w.dtype == DType::kFP32; }

// The weight matrices (not the biases) of a mapper: each call is (view, heads stacked along
// rows). A bf16 / fp16 one sends the mapper to the oneDNN path.
template <typename Fn>
void ForEachMatrix(const MapperView& mapper, Fn&& fn) {
  for (const LayerMapView& layer : mapper.layers) {
    if (mapper.kind == MapKind::kMlp) {
      for (const MlpView* mlp : {&layer.mlp_k, &layer.mlp_v}) {
        fn(mlp->a1, mlp->heads);
        fn(mlp->a2, mlp->heads);
        fn(mlp->a3, mlp->heads);
      }
    } else {
      // Head-local ridge stacks one matrix per target head, packed per head like MLP chains.
      const int heads = mapper.head_local ? mapper.target.num_kv_heads : 1;
      fn(layer.w_k, heads);
      fn(layer.w_v, heads);
    }
  }
}

template <typename Fn>
void ForEachBias(const MapperView& mapper, Fn&& fn) {
  for (const LayerMapView& layer : mapper.layers) {
    if (mapper.kind == MapKind::kMlp) {
      for (const MlpView* mlp : {&layer.mlp_k, &layer.mlp_v}) {
        fn(mlp->c1);
        fn(mlp->c2);
        fn(mlp->c3);
      }
    } else {
      fn(layer.b_k);
      fn(layer.b_v);
    }
  }
}

int64_t RoundUp(int64_t value, int64_t quantum) { return (value + quantum - 1) / quantum * quantum; }

// --- Prepare: the executor's copy of each stage's weights. ---

// `w` in fp32, converted on the pool once. fp32 weights are used where the store keeps them;
// the view is only valid while the store's handle is held anyway, so referencing its bytes adds
// no new lifetime constraint.
const float* ToFp32(const WeightView& w, ThreadPool* pool, CpuPreparedMapper* prepared) {
  if (w.data == nullptr) return nullptr;
  if (w.dtype == DType::kFP32) return static_cast<const float*>(w.data);
  const int64_t count = w.rows * w.cols;
  // new[] without () leaves the floats uninitialised: no pass zeroing gigabytes first.
  float* copy = prepared->owned_.emplace_back(new float[count]).get();
  const char* src = static_cast<const char*>(w.data);
  const size_t element = DTypeSize(w.dtype);
  constexpr int64_t kBlock = 1 << 16;
  pool->ParallelFor((count + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * kBlock;
      ToFloat(w.dtype, src + first * element, copy + first, std::min(kBlock, count - first));
    }
  });
  prepared->bytes_ += static_cast<uint64_t>(count) * sizeof(float);
  return copy;
}

// Every stage's matrix and bias in fp32 (the sgemm path), or (oneDNN path) the biases only.
void PrepareFp32(bool biases_only, ThreadPool* pool, CpuPreparedMapper* prepared) {
  const TranslationPlan& plan = prepared->plan_;
  const int layers = plan.mapper().target.num_layers;
  prepared->fp32_.resize(layers);
  for (int l = 0; l < layers; ++l) {
    for (const KindPlan& kind : plan.layer(l).kinds) {
      Fp32Kind& out = prepared->fp32_[l][static_cast<int>(kind.kind)];
      for (const GemmStage& stage : kind.map) {
        if (!biases_only) {
          out.matrix[stage.index] =
              ToFp32(StageMatrix(plan.mapper(), l, kind.kind, stage.index), pool, prepared);
        }
        out.bias[stage.index] =
            ToFp32(StageBias(plan.mapper(), l, kind.kind, stage.index), pool, prepared);
      }
    }
  }
}

// One matrix block (one chain of a stage) to pack into oneDNN's layout of `packed_as`.
struct PackJob {
  const WeightView* w;
  DType packed_as;
  int64_t heads, head;
  const PackedWeights** slot;
  std::unique_ptr<PackedWeights> packed;
  absl::Status status;
};

// The jobs of every stage's chains, packed as bf16 (into bf16_) or fp32 (into fp32_'s packed);
// their slots have final addresses once this returns.
std::vector<PackJob> PlanPackJobs(DType packed_as, CpuPreparedMapper* prepared) {
  const TranslationPlan& plan = prepared->plan_;
  const int layers = plan.mapper().target.num_layers;
  const bool bf16 = packed_as == DType::kBF16;
  if (bf16) prepared->bf16_.resize(layers);
  std::vector<PackJob> jobs;
  for (int l = 0; l < layers; ++l) {
    for (const KindPlan& kind : plan.layer(l).kinds) {
      const int k = static_cast<int>(kind.kind);
      if (bf16) prepared->bf16_[l][k].bias = prepared->fp32_[l][k].bias;
      for (const GemmStage& stage : kind.map) {
        PackedChains& slots = bf16 ? prepared->bf16_[l][k].matrix[stage.index]
                                   : prepared->fp32_[l][k].packed[stage.index];
        slots.resize(kind.heads);
        const WeightView& w = StageMatrix(plan.mapper(), l, kind.kind, stage.index);
        for (int64_t h = 0; h < kind.heads; ++h) {
          jobs.push_back(
              PackJob{&w, packed_as, kind.heads, h, &slots[h], nullptr, absl::OkStatus()});
        }
      }
    }
  }
  return jobs;
}

// Packs every job on the pool, then hands the packed blocks to `prepared`.
absl::Status RunPackJobs(std::vector<PackJob>& jobs, ThreadPool* pool,
                         CpuPreparedMapper* prepared) {
  // One OpenMP thread per job, as in TranslateLayer: no OpenMP team spins after Prepare.
  pool->ParallelFor(static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
    ScopedOmpThreads one(1);
    for (int64_t j = begin; j < end; ++j) {
      PackJob& job = jobs[j];
      const WeightView& w = *job.w;
      const int64_t rows = w.rows / job.heads;
      const char* src =
          static_cast<const char*>(w.data) + job.head * rows * w.cols * DTypeSize(w.dtype);
      absl::StatusOr<std::unique_ptr<PackedWeights>> packed =
          PackWeights(job.packed_as, w.dtype, src, rows, w.cols);
      if (packed.ok()) {
        job.packed = *std::move(packed);
      } else {
        job.status = packed.status();
      }
    }
  });
  for (PackJob& job : jobs) {
    if (!job.status.ok()) return job.status;
    prepared->bytes_ += job.packed->bytes();
    *job.slot = job.packed.get();
    prepared->packed_.push_back(std::move(job.packed));
  }
  return absl::OkStatus();
}

// --- TranslateLayer: the executor of one target layer's plan, piece by piece. ---

// What every piece of one call shares.
struct LayerCall {
  const TranslationPlan* plan;
  const LayerPlan* layer;
  const std::array<Fp32Kind, 2>* fp32;
  const std::array<Bf16Kind, 2>* bf16;  // oneDNN bf16 path only
  const CacheView* source;
  const MutableCacheView* target;
  std::array<void*, 2> outputs;  // the target layer's K and V
  const Positions* positions;
};

// Target heads [begin, end) of a work item. A head-local mapper's short requests split the heads
// over the threads as well as the tokens (CpuWork); every other item covers all n_t heads.
struct HeadRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// The chains an item runs: a per_layer map's one chain whole, else those of its heads.
HeadRange ChainRange(const KindPlan& kind, const HeadRange& heads) {
  return kind.heads == 1 ? HeadRange{0, 1} : heads;
}

// The RoPE tables of the piece in the workspace: the source's for every token it reads, the
// target's for its own.
struct PieceTables {
  const float* base;
  RopeTableLayout layout;
};

// Source block of token t (one layer's n_s heads) into fp32 `out`.
void ReadBlock(const CacheView& source, const void* layer, int64_t t, float* out) {
  const char* base = static_cast<const char*>(layer);
  const size_t element = DTypeSize(source.dtype);
  const int64_t ds = source.head_dim;
  const int64_t width = source.num_kv_heads * ds;
  if (source.layout == Layout::kNHD) {
    ToFloat(source.dtype, base + t * width * element, out, width);
    return;
  }
  for (int64_t h = 0; h < source.num_kv_heads; ++h) {
    ToFloat(source.dtype, base + (h * source.num_tokens + t) * ds * element, out + h * ds, ds);
  }
}

// A bf16 source block copied as is (values without RoPE on the oneDNN path).
void CopyBlockBf16(const CacheView& source, const void* layer, int64_t t, uint16_t* out) {
  const char* base = static_cast<const char*>(layer);
  const int64_t ds = source.head_dim;
  const int64_t width = source.num_kv_heads * ds;
  if (source.layout == Layout::kNHD) {
    std::memcpy(out, base + t * width * 2, width * 2);
    return;
  }
  for (int64_t h = 0; h < source.num_kv_heads; ++h) {
    std::memcpy(out + h * ds, base + (h * source.num_tokens + t) * ds * 2, ds * 2);
  }
}

// Strip: the source RoPE off every head of a block read at strip-table row `row`.
void StripBlock(const LayerCall& call, const PieceTables& tables, int64_t row, float* block) {
  const Rope& strip = call.plan->rope().strip();
  const int half = call.plan->rope().strip_half();
  const float* cos = tables.base + tables.layout.strip_cos + row * half;
  const float* sin = tables.base + tables.layout.strip_sin + row * half;
  for (int64_t h = 0; h < call.source->num_kv_heads; ++h) {
    strip.StripHead(cos, sin, block + h * call.source->head_dim);
  }
}

// Head-local: block b of row i, already stripped, into the columns of the item's chains in the
// head-major x (chain heads.begin + c's rows of map[0].in_width at c, `chain_rows` rows each).
template <typename T>
void ScatterHeads(const KindPlan& kind, int64_t ds, const T* block, int64_t chain_rows,
                  int64_t i, int64_t b, const HeadRange& heads, T* x) {
  const int64_t in = kind.map[0].in_width;
  for (int64_t h = heads.begin; h < heads.end; ++h) {
    const HeadSources& src = kind.chain_sources[h];
    std::memcpy(x + ((h - heads.begin) * chain_rows + i) * in + b * src.count * ds,
                block + src.first * ds, src.count * ds * sizeof(T));
  }
}

// Gather + strip, fp32: row i = token begin + i, columns [offset][sigma block][head][dim],
// block (o, b) from token begin + i - o (zero before the request's first token). Head-local:
// each block goes through `block` into the chains' head-major rows of `chain_rows` each (the
// GEMM's rows, padded on the oneDNN engine).
void GatherFp32(const LayerCall& call, const KindPlan& kind, const TokenPiece& piece,
                const PieceTables& tables, const HeadRange& heads, int64_t chain_rows,
                float* block, float* x) {
  const int64_t width = call.plan->source_width();
  const int64_t sigma_size = static_cast<int64_t>(kind.sigma.size());
  const auto& layers = kind.kind == KvKind::kKey ? call.source->k : call.source->v;
  for (int64_t i = 0; i < piece.rows; ++i) {
    for (int64_t b = 0; b < kind.blocks; ++b) {
      float* out = kind.head_local() ? block : x + i * kind.input_width + b * width;
      const int64_t t = piece.begin + i - b / sigma_size;
      if (t < 0) {
        std::memset(out, 0, width * sizeof(float));
      } else {
        ReadBlock(*call.source, layers[kind.sigma[b % sigma_size]], t, out);
        if (kind.strip) StripBlock(call, tables, t - piece.read_begin, out);
      }
      if (kind.head_local()) {
        ScatterHeads(kind, call.source->head_dim, out, chain_rows, i, b, heads, x);
      }
    }
  }
}

// The same gather for the oneDNN path: each block in fp32 while its RoPE is stripped, then
// rounded to bf16 (a bf16 value block without RoPE is copied as is). Head-local: through
// `block16` into the chains' head-major rows of `chain_rows` (the GEMM's padded rows) each.
void GatherBf16(const LayerCall& call, const KindPlan& kind, const TokenPiece& piece,
                const PieceTables& tables, const HeadRange& heads, int64_t chain_rows,
                float* block, uint16_t* block16, uint16_t* x16) {
  const int64_t width = call.plan->source_width();
  const int64_t sigma_size = static_cast<int64_t>(kind.sigma.size());
  const auto& layers = kind.kind == KvKind::kKey ? call.source->k : call.source->v;
  const bool copy = !kind.strip && call.source->dtype == DType::kBF16;
  for (int64_t i = 0; i < piece.rows; ++i) {
    for (int64_t b = 0; b < kind.blocks; ++b) {
      uint16_t* out16 = kind.head_local() ? block16 : x16 + i * kind.input_width + b * width;
      const int64_t t = piece.begin + i - b / sigma_size;
      const void* layer = layers[kind.sigma[b % sigma_size]];
      if (t < 0) {
        std::memset(out16, 0, width * sizeof(uint16_t));
      } else if (copy) {
        CopyBlockBf16(*call.source, layer, t, out16);
      } else {
        ReadBlock(*call.source, layer, t, block);
        if (kind.strip) StripBlock(call, tables, t - piece.read_begin, block);
        FromFloat(DType::kBF16, block, out16, width);
      }
      if (kind.head_local()) {
        ScatterHeads(kind, call.source->head_dim, out16, chain_rows, i, b, heads, x16);
      }
    }
  }
}

// Zero rows [rows, gemm_rows) of the oneDNN input (their outputs unused): after the row block
// of the whole row, or of every head-local chain.
template <typename T>
void ZeroPaddingRows(const KindPlan& kind, const HeadRange& heads, int64_t rows,
                     int64_t gemm_rows, T* x) {
  if (gemm_rows == rows) return;
  const int64_t chains = kind.head_local() ? heads.end - heads.begin : 1;
  const int64_t in = kind.head_local() ? kind.map[0].in_width : kind.input_width;
  for (int64_t h = 0; h < chains; ++h) {
    std::memset(x + (h * gemm_rows + rows) * in, 0, (gemm_rows - rows) * in * sizeof(T));
  }
}

// One fp32 GEMM of a chain's stage, out = in * matrix (ld_out apart), on the kind's engine:
// OpenBLAS sgemm on the fp32 copy, or oneDNN on the packed chain (`gemm_rows`, padded). oneDNN
// 2.6's brgemm wants a dense dst (a strided one falls to a far slower gemm): a strided output
// goes through `dense` and is copied.
absl::Status Fp32Gemm(const Fp32Kind& w, const GemmStage& g, int64_t h, const float* in,
                      int64_t rows, int64_t gemm_rows, float* out, int64_t ld_out,
                      float* dense) {
  if (w.packed[g.index].empty()) {
    Sgemm(rows, g.out_width, g.in_width, in, g.in_width,
          w.matrix[g.index] + h * g.in_width * g.out_width, g.out_width, out, ld_out);
    return absl::OkStatus();
  }
  const bool strided = ld_out != g.out_width;
  if (absl::Status st = F32Matmul(gemm_rows, in, g.in_width, *w.packed[g.index][h], nullptr,
                                  false, strided ? dense : out, g.out_width);
      !st.ok()) {
    return st;
  }
  if (strided) {
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(out + i * ld_out, dense + i * g.out_width, g.out_width * sizeof(float));
    }
  }
  return absl::OkStatus();
}

// Multiply, add, activate on an fp32 engine: each chain's stages in turn, the hidden stages'
// bias + ReLU in the pass after their GEMM. The last stage's bias waits for the epilogue.
absl::Status MultiplyFp32(const KindPlan& kind, const Fp32Kind& w, const float* x,
                          int64_t rows, int64_t gemm_rows, int64_t target_width,
                          const HeadRange& heads, float* const hidden[2], float* dense,
                          float* y) {
  const HeadRange chains = ChainRange(kind, heads);
  for (int64_t h = chains.begin; h < chains.end; ++h) {
    // Head-local chains read their own block of the head-major x; others the whole row.
    const float* in =
        kind.head_local() ? x + (h - chains.begin) * gemm_rows * kind.map[0].in_width : x;
    for (size_t s = 0; s < kind.map.size(); ++s) {
      const GemmStage& g = kind.map[s];
      const bool last = s + 1 == kind.map.size();
      float* out = last ? y + h * g.out_width : hidden[s % 2];
      if (absl::Status st = Fp32Gemm(w, g, h, in, rows, gemm_rows, out,
                                     last ? target_width : g.out_width, dense);
          !st.ok()) {
        return st;
      }
      if (g.activate) {
        BiasRelu(w.bias[g.index] + h * g.out_width, gemm_rows, g.out_width, g.out_width, out);
      }
      in = out;
    }
  }
  return absl::OkStatus();
}

// Where the oneDNN path's last matmul writes: `direct` into the target rows when set, else y
// (one chain) or one chain's block that is then copied into its columns of y.
struct Bf16Outputs {
  void* direct;
  float* y;
  float* y_head;
  uint16_t* hidden[2];
};

// Multiply, add, activate on the oneDNN path: bias (and ReLU) fused into every matmul, hidden
// outputs in bf16 (the next matmul's input). oneDNN 2.6's brgemm matmul wants a dense dst (a
// strided one falls to a far slower gemm): per_head chains write through y_head.
absl::Status MultiplyBf16(const KindPlan& kind, const Bf16Kind& w, const uint16_t* x16,
                          int64_t gemm_rows, int64_t rows, int64_t target_width,
                          const HeadRange& heads, const Bf16Outputs& out) {
  const HeadRange chains = ChainRange(kind, heads);
  for (int64_t h = chains.begin; h < chains.end; ++h) {
    const uint16_t* in =
        kind.head_local() ? x16 + (h - chains.begin) * gemm_rows * kind.map[0].in_width : x16;
    for (size_t s = 0; s < kind.map.size(); ++s) {
      const GemmStage& g = kind.map[s];
      const float* bias = w.bias[g.index] ? w.bias[g.index] + h * g.out_width : nullptr;
      const PackedWeights& matrix = *w.matrix[g.index][h];
      if (s + 1 < kind.map.size()) {
        if (absl::Status st = Bf16Matmul(gemm_rows, in, g.in_width, matrix, bias, true, true,
                                         out.hidden[s % 2], g.out_width);
            !st.ok()) {
          return st;
        }
        in = out.hidden[s % 2];
        continue;
      }
      const bool dense = kind.heads == 1;
      void* dst = out.direct ? out.direct : dense ? static_cast<void*>(out.y) : out.y_head;
      if (absl::Status st = Bf16Matmul(gemm_rows, in, g.in_width, matrix, bias, false,
                                       out.direct != nullptr, dst, g.out_width);
          !st.ok()) {
        return st;
      }
      if (dense) continue;
      for (int64_t i = 0; i < rows; ++i) {
        std::memcpy(out.y + i * target_width + h * g.out_width, out.y_head + i * g.out_width,
                    g.out_width * sizeof(float));
      }
    }
  }
  return absl::OkStatus();
}

// Convert: heads [heads.begin, heads.end) of one fp32 row of n_t d_t into token t of the target
// layer, in its dtype and layout.
void WriteRow(const MutableCacheView& target, void* layer, int64_t t, const HeadRange& heads,
              const float* row) {
  char* base = static_cast<char*>(layer);
  const size_t element = DTypeSize(target.dtype);
  const int64_t dt = target.head_dim;
  const int64_t width = target.num_kv_heads * dt;
  if (target.layout == Layout::kNHD) {
    FromFloat(target.dtype, row + heads.begin * dt,
              base + (t * width + heads.begin * dt) * element, (heads.end - heads.begin) * dt);
    return;
  }
  for (int64_t h = heads.begin; h < heads.end; ++h) {
    FromFloat(target.dtype, row + h * dt, base + (h * target.num_tokens + t) * dt * element, dt);
  }
}

// Epilogue of the item's heads: add (`bias` when not fused into the GEMM), rotate, convert.
void Epilogue(const LayerCall& call, const KindPlan& kind, const TokenPiece& piece,
              const PieceTables& tables, const HeadRange& heads, const float* bias, float* y) {
  const Rope& apply = call.plan->rope().apply();
  const int half = call.plan->rope().apply_half();
  const int64_t width = call.plan->target_width();
  const int64_t dt = call.target->head_dim;
  void* layer = call.outputs[static_cast<int>(kind.kind)];
  for (int64_t i = 0; i < piece.rows; ++i) {
    float* row = y + i * width;
    if (bias) {
      for (int64_t c = heads.begin * dt; c < heads.end * dt; ++c) row[c] += bias[c];
    }
    if (kind.rotate) {
      const float* cos = tables.base + tables.layout.apply_cos + i * half;
      const float* sin = tables.base + tables.layout.apply_sin + i * half;
      for (int64_t h = heads.begin; h < heads.end; ++h) apply.ApplyHead(cos, sin, row + h * dt);
    }
    WriteRow(*call.target, layer, piece.begin + i, heads, row);
  }
}

// One kind of one piece on an fp32 engine (sgemm, or oneDNN fp32 with its rows rounded up and
// the padding rows of x zero).
absl::Status RunKindFp32(const LayerCall& call, const KindPlan& kind, const TokenPiece& piece,
                         const PieceTables& tables, const HeadRange& heads, Workspace* ws) {
  const Fp32Kind& w = (*call.fp32)[static_cast<int>(kind.kind)];
  const int64_t rows = piece.rows;
  const bool onednn = !w.packed[0].empty();
  const int64_t gemm_rows = onednn ? RoundUp(rows, kRowQuantum) : rows;
  const int64_t width = call.plan->target_width();
  const int64_t max_hidden = call.plan->max_hidden();
  float* x = ws->x.Get(gemm_rows * call.plan->max_input_width());
  float* y = ws->y.Get(gemm_rows * width);
  float* const hidden[2] = {max_hidden ? ws->h1.Get(gemm_rows * max_hidden) : nullptr,
                            max_hidden ? ws->h2.Get(gemm_rows * max_hidden) : nullptr};
  // oneDNN's strided outputs go through a dense block (Fp32Gemm); sgemm writes them directly.
  float* dense = onednn ? ws->y_head.Get(gemm_rows * kind.last().out_width) : nullptr;
  GatherFp32(call, kind, piece, tables, heads, gemm_rows,
             ws->block.Get(call.plan->source_width()), x);
  ZeroPaddingRows(kind, heads, rows, gemm_rows, x);
  if (absl::Status st =
          MultiplyFp32(kind, w, x, rows, gemm_rows, width, heads, hidden, dense, y);
      !st.ok()) {
    return st;
  }
  Epilogue(call, kind, piece, tables, heads, w.bias[kind.last().index], y);
  return absl::OkStatus();
}

// oneDNN path, values into a bf16 [tokens, heads, dim] target: the last matmul writes the target
// rows itself (bias fused, rounded to nearest even), skipping the fp32 round trip and the
// epilogue. A short last piece (padding rows) goes through y.
void* DirectOutput(const LayerCall& call, const KindPlan& kind, const TokenPiece& piece,
                   int64_t gemm_rows) {
  if (kind.rotate || call.target->dtype != DType::kBF16 || call.target->layout != Layout::kNHD ||
      gemm_rows != piece.rows || kind.heads != 1) {
    return nullptr;
  }
  return static_cast<char*>(call.outputs[static_cast<int>(kind.kind)]) +
         piece.begin * call.plan->target_width() * sizeof(uint16_t);
}

// One kind of one piece on the oneDNN path: GEMM rows rounded up, the padding rows of x zero
// (their outputs unused).
absl::Status RunKindBf16(const LayerCall& call, const KindPlan& kind, const TokenPiece& piece,
                         const PieceTables& tables, const HeadRange& heads, Workspace* ws) {
  const int64_t gemm_rows = RoundUp(piece.rows, kRowQuantum);
  const int64_t width = call.plan->target_width();
  const int64_t max_hidden = call.plan->max_hidden();
  uint16_t* x16 = ws->x16.Get(gemm_rows * call.plan->max_input_width());
  Bf16Outputs out;
  out.direct = DirectOutput(call, kind, piece, gemm_rows);
  out.y = ws->y.Get(gemm_rows * width);
  out.y_head = kind.heads > 1 ? ws->y_head.Get(gemm_rows * call.target->head_dim) : nullptr;
  out.hidden[0] = max_hidden ? ws->h1_16.Get(gemm_rows * max_hidden) : nullptr;
  out.hidden[1] = max_hidden ? ws->h2_16.Get(gemm_rows * max_hidden) : nullptr;
  GatherBf16(call, kind, piece, tables, heads, gemm_rows,
             ws->block.Get(call.plan->source_width()), ws->block16.Get(call.plan->source_width()),
             x16);
  ZeroPaddingRows(kind, heads, piece.rows, gemm_rows, x16);
  const Bf16Kind& w = (*call.bf16)[static_cast<int>(kind.kind)];
  if (absl::Status s = MultiplyBf16(kind, w, x16, gemm_rows, piece.rows, width, heads, out);
      !s.ok()) {
    return s;
  }
  if (out.direct == nullptr) Epilogue(call, kind, piece, tables, heads, nullptr, out.y);
  return absl::OkStatus();
}

// One work item: a piece of tokens and a range of target heads.
struct WorkItem {
  TokenPiece piece;
  HeadRange heads;
};

// Tokens [begin, begin + rows) of the item's heads through gather -> GEMM -> epilogue, for K then
// V, on one thread with its own workspace; both models' rotations for these positions once per
// item.
absl::Status RunPiece(const LayerCall& call, const WorkItem& item, Workspace* ws) {
  const TokenPiece& piece = item.piece;
  const TranslationRope& rope = call.plan->rope();
  PieceTables tables;
  tables.layout = rope.TableLayout(piece.read_rows(), piece.rows);
  float* base = ws->tables.Get(tables.layout.floats);
  rope.Fill(*call.positions, piece.read_begin, piece.read_rows(), piece.begin, piece.rows, base);
  tables.base = base;
  for (const KindPlan& kind : call.layer->kinds) {
    absl::Status s = call.bf16 == nullptr
                         ? RunKindFp32(call, kind, piece, tables, item.heads, ws)
                         : RunKindBf16(call, kind, piece, tables, item.heads, ws);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

const char* CpuGemmPathName(CpuGemmPath path) {
  switch (path) {
    case CpuGemmPath::kAuto:
      return "auto";
    case CpuGemmPath::kOnednnBf16:
      return "onednn_bf16";
    case CpuGemmPath::kOnednnF32:
      return "onednn_f32";
    case CpuGemmPath::kSgemm:
      return "sgemm";
  }
  return "?";
}

absl::StatusOr<CpuGemmPath> ParseCpuGemmPath(absl::string_view name) {
  if (name == "auto") return CpuGemmPath::kAuto;
  if (name == "bf16" || name == "onednn_bf16") return CpuGemmPath::kOnednnBf16;
  if (name == "fp32" || name == "sgemm") return CpuGemmPath::kSgemm;
  if (name == "onednn_f32") return CpuGemmPath::kOnednnF32;
  return absl::InvalidArgumentError(absl::StrCat(
      "cpu gemm path '", name, "' is not one of auto, bf16, fp32, onednn_f32"));
}

CpuGemmPath PreparedGemmPath(const PreparedMapper& prepared) {
  const auto* cpu = dynamic_cast<const CpuPreparedMapper*>(&prepared);
  if (cpu == nullptr) return CpuGemmPath::kAuto;
  return cpu->path_;
}

CpuBackend::CpuBackend(const CpuBackendOptions& options)
    : options_(options), pool_(std::make_unique<ThreadPool>(options.num_threads)) {
  if (options_.token_chunk <= 0) options_.token_chunk = CpuBackendOptions().token_chunk;
  // Parallelism comes from the pool running independent token pieces, each calling sgemm;
  // OpenBLAS threads on top would oversubscribe the cores and spin between calls.
  openblas_set_num_threads(1);
  const std::string isa = OnednnIsaName();
  switch (options_.gemm_path) {
    case CpuGemmPath::kAuto: {
      GemmProbeOptions probe;
      probe.shapes = options_.probe_shapes;
      probe.rows = options_.token_chunk;
      probe.budget = options_.probe_budget;
      gemm_probe_ = ProbeGemmEnginesOnce(probe);
      gemm_path_ = PathOf(gemm_probe_->Fastest(false));
      fp32_path_ = PathOf(gemm_probe_->Fastest(true));
      gemm_reason_ = absl::StrCat("auto: measured ", gemm_probe_->Summary(),
                                  "; oneDNN dispatches ", isa);
      break;
    }
    case CpuGemmPath::kOnednnBf16:
      if (!OnednnBf16MatmulAvailable()) {
        // Forced, but oneDNN has no bf16 matmul below AVX-512: the only correct engine left.
        gemm_path_ = CpuGemmPath::kSgemm;
        gemm_reason_ = absl::StrCat("onednn_bf16 forced but oneDNN (", isa,
                                    ") has no bf16 matmul on this CPU");
        break;
      }
      gemm_path_ = CpuGemmPath::kOnednnBf16;
      gemm_reason_ = absl::StrCat("forced; oneDNN dispatches ", isa,
                                  OnednnHasBf16Hardware() ? "" : " (no bf16 hardware: emulated)");
      break;
    case CpuGemmPath::kOnednnF32:
    case CpuGemmPath::kSgemm:
      gemm_path_ = fp32_path_ = options_.gemm_path;
      gemm_reason_ = "forced";
      break;
  }
}

CpuGemmPath CpuBackend::PathOf(GemmEngine engine) {
  switch (engine) {
    case GemmEngine::kOnednnBf16:
      return CpuGemmPath::kOnednnBf16;
    case GemmEngine::kOnednnF32:
      return CpuGemmPath::kOnednnF32;
    case GemmEngine::kSgemm:
      return CpuGemmPath::kSgemm;
  }
  return CpuGemmPath::kSgemm;
}

std::string CpuBackend::description() const {
  const auto engine = [](CpuGemmPath path) {
    switch (path) {
      case CpuGemmPath::kOnednnBf16:
        return absl::StrCat("oneDNN ", OnednnVersion(), " bf16 matmul");
      case CpuGemmPath::kOnednnF32:
        return absl::StrCat("oneDNN ", OnednnVersion(), " fp32 matmul");
      default:
        return std::string("OpenBLAS sgemm");
    }
  };
  return absl::StrCat("cpu, ", pool_->num_threads(), " threads: bf16/fp16 mappers on ",
                      engine(gemm_path_), ", fp32 mappers on ", engine(fp32_path_), " (",
                      gemm_reason_, ")");
}

CpuGemmPath CpuBackend::PathFor(const MapperView& mapper) const {
  bool low_precision = false;
  ForEachMatrix(mapper, [&](const WeightView& w, int) { low_precision |= !IsFp32(w); });
  return low_precision ? gemm_path_ : fp32_path_;
}

uint64_t CpuBackend::PreparedBytesEstimate(const MapperView& mapper) const {
  const CpuGemmPath path = PathFor(mapper);
  if (path == CpuGemmPath::kSgemm) return Backend::PreparedBytesEstimate(mapper);
  const DType packed_as = path == CpuGemmPath::kOnednnBf16 ? DType::kBF16 : DType::kFP32;
  uint64_t bytes = 0;
  ForEachMatrix(mapper, [&](const WeightView& w, int heads) {
    if (w.data == nullptr || heads <= 0 || w.rows % heads != 0) return;
    absl::StatusOr<uint64_t> packed = PackedWeightBytes(packed_as, w.rows / heads, w.cols);
    // A shape oneDNN refuses fails Prepare; size the reservation as plain rows meanwhile.
    bytes += heads * (packed.ok() ? *packed
                                  : static_cast<uint64_t>(w.rows / heads * w.cols) *
                                        DTypeSize(packed_as));
  });
  ForEachBias(mapper, [&](const WeightView& b) {
    if (!IsFp32(b)) bytes += static_cast<uint64_t>(b.rows * b.cols) * sizeof(float);
  });
  return bytes;
}

absl::StatusOr<std::shared_ptr<PreparedMapper>> CpuBackend::Prepare(const MapperView& mapper) {
  absl::StatusOr<TranslationPlan> plan = TranslationPlan::Build(mapper);
  if (!plan.ok()) return plan.status();
  auto prepared = std::make_shared<CpuPreparedMapper>();
  prepared->plan_ = *std::move(plan);
  prepared->path_ = PathFor(mapper);
  const bool onednn = prepared->path_ != CpuGemmPath::kSgemm;
  PrepareFp32(/*biases_only=*/onednn, pool_.get(), prepared.get());
  if (onednn) {
    // Each matrix (each chain's block of a per_head MLP or head-local ridge) is packed into
    // oneDNN's layout by a job; the jobs run on the pool once every slot they fill has its
    // final address.
    std::vector<PackJob> jobs = PlanPackJobs(
        prepared->path_ == CpuGemmPath::kOnednnBf16 ? DType::kBF16 : DType::kFP32,
        prepared.get());
    if (absl::Status s = RunPackJobs(jobs, pool_.get(), prepared.get()); !s.ok()) return s;
  }
  return std::shared_ptr<PreparedMapper>(std::move(prepared));
}

namespace {

// The token pieces of one call: `threads` pool threads, or 0 when the pieces run serially.
std::vector<TokenPiece> CpuPieces(int64_t num_tokens, int64_t chunk, bool onednn, int window,
                                  int threads) {
  const int64_t min_pieces = (num_tokens + chunk - 1) / chunk;
  if (threads == 0) return EvenPieces(num_tokens, min_pieces, window);
  // Token-parallel: each thread runs whole pieces (its own gather, single-threaded GEMM and
  // epilogue), so no phase waits on another and no BLAS thread spins while the gather runs.
  // Measured on 2 cores (docs/BENCHMARKS.md): 0.66-0.78 of the sgemm rate with OpenBLAS
  // threads and a pooled gather/epilogue, 0.90-0.95 this way. Pieces are a multiple of the
  // thread count where the tokens allow, and never longer than `chunk`.
  const int64_t pieces = std::max(
      min_pieces, std::min<int64_t>((min_pieces + threads - 1) / threads * threads,
                                    num_tokens / kMinTokensPerThread));
  if (!onednn) return EvenPieces(num_tokens, pieces, window);
  // oneDNN path: equal pieces of a multiple of 16 rows (the last one shorter), so the matmul
  // shapes (and cached primitives) stay few.
  return FixedPieces(num_tokens,
                     std::min(RoundUp((num_tokens + pieces - 1) / pieces, kRowQuantum),
                              RoundUp(chunk, kRowQuantum)),
                     window);
}

// The items of one call: each piece with every head, or, for a head-local mapper with fewer
// pieces than threads (a short request), each piece with near-equal head ranges so every thread
// has work: the heads' GEMMs are independent.
std::vector<WorkItem> CpuWork(const std::vector<TokenPiece>& pieces, const TranslationPlan& plan,
                              int threads) {
  const int64_t heads = plan.mapper().target.num_kv_heads;
  const int64_t count = static_cast<int64_t>(pieces.size());
  int64_t groups = 1;
  if (plan.mapper().head_local && count > 0 && count < threads) {
    groups = std::min(heads, (threads + count - 1) / count);
  }
  std::vector<WorkItem> items;
  items.reserve(count * groups);
  for (const TokenPiece& piece : pieces) {
    for (int64_t g = 0; g < groups; ++g) {
      items.push_back({piece, HeadRange{heads * g / groups, heads * (g + 1) / groups}});
    }
  }
  return items;
}

absl::Status RunPiecesParallel(ThreadPool* pool, const LayerCall& call,
                               const std::vector<WorkItem>& pieces, bool onednn) {
  Mutex error_mu;
  absl::Status error;
  pool->ParallelFor(static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    // oneDNN runs single-threaded inside each piece (see onednn_matmul.h).
    std::unique_ptr<ScopedOmpThreads> one_omp_thread;
    if (onednn) one_omp_thread = std::make_unique<ScopedOmpThreads>(1);
    Workspace ws;
    for (int64_t piece = begin; piece < end; ++piece) {
      if (absl::Status s = RunPiece(call, pieces[piece], &ws); !s.ok()) {
        MutexLock lock(&error_mu);
        if (error.ok()) error = s;
        return;
      }
    }
  });
  return error;
}

}  // namespace

absl::Status CpuBackend::TranslateLayer(const PreparedMapper& mapper, int target_layer,
                                        const CacheView& source, const Positions& positions,
                                        const TranslateOptions& options,
                                        MutableCacheView* target) {
  if (target == nullptr) return absl::InvalidArgumentError("target is null");
  const auto* prepared = dynamic_cast<const CpuPreparedMapper*>(&mapper);
  if (prepared == nullptr) {
    return absl::InvalidArgumentError("mapper was not prepared by the cpu backend");
  }
  if (absl::Status s = CheckLayerCacheShapes(prepared->view(), target_layer, source, *target);
      !s.ok()) {
    return s;
  }
  if (source.num_tokens == 0) return absl::OkStatus();
  const LayerCall call{&prepared->plan_,
                       &prepared->plan_.layer(target_layer),
                       &prepared->fp32_[target_layer],
                       prepared->path_ == CpuGemmPath::kOnednnBf16
                           ? &prepared->bf16_[target_layer]
                           : nullptr,
                       &source,
                       target,
                       {target->k[target_layer], target->v[target_layer]},
                       &positions};
  const int64_t chunk = options.token_chunk > 0 ? options.token_chunk : options_.token_chunk;
  const bool onednn = prepared->path_ != CpuGemmPath::kSgemm;
  // When someone in this process re-enabled OpenBLAS threading after the constructor, running
  // pieces on the pool too would oversubscribe the cores: BLAS owns the parallelism then.
  const bool serial = !onednn && openblas_get_num_threads() > 1;
  const int threads = serial ? 0 : pool_->num_threads();
  const std::vector<WorkItem> items =
      CpuWork(CpuPieces(source.num_tokens, chunk, onednn, prepared->plan_.window(), threads),
              prepared->plan_, threads);
  if (serial) {
    Workspace ws;
    for (const WorkItem& item : items) {
      if (absl::Status s = RunPiece(call, item, &ws); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  return RunPiecesParallel(pool_.get(), call, items, onednn);
}

std::unique_ptr<Backend> NewCpuBackend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace kvt
