#include "kernels/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"
#include "kernels/rope.h"

namespace kvt {
namespace {

// Tokens per piece below which another thread costs more than it saves.
constexpr int64_t kMinTokensPerThread = 16;

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
class Scratch {
 public:
  float* Get(int64_t count) {
    if (count > size_) {
      data_.reset(new float[count]);
      size_ = count;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<float[]> data_;
  int64_t size_ = 0;
};

// One thread's working memory for a piece of tokens.
struct Workspace {
  Scratch x;                     // gathered, stripped inputs: rows x (|sigma| n_s d_s)
  Scratch y;                     // GEMM output: rows x (n_t d_t)
  Scratch h1, h2;                // MLP hidden activations: rows x H each
  Scratch strip_cos, strip_sin;  // source RoPE per row
  Scratch apply_cos, apply_sin;  // target RoPE per row
};

class CpuPreparedMapper : public PreparedMapper {
 public:
  const MapperView& view() const override { return view_; }
  uint64_t bytes() const override { return bytes_; }

  MapperView view_;
  Rope source_rope_;
  Rope target_rope_;
  std::vector<Fp32Layer> layers_;
  std::vector<std::unique_ptr<float[]>> owned_;
  uint64_t bytes_ = 0;
};

}  // namespace

CpuBackend::CpuBackend(const CpuBackendOptions& options)
    : options_(options), pool_(std::make_unique<ThreadPool>(options.num_threads)) {
  if (options_.token_chunk <= 0) options_.token_chunk = CpuBackendOptions().token_chunk;
  // Parallelism comes from the pool running independent token pieces, each calling sgemm;
  // OpenBLAS threads on top would oversubscribe the cores and spin between calls.
  openblas_set_num_threads(1);
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
  };
  const bool is_mlp = view.kind == MapKind::kMlp;
  const Kind kinds[2] = {
      {&layer.sigma_k, &source.k, target->k[target_layer], weights.w_k,
       is_mlp ? &weights.mlp_k : nullptr, weights.b_k, true},
      {&layer.sigma_v, &source.v, target->v[target_layer], weights.w_v,
       is_mlp ? &weights.mlp_v : nullptr, weights.b_v, false},
  };
  const int64_t max_inputs =
      static_cast<int64_t>(std::max(layer.sigma_k.size(), layer.sigma_v.size())) * source_width;
  const int64_t max_hidden = is_mlp ? std::max(weights.mlp_k.hidden, weights.mlp_v.hidden) : 0;

  // Tokens [t0, t0 + rows) through gather -> sgemm -> epilogue, for K then V, on one thread
  // with its own workspace.
  const auto run_piece = [&](int64_t t0, int64_t rows, Workspace* ws) {
    const Rope& strip = prepared->source_rope_;
    const Rope& apply = prepared->target_rope_;
    const int strip_half = strip.rotary_dim() / 2;
    const int apply_half = apply.rotary_dim() / 2;
    float* x = ws->x.Get(rows * max_inputs);
    float* y = ws->y.Get(rows * target_width);
    float* h1 = is_mlp ? ws->h1.Get(rows * max_hidden) : nullptr;
    float* h2 = is_mlp ? ws->h2.Get(rows * max_hidden) : nullptr;
    float* strip_cos = ws->strip_cos.Get(rows * strip_half);
    float* strip_sin = ws->strip_sin.Get(rows * strip_half);
    float* apply_cos = ws->apply_cos.Get(rows * apply_half);
    float* apply_sin = ws->apply_sin.Get(rows * apply_half);
    // Both models' rotations for these positions, once per piece.
    RopeTablesFor(strip, positions, t0, rows, strip_cos, strip_sin);
    RopeTablesFor(apply, positions, t0, rows, apply_cos, apply_sin);

    for (const Kind& kind : kinds) {
      const int64_t inputs = static_cast<int64_t>(kind.sigma->size()) * source_width;

      // Gather: row i = token t0 + i, columns [sigma block][head][dim], source RoPE stripped.
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = t0 + i;
        float* row = x + i * inputs;
        for (size_t block = 0; block < kind.sigma->size(); ++block) {
          const char* base = static_cast<const char*>((*kind.source)[(*kind.sigma)[block]]);
          float* out = row + block * source_width;
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
              strip.StripHead(strip_cos + i * strip_half, strip_sin + i * strip_half,
                              out + h * ds);
            }
          }
        }
      }

      // The map in content space: one sgemm for ridge, the GEMM chain for an MLP. Everything
      // around it (gather, RoPE strip, bias, target RoPE, conversion) is shared.
      if (kind.mlp != nullptr) {
        MlpForward(*kind.mlp, x, rows, inputs, target_width, h1, h2, y);
      } else {
        Sgemm(rows, target_width, inputs, x, inputs, kind.w, target_width, y, target_width);
      }

      // Epilogue: bias, target RoPE, conversion, scatter into the target layout.
      char* base = static_cast<char*>(kind.target);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = t0 + i;
        float* row = y + i * target_width;
        if (kind.b) {
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
  };

  const int64_t min_pieces = (num_tokens + chunk - 1) / chunk;
  if (openblas_get_num_threads() > 1) {
    // Someone in this process re-enabled OpenBLAS threading after the constructor: running
    // pieces on the pool too would oversubscribe the cores, so let BLAS own the parallelism.
    Workspace ws;
    for (int64_t piece = 0; piece < min_pieces; ++piece) {
      const int64_t t0 = num_tokens * piece / min_pieces;
      run_piece(t0, num_tokens * (piece + 1) / min_pieces - t0, &ws);
    }
    return absl::OkStatus();
  }
  // Token-parallel: each thread runs whole pieces (its own gather, single-threaded sgemm and
  // epilogue), so no phase waits on another and no BLAS thread spins while the gather runs.
  // Measured on 2 cores (docs/BENCHMARKS.md): 0.66-0.78 of the sgemm rate with OpenBLAS
  // threads and a pooled gather/epilogue, 0.90-0.95 this way. Pieces are a multiple of the
  // thread count where the tokens allow, and never longer than `chunk`.
  const int threads = pool_->num_threads();
  const int64_t pieces = std::max(
      min_pieces, std::min<int64_t>((min_pieces + threads - 1) / threads * threads,
                                    num_tokens / kMinTokensPerThread));
  pool_->ParallelFor(pieces, 1, [&](int64_t begin, int64_t end) {
    Workspace ws;
    for (int64_t piece = begin; piece < end; ++piece) {
      const int64_t t0 = num_tokens * piece / pieces;
      run_piece(t0, num_tokens * (piece + 1) / pieces - t0, &ws);
    }
  });
  return absl::OkStatus();
}

std::unique_ptr<Backend> NewCpuBackend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

}  // namespace kvt
