#include "kernels/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "kernels/dtype.h"
#include "kernels/onednn_matmul.h"
#include "kernels/rope.h"

namespace kvt {
namespace {

// Tokens per piece below which another thread costs more than it saves.
constexpr int64_t kMinTokensPerThread = 16;
// oneDNN path: GEMM rows are rounded up to this (padding rows zero), which bounds the distinct
// shapes, hence primitives, to chunk / 16 per weight shape.
constexpr int64_t kRowQuantum = 16;

// One MLP chain in fp32, stacked per head as in MlpView.
struct Fp32Mlp {
  int64_t heads = 1;
  int64_t hidden = 0;
  const float *a1 = nullptr, *c1 = nullptr, *a2 = nullptr, *c2 = nullptr, *a3 = nullptr;
};

// One target layer's weights in fp32: owned conversions, or the store's bytes when already fp32.
// An MLP layer's c3 sits in b_k / b_v: with the heads' d_t blocks side by side it is a bias over
// the n_t d_t output columns in both granularities, so the shared epilogue adds it like ridge's.
struct Fp32Layer {
  const float* w_k = nullptr;
  const float* b_k = nullptr;  // null: no bias
  const float* w_v = nullptr;
  const float* b_v = nullptr;
  Fp32Mlp mlp_k, mlp_v;  // MLP mappers only
};

// The oneDNN path's weights: each matrix (per head for per_head MLPs) packed in bf16, biases in
// fp32, all added by the matmuls (c1 / c2 with the ReLU fused; b or c3 as the last matmul's
// bias; the shared epilogue then only rotates and converts).
struct Bf16Mlp {
  int64_t heads = 1;
  int64_t hidden = 0;
  std::vector<const PackedBf16Weights*> a1, a2, a3;  // one per head
  const float *c1 = nullptr, *c2 = nullptr;
};

struct Bf16Layer {
  const PackedBf16Weights* w_k = nullptr;
  const PackedBf16Weights* w_v = nullptr;
  Bf16Mlp mlp_k, mlp_v;
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

// y (rows x n_t d_t, before c3) = relu(relu(x A1 + c1) A2 + c2) A3 for one chain; per_head runs
// head h's chain on the full x and writes its d_t columns of y.
void MlpForward(const Fp32Mlp& mlp, const float* x, int64_t rows, int64_t inputs,
                int64_t target_width, float* h1, float* h2, float* y) {
  const int64_t hidden = mlp.hidden;
  const int64_t out = target_width / mlp.heads;
  for (int64_t h = 0; h < mlp.heads; ++h) {
    Sgemm(rows, hidden, inputs, x, inputs, mlp.a1 + h * inputs * hidden, hidden, h1, hidden);
    BiasRelu(mlp.c1 + h * hidden, rows, hidden, hidden, h1);
    Sgemm(rows, hidden, hidden, h1, hidden, mlp.a2 + h * hidden * hidden, hidden, h2, hidden);
    BiasRelu(mlp.c2 + h * hidden, rows, hidden, hidden, h2);
    Sgemm(rows, out, hidden, h2, hidden, mlp.a3 + h * hidden * out, out, y + h * out,
          target_width);
  }
}

// A float buffer that only grows and is never zero-filled: every element is written before
// it is read.
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
  Scratch<> x;                     // gathered, stripped inputs: rows x (window |sigma| n_s d_s)
  Scratch<> y;                     // GEMM output: rows x (n_t d_t)
  Scratch<> h1, h2;                // MLP hidden activations: rows x H each
  Scratch<> strip_cos, strip_sin;  // source RoPE per row
  Scratch<> apply_cos, apply_sin;  // target RoPE per row
  // oneDNN path: the same inputs and hidden activations in bf16, and one source block in fp32
  // while its RoPE is stripped.
  Scratch<uint16_t> x16, h1_16, h2_16;
  Scratch<> block;
  Scratch<> y_head;  // one per_head chain's output: rows x d_t
};

class CpuPreparedMapper : public PreparedMapper {
 public:
  const MapperView& view() const override { return view_; }
  uint64_t bytes() const override { return bytes_; }

  MapperView view_;
  Rope source_rope_;
  Rope target_rope_;
  std::vector<Fp32Layer> layers_;  // sgemm: everything; oneDNN: biases only
  std::vector<std::unique_ptr<float[]>> owned_;
  bool onednn_ = false;
  std::vector<Bf16Layer> bf16_layers_;  // oneDNN path
  std::vector<std::unique_ptr<PackedBf16Weights>> packed_;
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
      fn(layer.w_k, 1);
      fn(layer.w_v, 1);
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

}  // namespace

const char* CpuGemmPathName(CpuGemmPath path) {
  switch (path) {
    case CpuGemmPath::kAuto:
      return "auto";
    case CpuGemmPath::kOnednnBf16:
      return "onednn_bf16";
    case CpuGemmPath::kSgemm:
      return "sgemm";
  }
  return "?";
}

absl::StatusOr<CpuGemmPath> ParseCpuGemmPath(absl::string_view name) {
  if (name == "auto") return CpuGemmPath::kAuto;
  if (name == "bf16" || name == "onednn_bf16") return CpuGemmPath::kOnednnBf16;
  if (name == "fp32" || name == "sgemm") return CpuGemmPath::kSgemm;
  return absl::InvalidArgumentError(
      absl::StrCat("cpu gemm path '", name, "' is not one of auto, bf16, fp32"));
}

CpuGemmPath PreparedGemmPath(const PreparedMapper& prepared) {
  const auto* cpu = dynamic_cast<const CpuPreparedMapper*>(&prepared);
  if (cpu == nullptr) return CpuGemmPath::kAuto;
  return cpu->onednn_ ? CpuGemmPath::kOnednnBf16 : CpuGemmPath::kSgemm;
}

CpuBackend::CpuBackend(const CpuBackendOptions& options)
    : options_(options), pool_(std::make_unique<ThreadPool>(options.num_threads)) {
  if (options_.token_chunk <= 0) options_.token_chunk = CpuBackendOptions().token_chunk;
  // Parallelism comes from the pool running independent token pieces, each calling sgemm;
  // OpenBLAS threads on top would oversubscribe the cores and spin between calls.
  openblas_set_num_threads(1);
  const std::string isa = OnednnIsaName();
  switch (options_.gemm_path) {
    case CpuGemmPath::kAuto:
      if (OnednnHasBf16Hardware()) {
        gemm_path_ = CpuGemmPath::kOnednnBf16;
        gemm_reason_ = absl::StrCat("auto: oneDNN dispatches ", isa, " (bf16 hardware)");
      } else {
        gemm_path_ = CpuGemmPath::kSgemm;
        gemm_reason_ = absl::StrCat("auto: oneDNN dispatches ", isa,
                                    ", no AVX-512 BF16 or AMX, so sgemm is faster");
      }
      break;
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
    case CpuGemmPath::kSgemm:
      gemm_path_ = CpuGemmPath::kSgemm;
      gemm_reason_ = "forced";
      break;
  }
}

std::string CpuBackend::description() const {
  if (gemm_path_ == CpuGemmPath::kOnednnBf16) {
    return absl::StrCat("cpu, ", pool_->num_threads(), " threads: bf16/fp16 mappers on oneDNN ",
                        OnednnVersion(), " bf16 matmul (", gemm_reason_,
                        "), fp32 mappers on OpenBLAS sgemm");
  }
  return absl::StrCat("cpu, ", pool_->num_threads(),
                      " threads: every mapper on OpenBLAS sgemm (fp32 weights; ", gemm_reason_,
                      ")");
}

bool CpuBackend::UsesOnednn(const MapperView& mapper) const {
  if (gemm_path_ != CpuGemmPath::kOnednnBf16) return false;
  bool low_precision = false;
  ForEachMatrix(mapper, [&](const WeightView& w, int) { low_precision |= !IsFp32(w); });
  return low_precision;
}

uint64_t CpuBackend::PreparedBytesEstimate(const MapperView& mapper) const {
  if (!UsesOnednn(mapper)) return Backend::PreparedBytesEstimate(mapper);
  uint64_t bytes = 0;
  ForEachMatrix(mapper, [&](const WeightView& w, int heads) {
    if (w.data == nullptr || heads <= 0 || w.rows % heads != 0) return;
    absl::StatusOr<uint64_t> packed = PackedBf16WeightBytes(w.rows / heads, w.cols);
    // A shape oneDNN refuses fails Prepare; size the reservation as plain bf16 meanwhile.
    bytes += heads * (packed.ok() ? *packed : static_cast<uint64_t>(w.rows / heads * w.cols * 2));
  });
  ForEachBias(mapper, [&](const WeightView& b) {
    if (!IsFp32(b)) bytes += static_cast<uint64_t>(b.rows * b.cols) * sizeof(float);
  });
  return bytes;
}

absl::StatusOr<std::shared_ptr<PreparedMapper>> CpuBackend::Prepare(const MapperView& mapper) {
  if (absl::Status s = CheckMapperView(mapper); !s.ok()) return s;

  auto prepared = std::make_shared<CpuPreparedMapper>();
  prepared->view_ = mapper;
  absl::StatusOr<Rope> source_rope = Rope::Create(mapper.source.rope, mapper.source.head_dim);
  if (!source_rope.ok()) return source_rope.status();
  absl::StatusOr<Rope> target_rope = Rope::Create(mapper.target.rope, mapper.target.head_dim);
  if (!target_rope.ok()) return target_rope.status();
  prepared->source_rope_ = *std::move(source_rope);
  prepared->target_rope_ = *std::move(target_rope);

  // fp32 weights are used where the store keeps them; the view is only valid while the store's
  // handle is held anyway, so referencing its bytes adds no new lifetime constraint.
  const auto to_fp32 = [&](const WeightView& w) -> const float* {
    if (w.data == nullptr) return nullptr;
    if (w.dtype == DType::kFP32) return static_cast<const float*>(w.data);
    const int64_t count = w.rows * w.cols;
    // new[] without () leaves the floats uninitialised: no pass zeroing gigabytes first.
    float* copy = prepared->owned_.emplace_back(new float[count]).get();
    const char* src = static_cast<const char*>(w.data);
    const size_t element = DTypeSize(w.dtype);
    constexpr int64_t kBlock = 1 << 16;
    pool_->ParallelFor((count + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t first = block * kBlock;
        ToFloat(w.dtype, src + first * element, copy + first, std::min(kBlock, count - first));
      }
    });
    prepared->bytes_ += static_cast<uint64_t>(count) * sizeof(float);
    return copy;
  };
  const auto mlp_to_fp32 = [&](const MlpView& mlp, Fp32Mlp* out, const float** c3) {
    out->heads = mlp.heads;
    out->hidden = mlp.hidden;
    out->a1 = to_fp32(mlp.a1);
    out->c1 = to_fp32(mlp.c1);
    out->a2 = to_fp32(mlp.a2);
    out->c2 = to_fp32(mlp.c2);
    out->a3 = to_fp32(mlp.a3);
    *c3 = to_fp32(mlp.c3);
  };
  if (UsesOnednn(mapper)) {
    prepared->onednn_ = true;
    // Each matrix (each head's block of a per_head chain) is packed into oneDNN's bf16 layout
    // by a job; the jobs run on the pool once every slot they fill has its final address.
    struct PackJob {
      const WeightView* w;
      int64_t heads, head;
      const PackedBf16Weights** slot;
      std::unique_ptr<PackedBf16Weights> packed;
      absl::Status status;
    };
    std::vector<PackJob> jobs;
    const auto pack = [&](const WeightView& w, int64_t heads, int64_t head,
                          const PackedBf16Weights** slot) {
      jobs.push_back(PackJob{&w, heads, head, slot, nullptr, absl::OkStatus()});
    };
    const auto pack_mlp = [&](const MlpView& mlp, Bf16Mlp* out, Fp32Mlp* biases,
                              const float** c3) {
      out->heads = biases->heads = mlp.heads;
      out->hidden = biases->hidden = mlp.hidden;
      for (auto [w, list] : {std::pair{&mlp.a1, &out->a1}, std::pair{&mlp.a2, &out->a2},
                             std::pair{&mlp.a3, &out->a3}}) {
        list->resize(mlp.heads);
        for (int64_t h = 0; h < mlp.heads; ++h) pack(*w, mlp.heads, h, &(*list)[h]);
      }
      out->c1 = biases->c1 = to_fp32(mlp.c1);
      out->c2 = biases->c2 = to_fp32(mlp.c2);
      *c3 = to_fp32(mlp.c3);
    };
    prepared->bf16_layers_.reserve(mapper.layers.size());  // slots keep their addresses
    for (const LayerMapView& layer : mapper.layers) {
      Fp32Layer biases;
      Bf16Layer& bf16 = prepared->bf16_layers_.emplace_back();
      if (mapper.kind == MapKind::kMlp) {
        pack_mlp(layer.mlp_k, &bf16.mlp_k, &biases.mlp_k, &biases.b_k);
        pack_mlp(layer.mlp_v, &bf16.mlp_v, &biases.mlp_v, &biases.b_v);
      } else {
        pack(layer.w_k, 1, 0, &bf16.w_k);
        pack(layer.w_v, 1, 0, &bf16.w_v);
        biases.b_k = to_fp32(layer.b_k);
        biases.b_v = to_fp32(layer.b_v);
      }
      prepared->layers_.push_back(biases);
    }
    // One OpenMP thread per job, as in TranslateLayer: no OpenMP team spins after Prepare.
    pool_->ParallelFor(static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
      ScopedOmpThreads one(1);
      for (int64_t j = begin; j < end; ++j) {
        PackJob& job = jobs[j];
        const WeightView& w = *job.w;
        const int64_t rows = w.rows / job.heads;
        const char* src =
            static_cast<const char*>(w.data) + job.head * rows * w.cols * DTypeSize(w.dtype);
        absl::StatusOr<std::unique_ptr<PackedBf16Weights>> packed =
            PackBf16Weights(w.dtype, src, rows, w.cols);
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
    return std::shared_ptr<PreparedMapper>(std::move(prepared));
  }
  for (const LayerMapView& layer : mapper.layers) {
    Fp32Layer fp32;
    if (mapper.kind == MapKind::kMlp) {
      mlp_to_fp32(layer.mlp_k, &fp32.mlp_k, &fp32.b_k);
      mlp_to_fp32(layer.mlp_v, &fp32.mlp_v, &fp32.b_v);
    } else {
      fp32.w_k = to_fp32(layer.w_k);
      fp32.b_k = to_fp32(layer.b_k);
      fp32.w_v = to_fp32(layer.w_v);
      fp32.b_v = to_fp32(layer.b_v);
    }
    prepared->layers_.push_back(fp32);
  }
  return std::shared_ptr<PreparedMapper>(std::move(prepared));
}

absl::Status CpuBackend::TranslateLayer(const PreparedMapper& mapper, int target_layer,
                                        const CacheView& source, const Positions& positions,
                                        const TranslateOptions& options,
                                        MutableCacheView* target) {
  if (target == nullptr) return absl::InvalidArgumentError("target is null");
  const auto* prepared = dynamic_cast<const CpuPreparedMapper*>(&mapper);
  if (prepared == nullptr) {
    return absl::InvalidArgumentError("mapper was not prepared by the cpu backend");
  }
  const MapperView& view = prepared->view();
  if (absl::Status s = CheckLayerCacheShapes(view, target_layer, source, *target); !s.ok()) {
    return s;
  }
  const int64_t num_tokens = source.num_tokens;
  if (num_tokens == 0) return absl::OkStatus();

  const LayerMapView& layer = view.layers[target_layer];
  const Fp32Layer& weights = prepared->layers_[target_layer];
  const bool onednn = prepared->onednn_;
  const Bf16Layer* packed = onednn ? &prepared->bf16_layers_[target_layer] : nullptr;
  const int64_t ns = source.num_kv_heads, ds = source.head_dim;
  const int64_t nt = target->num_kv_heads, dt = target->head_dim;
  const int64_t source_width = ns * ds;
  const int64_t target_width = nt * dt;
  const size_t source_element = DTypeSize(source.dtype);
  const size_t target_element = DTypeSize(target->dtype);
  const int64_t chunk = options.token_chunk > 0 ? options.token_chunk : options_.token_chunk;

  struct Kind {
    const std::vector<int>* sigma;
    const std::vector<const void*>* source;
    void* target;
    const float* w;      // ridge
    const Fp32Mlp* mlp;  // MLP mappers: the chain instead of w
    const float* b;      // ridge b or MLP c3, added in the epilogue
    bool rope;  // keys only: values carry no position
    const PackedBf16Weights* w16;  // oneDNN path, ridge
    const Bf16Mlp* mlp16;          // oneDNN path, MLP
  };
  const bool is_mlp = view.kind == MapKind::kMlp;
  const Kind kinds[2] = {
      {&layer.sigma_k, &source.k, target->k[target_layer], weights.w_k,
       is_mlp ? &weights.mlp_k : nullptr, weights.b_k, true, packed ? packed->w_k : nullptr,
       packed && is_mlp ? &packed->mlp_k : nullptr},
      {&layer.sigma_v, &source.v, target->v[target_layer], weights.w_v,
       is_mlp ? &weights.mlp_v : nullptr, weights.b_v, false, packed ? packed->w_v : nullptr,
       packed && is_mlp ? &packed->mlp_v : nullptr},
  };
  // A window mapper reads each sigma block at `window` token offsets (offset-major blocks).
  const int64_t window = view.window;
  const int64_t max_inputs = window *
      static_cast<int64_t>(std::max(layer.sigma_k.size(), layer.sigma_v.size())) * source_width;
  const int64_t max_hidden = is_mlp ? std::max(weights.mlp_k.hidden, weights.mlp_v.hidden) : 0;

  // Tokens [t0, t0 + rows) through gather -> GEMM -> epilogue, for K then V, on one thread
  // with its own workspace.
  const auto run_piece = [&](int64_t t0, int64_t rows, Workspace* ws) -> absl::Status {
    const Rope& strip = prepared->source_rope_;
    const Rope& apply = prepared->target_rope_;
    const int strip_half = strip.rotary_dim() / 2;
    const int apply_half = apply.rotary_dim() / 2;
    // oneDNN path: GEMM rows rounded up, the padding rows of x zero (their outputs unused).
    const int64_t gemm_rows = onednn ? RoundUp(rows, kRowQuantum) : rows;
    float* x = onednn ? nullptr : ws->x.Get(rows * max_inputs);
    uint16_t* x16 = onednn ? ws->x16.Get(gemm_rows * max_inputs) : nullptr;
    float* block = onednn ? ws->block.Get(source_width) : nullptr;
    float* y = ws->y.Get(gemm_rows * target_width);
    float* h1 = is_mlp && !onednn ? ws->h1.Get(rows * max_hidden) : nullptr;
    float* h2 = is_mlp && !onednn ? ws->h2.Get(rows * max_hidden) : nullptr;
    uint16_t* h1_16 = is_mlp && onednn ? ws->h1_16.Get(gemm_rows * max_hidden) : nullptr;
    uint16_t* h2_16 = is_mlp && onednn ? ws->h2_16.Get(gemm_rows * max_hidden) : nullptr;
    float* y_head = is_mlp && onednn ? ws->y_head.Get(gemm_rows * dt) : nullptr;
    // Strip tables cover the window's earlier tokens too: table row r is token strip_first + r.
    const int64_t strip_first = std::max<int64_t>(0, t0 - (window - 1));
    const int64_t strip_rows = t0 + rows - strip_first;
    float* strip_cos = ws->strip_cos.Get(strip_rows * strip_half);
    float* strip_sin = ws->strip_sin.Get(strip_rows * strip_half);
    float* apply_cos = ws->apply_cos.Get(rows * apply_half);
    float* apply_sin = ws->apply_sin.Get(rows * apply_half);
    // Both models' rotations for these positions, once per piece.
    RopeTablesFor(strip, positions, strip_first, strip_rows, strip_cos, strip_sin);
    RopeTablesFor(apply, positions, t0, rows, apply_cos, apply_sin);

    for (const Kind& kind : kinds) {
      const int64_t sigma_size = static_cast<int64_t>(kind.sigma->size());
      const int64_t blocks = window * sigma_size;
      const int64_t inputs = blocks * source_width;

      // Gather: row i = token t0 + i, columns [offset][sigma block][head][dim], block (o, b)
      // from token t0 + i - o (zero before the request's first token), source RoPE stripped at
      // that token's position. oneDNN path: the same in fp32 one block at a time, then rounded
      // to bf16 (a bf16 value block without RoPE is copied as is).
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t t = t0 + i - b / sigma_size;
          if (t < 0) {
            if (onednn) {
              std::memset(x16 + i * inputs + b * source_width, 0, source_width * sizeof(uint16_t));
            } else {
              std::memset(x + i * inputs + b * source_width, 0, source_width * sizeof(float));
            }
            continue;
          }
          const int64_t strip_row = t - strip_first;
          const char* base =
              static_cast<const char*>((*kind.source)[(*kind.sigma)[b % sigma_size]]);
          if (onednn && !kind.rope && source.dtype == DType::kBF16) {
            uint16_t* out16 = x16 + i * inputs + b * source_width;
            if (source.layout == Layout::kNHD) {
              std::memcpy(out16, base + t * source_width * 2, source_width * 2);
            } else {
              for (int64_t h = 0; h < ns; ++h) {
                std::memcpy(out16 + h * ds, base + (h * num_tokens + t) * ds * 2, ds * 2);
              }
            }
            continue;
          }
          float* out = onednn ? block : x + i * inputs + b * source_width;
          if (source.layout == Layout::kNHD) {
            ToFloat(source.dtype, base + t * source_width * source_element, out, source_width);
          } else {
            for (int64_t h = 0; h < ns; ++h) {
              ToFloat(source.dtype, base + (h * num_tokens + t) * ds * source_element,
                      out + h * ds, ds);
            }
          }
          if (kind.rope) {
            for (int64_t h = 0; h < ns; ++h) {
              strip.StripHead(strip_cos + strip_row * strip_half,
                              strip_sin + strip_row * strip_half, out + h * ds);
            }
          }
          if (onednn) {
            FromFloat(DType::kBF16, out, x16 + i * inputs + b * source_width, source_width);
          }
        }
      }

      // oneDNN path, values into a bf16 [tokens, heads, dim] target: the last matmul writes
      // the target rows itself (bias fused, rounded to nearest even), so this kind skips the
      // fp32 round trip and the epilogue. A short last piece (padding rows) goes through y.
      char* direct = nullptr;
      if (onednn && !kind.rope && target->dtype == DType::kBF16 &&
          target->layout == Layout::kNHD && gemm_rows == rows &&
          (kind.mlp16 == nullptr || kind.mlp16->heads == 1)) {
        direct = static_cast<char*>(kind.target) + t0 * target_width * sizeof(uint16_t);
      }

      // The map in content space: one GEMM for ridge, the GEMM chain for an MLP. Everything
      // around it (gather, RoPE strip, bias, target RoPE, conversion) is shared.
      if (onednn) {
        if (gemm_rows > rows) {
          std::memset(x16 + rows * inputs, 0, (gemm_rows - rows) * inputs * sizeof(uint16_t));
        }
        if (kind.mlp16 != nullptr) {
          // relu(relu(x A1 + c1) A2 + c2) A3 per head: bias + ReLU fused into the hidden
          // matmuls, whose outputs are bf16 (the next matmul's input).
          const Bf16Mlp& mlp = *kind.mlp16;
          const int64_t hidden = mlp.hidden;
          const int64_t out = target_width / mlp.heads;
          for (int64_t h = 0; h < mlp.heads; ++h) {
            if (absl::Status s = Bf16Matmul(gemm_rows, x16, inputs, *mlp.a1[h],
                                            mlp.c1 + h * hidden, true, true, h1_16, hidden);
                !s.ok()) {
              return s;
            }
            if (absl::Status s = Bf16Matmul(gemm_rows, h1_16, hidden, *mlp.a2[h],
                                            mlp.c2 + h * hidden, true, true, h2_16, hidden);
                !s.ok()) {
              return s;
            }
            // oneDNN 2.6's brgemm matmul wants a dense dst (a strided one falls to a far
            // slower gemm): per_head chains write their d_t columns through y_head.
            const bool dense = mlp.heads == 1;
            void* dst = direct != nullptr ? static_cast<void*>(direct)
                        : dense           ? static_cast<void*>(y)
                                          : static_cast<void*>(y_head);
            if (absl::Status s = Bf16Matmul(gemm_rows, h2_16, hidden, *mlp.a3[h],
                                            kind.b ? kind.b + h * out : nullptr, false,
                                            direct != nullptr, dst, out);
                !s.ok()) {
              return s;
            }
            if (!dense) {
              for (int64_t i = 0; i < rows; ++i) {
                std::memcpy(y + i * target_width + h * out, y_head + i * out,
                            out * sizeof(float));
              }
            }
          }
        } else if (absl::Status s = Bf16Matmul(
                       gemm_rows, x16, inputs, *kind.w16, kind.b, false, direct != nullptr,
                       direct != nullptr ? static_cast<void*>(direct) : static_cast<void*>(y),
                       target_width);
                   !s.ok()) {
          return s;
        }
        if (direct != nullptr) continue;
      } else if (kind.mlp != nullptr) {
        MlpForward(*kind.mlp, x, rows, inputs, target_width, h1, h2, y);
      } else {
        Sgemm(rows, target_width, inputs, x, inputs, kind.w, target_width, y, target_width);
      }

      // Epilogue: bias (the oneDNN path adds it in the matmul), target RoPE, conversion,
      // scatter into the target layout.
      char* base = static_cast<char*>(kind.target);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = t0 + i;
        float* row = y + i * target_width;
        if (kind.b && !onednn) {
          for (int64_t c = 0; c < target_width; ++c) row[c] += kind.b[c];
        }
        if (kind.rope) {
          for (int64_t h = 0; h < nt; ++h) {
            apply.ApplyHead(apply_cos + i * apply_half, apply_sin + i * apply_half, row + h * dt);
          }
        }
        if (target->layout == Layout::kNHD) {
          FromFloat(target->dtype, row, base + t * target_width * target_element, target_width);
        } else {
          for (int64_t h = 0; h < nt; ++h) {
            FromFloat(target->dtype, row + h * dt,
                      base + (h * num_tokens + t) * dt * target_element, dt);
          }
        }
      }
    }
    return absl::OkStatus();
  };

  const int64_t min_pieces = (num_tokens + chunk - 1) / chunk;
  if (!onednn && openblas_get_num_threads() > 1) {
    // Someone in this process re-enabled OpenBLAS threading after the constructor: running
    // pieces on the pool too would oversubscribe the cores, so let BLAS own the parallelism.
    Workspace ws;
    for (int64_t piece = 0; piece < min_pieces; ++piece) {
      const int64_t t0 = num_tokens * piece / min_pieces;
      if (absl::Status s = run_piece(t0, num_tokens * (piece + 1) / min_pieces - t0, &ws);
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
  // Token-parallel: each thread runs whole pieces (its own gather, single-threaded GEMM and
  // epilogue), so no phase waits on another and no BLAS thread spins while the gather runs.
  // Measured on 2 cores (docs/BENCHMARKS.md): 0.66-0.78 of the sgemm rate with OpenBLAS
  // threads and a pooled gather/epilogue, 0.90-0.95 this way. Pieces are a multiple of the
  // thread count where the tokens allow, and never longer than `chunk`.
  const int threads = pool_->num_threads();
  int64_t pieces = std::max(
      min_pieces, std::min<int64_t>((min_pieces + threads - 1) / threads * threads,
                                    num_tokens / kMinTokensPerThread));
  // oneDNN path: equal pieces of a multiple of 16 rows (the last one shorter), so the matmul
  // shapes (and cached primitives) stay few.
  int64_t piece_rows = 0;
  if (onednn) {
    piece_rows = std::min(RoundUp((num_tokens + pieces - 1) / pieces, kRowQuantum),
                          RoundUp(chunk, kRowQuantum));
    pieces = (num_tokens + piece_rows - 1) / piece_rows;
  }
  Mutex error_mu;
  absl::Status error;
  pool_->ParallelFor(pieces, 1, [&](int64_t begin, int64_t end) {
    // oneDNN runs single-threaded inside each piece (see onednn_matmul.h).
    std::unique_ptr<ScopedOmpThreads> one_omp_thread;
    if (onednn) one_omp_thread = std::make_unique<ScopedOmpThreads>(1);
    Workspace ws;
    for (int64_t piece = begin; piece < end; ++piece) {
      int64_t t0, rows;
      if (onednn) {
        t0 = piece * piece_rows;
        rows = std::min(piece_rows, num_tokens - t0);
      } else {
        t0 = num_tokens * piece / pieces;
        rows = num_tokens * (piece + 1) / pieces - t0;
      }
      if (absl::Status s = run_piece(t0, rows, &ws); !s.ok()) {
        MutexLock lock(&error_mu);
        if (error.ok()) error = s;
        return;
      }
    }
  });
  return error;
}

std::unique_ptr<Backend> NewCpuBackend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace kvt
