#include "kernels/translation_plan.h"

#include <algorithm>
#include <utility>

#include "kernels/backend.h"

namespace kvt {
namespace {

// Ridge: x W + b in one stage.
std::vector<GemmStage> RidgeStages(const WeightView& b, int64_t inputs, int64_t target_width) {
  return {GemmStage{0, inputs, target_width, b.data != nullptr, false}};
}

// MLP: relu(relu(x A1 + c1) A2 + c2) A3 + c3, each chain writing target_width / heads columns.
std::vector<GemmStage> MlpStages(const MlpView& mlp, int64_t inputs, int64_t target_width) {
  const int64_t hidden = mlp.hidden;
  return {GemmStage{0, inputs, hidden, true, true}, GemmStage{1, hidden, hidden, true, true},
          GemmStage{2, hidden, target_width / mlp.heads, mlp.c3.data != nullptr, false}};
}

KindPlan PlanKind(const MapperView& mapper, const LayerMapView& layer, KvKind kind,
                  int64_t source_width, int64_t target_width) {
  const bool key = kind == KvKind::kKey;
  KindPlan plan;
  plan.kind = kind;
  plan.sigma = key ? layer.sigma_k : layer.sigma_v;
  plan.blocks = static_cast<int64_t>(mapper.window) * static_cast<int64_t>(plan.sigma.size());
  plan.input_width = plan.blocks * source_width;
  // Values carry no position (SPEC 2): only keys leave and re-enter RoPE.
  plan.strip = key;
  plan.rotate = key;
  if (mapper.kind == MapKind::kMlp) {
    const MlpView& mlp = key ? layer.mlp_k : layer.mlp_v;
    plan.heads = mlp.heads;
    plan.map = MlpStages(mlp, plan.input_width, target_width);
  } else if (mapper.head_local) {
    // n_t chains, each mapping its own source heads to its d_t columns.
    plan.heads = mapper.target.num_kv_heads;
    for (int h = 0; h < plan.heads; ++h) {
      plan.chain_sources.push_back(HeadLocalSources(mapper.source, mapper.target, h));
    }
    plan.map = RidgeStages(key ? layer.b_k : layer.b_v,
                           HeadLocalInputWidth(mapper.source, mapper.target, mapper.window,
                                               plan.sigma.size()),
                           mapper.target.head_dim);
  } else {
    plan.map = RidgeStages(key ? layer.b_k : layer.b_v, plan.input_width, target_width);
  }
  return plan;
}

}  // namespace

absl::StatusOr<TranslationPlan> TranslationPlan::Build(const MapperView& mapper) {
  if (absl::Status s = CheckMapperView(mapper); !s.ok()) return s;
  absl::StatusOr<TranslationRope> rope =
      TranslationRope::Create(mapper.source.rope, mapper.source.head_dim, mapper.target.rope,
                              mapper.target.head_dim);
  if (!rope.ok()) return rope.status();
  TranslationPlan plan;
  plan.mapper_ = mapper;
  plan.rope_ = *std::move(rope);
  plan.source_width_ = static_cast<int64_t>(mapper.source.num_kv_heads) * mapper.source.head_dim;
  plan.target_width_ = static_cast<int64_t>(mapper.target.num_kv_heads) * mapper.target.head_dim;
  plan.layers_.reserve(mapper.layers.size());
  for (const LayerMapView& layer : mapper.layers) {
    LayerPlan& out = plan.layers_.emplace_back();
    for (KvKind kind : {KvKind::kKey, KvKind::kValue}) {
      KindPlan& k = out.kinds[static_cast<int>(kind)];
      k = PlanKind(mapper, layer, kind, plan.source_width_, plan.target_width_);
      plan.max_input_width_ = std::max(plan.max_input_width_, k.gathered_width());
      if (mapper.kind == MapKind::kMlp) {
        plan.max_hidden_ = std::max(plan.max_hidden_, k.map[0].out_width);
      }
    }
  }
  return plan;
}

const WeightView& StageMatrix(const MapperView& mapper, int target_layer, KvKind kind,
                             int index) {
  const LayerMapView& layer = mapper.layers[target_layer];
  const bool key = kind == KvKind::kKey;
  if (mapper.kind != MapKind::kMlp) return key ? layer.w_k : layer.w_v;
  const MlpView& mlp = key ? layer.mlp_k : layer.mlp_v;
  return index == 0 ? mlp.a1 : index == 1 ? mlp.a2 : mlp.a3;
}

const WeightView& StageBias(const MapperView& mapper, int target_layer, KvKind kind, int index) {
  const LayerMapView& layer = mapper.layers[target_layer];
  const bool key = kind == KvKind::kKey;
  if (mapper.kind != MapKind::kMlp) return key ? layer.b_k : layer.b_v;
  const MlpView& mlp = key ? layer.mlp_k : layer.mlp_v;
  return index == 0 ? mlp.c1 : index == 1 ? mlp.c2 : mlp.c3;
}

TokenPiece MakeTokenPiece(int64_t begin, int64_t rows, int window) {
  TokenPiece piece;
  piece.begin = begin;
  piece.rows = rows;
  piece.read_begin = std::max<int64_t>(0, begin - (window - 1));
  return piece;
}

std::vector<TokenPiece> EvenPieces(int64_t num_tokens, int64_t count, int window) {
  std::vector<TokenPiece> pieces;
  pieces.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t begin = num_tokens * i / count;
    pieces.push_back(MakeTokenPiece(begin, num_tokens * (i + 1) / count - begin, window));
  }
  return pieces;
}

std::vector<TokenPiece> FixedPieces(int64_t num_tokens, int64_t rows, int window) {
  std::vector<TokenPiece> pieces;
  if (rows <= 0) return pieces;
  pieces.reserve((num_tokens + rows - 1) / rows);
  for (int64_t begin = 0; begin < num_tokens; begin += rows) {
    pieces.push_back(MakeTokenPiece(begin, std::min(rows, num_tokens - begin), window));
  }
  return pieces;
}

}  // namespace kvt
