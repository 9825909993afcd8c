// The one translation pipeline of SPEC 3 that every backend executes: built once per prepared
// mapper by backend-neutral code, it says per target layer and K|V what to gather, strip
// (source RoPE), multiply, add (bias), activate (MLP ReLU), rotate (target RoPE) and convert;
// per call, the token pieces each executor step covers.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/mapper_view.h"
#include "kernels/rope.h"

namespace kvt {

enum class KvKind : int { kKey = 0, kValue = 1 };

// One GEMM of the map in content space, per chain: out = in * matrix (+ bias) (then ReLU).
// `index` names the matrix and bias in the executor's copy of the weights: 0 = ridge W and b or
// MLP A1 and c1, 1 = A2 and c2, 2 = A3 and c3.
struct GemmStage {
  int index = 0;
  int64_t in_width = 0;   // input columns (stage 0: the gathered width, read by every chain)
  int64_t out_width = 0;  // output columns of one chain
  bool bias = false;      // the mapper stores this bias (only ridge's b may be absent)
  bool activate = false;  // ReLU after the bias: an MLP's hidden layers
};

// K or V of one target layer, stage by stage. Convert, the last stage, is the call's: the
// target cache's dtype and layout.
struct KindPlan {
  KvKind kind = KvKind::kKey;
  // Gather: a token's row is `window` token offsets of |sigma| blocks, offset-major; block
  // (o, b) is source layer sigma[b] at token t - o, zero before the request's first token.
  std::vector<int> sigma;
  int64_t blocks = 0;       // window * |sigma|
  int64_t input_width = 0;  // blocks * n_s d_s
  bool strip = false;       // source RoPE removed from every block at its own token (keys)
  // Multiply, add, activate: one stage (ridge) or three (MLP). `heads` chains run side by
  // side (an MLP's per_head granularity); with w the last stage's out_width, chain h writes
  // output columns [h w, (h + 1) w).
  int heads = 1;
  std::vector<GemmStage> map;
  bool rotate = false;  // target RoPE applied at the token's own position (keys)
  // Head-local ridge: chain h reads only heads [first, first + count) of every block (the
  // mapper view's HeadLocalSources), so executors gather head-major: chain h's rows of
  // map[0].in_width = blocks * count * d_s columns, chain after chain. Empty: every chain reads
  // the whole row of input_width columns.
  std::vector<HeadSources> chain_sources;

  const GemmStage& last() const { return map.back(); }
  bool head_local() const { return !chain_sources.empty(); }
  // Gathered floats per token: input_width, or heads * map[0].in_width when head-local (more
  // than input_width when n_t > n_s, since target heads then share source heads).
  int64_t gathered_width() const { return head_local() ? heads * map[0].in_width : input_width; }
};

struct LayerPlan {
  std::array<KindPlan, 2> kinds;  // indexed by KvKind
};

class TranslationPlan {
 public:
  // Checks the mapper (CheckMapperView), sets up both models' RoPE and every layer's stages.
  static absl::StatusOr<TranslationPlan> Build(const MapperView& mapper);

  const MapperView& mapper() const { return mapper_; }
  const TranslationRope& rope() const { return rope_; }
  const LayerPlan& layer(int target_layer) const { return layers_[target_layer]; }
  MapKind map_kind() const { return mapper_.kind; }
  int window() const { return mapper_.window; }
  int64_t source_width() const { return source_width_; }  // n_s d_s
  int64_t target_width() const { return target_width_; }  // n_t d_t
  // Over every layer and kind: the widest gathered row (KindPlan::gathered_width) and the widest MLP hidden layer (0 for
  // ridge), which size an executor's per-call buffers.
  int64_t max_input_width() const { return max_input_width_; }
  int64_t max_hidden() const { return max_hidden_; }

 private:
  MapperView mapper_;
  TranslationRope rope_;
  std::vector<LayerPlan> layers_;
  int64_t source_width_ = 0, target_width_ = 0;
  int64_t max_input_width_ = 0, max_hidden_ = 0;
};

// The stored weights stage `index` of (target_layer, kind) reads: its matrix (an MLP's chains
// stacked along rows, as in MlpView) and its bias (data null when the mapper has none).
const WeightView& StageMatrix(const MapperView& mapper, int target_layer, KvKind kind, int index);
const WeightView& StageBias(const MapperView& mapper, int target_layer, KvKind kind, int index);

// A run of tokens one executor step handles: rows [begin, begin + rows), reading source tokens
// [read_begin, begin + rows) (a window mapper's w - 1 earlier tokens, clipped at 0).
struct TokenPiece {
  int64_t begin = 0;
  int64_t rows = 0;
  int64_t read_begin = 0;
  int64_t read_rows() const { return begin + rows - read_begin; }
};

TokenPiece MakeTokenPiece(int64_t begin, int64_t rows, int window);

// `count` pieces of near-equal length, piece i starting at num_tokens * i / count.
std::vector<TokenPiece> EvenPieces(int64_t num_tokens, int64_t count, int window);

// Pieces of `rows` tokens, the last one shorter.
std::vector<TokenPiece> FixedPieces(int64_t num_tokens, int64_t rows, int window);

}  // namespace kvt
