#include "kernels/translation_plan.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/testing/reference.h"

namespace kvt {
namespace {

using testing::MakeRandomMapper;
using testing::RandomMapper;
using testing::RandomMapperSpec;

TEST(TranslationPlanTest, RidgeKeysStripAndRotateValuesDoNot) {
  RandomMapperSpec spec;
  spec.k = 2;
  spec.k_v = 1;
  spec.source_heads = 2;
  spec.source_head_dim = 8;
  spec.target_heads = 3;
  spec.target_head_dim = 4;
  const RandomMapper mapper = MakeRandomMapper(spec, 1);
  absl::StatusOr<TranslationPlan> plan = TranslationPlan::Build(mapper.view);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->source_width(), 16);
  EXPECT_EQ(plan->target_width(), 12);
  EXPECT_EQ(plan->max_input_width(), 32);
  EXPECT_EQ(plan->max_hidden(), 0);
  for (int l = 0; l < spec.target_layers; ++l) {
    const KindPlan& k = plan->layer(l).kinds[0];
    const KindPlan& v = plan->layer(l).kinds[1];
    EXPECT_EQ(k.kind, KvKind::kKey);
    EXPECT_TRUE(k.strip);
    EXPECT_TRUE(k.rotate);
    EXPECT_EQ(k.sigma, mapper.view.layers[l].sigma_k);
    EXPECT_EQ(k.input_width, 32);
    EXPECT_FALSE(v.strip);
    EXPECT_FALSE(v.rotate);
    EXPECT_EQ(v.sigma, mapper.view.layers[l].sigma_v);
    EXPECT_EQ(v.input_width, 16);
    ASSERT_EQ(k.map.size(), 1u);
    EXPECT_EQ(k.map[0].in_width, 32);
    EXPECT_EQ(k.map[0].out_width, 12);
    EXPECT_TRUE(k.map[0].bias);
    EXPECT_FALSE(k.map[0].activate);
    EXPECT_EQ(&StageMatrix(mapper.view, l, KvKind::kValue, 0), &mapper.view.layers[l].w_v);
    EXPECT_EQ(&StageBias(mapper.view, l, KvKind::kKey, 0), &mapper.view.layers[l].b_k);
  }
}

// Head-local ridge: n_t chains of window |sigma| g d_s -> d_t, each reading its own heads.
TEST(TranslationPlanTest, RidgePerHeadChainsReadTheirOwnHeads) {
  struct Pairing {
    int ns, nt;
    std::vector<HeadSources> sources;
  };
  const Pairing pairings[] = {{2, 2, {{0, 1}, {1, 1}}},
                              {4, 2, {{0, 2}, {2, 2}}},
                              {2, 4, {{0, 1}, {0, 1}, {1, 1}, {1, 1}}}};
  for (const Pairing& p : pairings) {
    RandomMapperSpec spec;
    spec.ridge_per_head = true;
    spec.source_heads = p.ns;
    spec.target_heads = p.nt;
    spec.source_head_dim = 8;
    spec.target_head_dim = 4;
    spec.k = 2;
    spec.k_v = 1;
    spec.window = 3;
    const RandomMapper mapper = MakeRandomMapper(spec, 7);
    absl::StatusOr<TranslationPlan> plan = TranslationPlan::Build(mapper.view);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const int g = p.ns >= p.nt ? p.ns / p.nt : 1;
    const KindPlan& k = plan->layer(0).kinds[0];
    const KindPlan& v = plan->layer(0).kinds[1];
    EXPECT_TRUE(k.head_local());
    EXPECT_EQ(k.heads, p.nt);
    EXPECT_EQ(k.input_width, 3 * 2 * p.ns * 8);
    EXPECT_EQ(k.map[0].in_width, 3 * 2 * g * 8);
    EXPECT_EQ(k.map[0].out_width, 4);
    EXPECT_EQ(v.map[0].in_width, 3 * 1 * g * 8);
    EXPECT_EQ(k.gathered_width(), p.nt * 3 * 2 * g * 8);
    EXPECT_EQ(plan->max_input_width(), std::max(k.gathered_width(), k.input_width));
    ASSERT_EQ(k.chain_sources.size(), p.sources.size());
    for (size_t h = 0; h < p.sources.size(); ++h) {
      EXPECT_EQ(k.chain_sources[h].first, p.sources[h].first) << p.ns << "->" << p.nt << " h" << h;
      EXPECT_EQ(k.chain_sources[h].count, p.sources[h].count) << p.ns << "->" << p.nt << " h" << h;
    }
  }
}

// Head counts neither divides, and a per_layer-shaped matrix under head_local: refused, named.
TEST(TranslationPlanTest, RidgePerHeadRefusesUnmatchedHeadsAndShapes) {
  RandomMapperSpec spec;
  spec.ridge_per_head = true;
  spec.source_heads = 3;
  spec.target_heads = 2;
  RandomMapper mapper = MakeRandomMapper(spec, 8);
  absl::StatusOr<TranslationPlan> plan = TranslationPlan::Build(mapper.view);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("source.num_kv_heads=3"), std::string::npos);
  EXPECT_NE(plan.status().message().find("target.num_kv_heads=2"), std::string::npos);

  spec.ridge_per_head = false;
  spec.source_heads = 2;
  RandomMapper dense = MakeRandomMapper(spec, 9);
  dense.view.head_local = true;
  plan = TranslationPlan::Build(dense.view);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("layers[0].w_k"), std::string::npos) << plan.status();
  EXPECT_NE(plan.status().message().find("per_head"), std::string::npos) << plan.status();
}

TEST(TranslationPlanTest, RidgeWithoutBiasAddsNothing) {
  RandomMapperSpec spec;
  spec.with_bias = false;
  const RandomMapper mapper = MakeRandomMapper(spec, 2);
  absl::StatusOr<TranslationPlan> plan = TranslationPlan::Build(mapper.view);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->layer(0).kinds[0].last().bias);
  EXPECT_FALSE(plan->layer(1).kinds[1].last().bias);
}

TEST(TranslationPlanTest, PerHeadMlpChainsActivateHiddenStagesOnly) {
  RandomMapperSpec spec;
  spec.kind = MapKind::kMlp;
  spec.mlp_per_head = true;
  spec.mlp_hidden = 5;
  spec.target_heads = 2;
  spec.target_head_dim = 4;
  spec.window = 3;
  const RandomMapper mapper = MakeRandomMapper(spec, 3);
  absl::StatusOr<TranslationPlan> plan = TranslationPlan::Build(mapper.view);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const KindPlan& k = plan->layer(0).kinds[0];
  EXPECT_EQ(k.heads, 2);
  EXPECT_EQ(k.blocks, 3);  // window 3 x |sigma| 1
  EXPECT_EQ(k.input_width, 3 * 2 * 16);
  EXPECT_EQ(plan->max_hidden(), 5);
  ASSERT_EQ(k.map.size(), 3u);
  EXPECT_EQ(k.map[0].in_width, k.input_width);
  EXPECT_EQ(k.map[0].out_width, 5);
  EXPECT_EQ(k.map[1].in_width, 5);
  EXPECT_EQ(k.map[2].out_width, 4);  // one head's d_t
  EXPECT_TRUE(k.map[0].activate);
  EXPECT_TRUE(k.map[1].activate);
  EXPECT_FALSE(k.map[2].activate);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(k.map[s].index, s);
    EXPECT_TRUE(k.map[s].bias);
  }
  EXPECT_EQ(&StageMatrix(mapper.view, 0, KvKind::kKey, 1), &mapper.view.layers[0].mlp_k.a2);
  EXPECT_EQ(&StageBias(mapper.view, 0, KvKind::kValue, 2), &mapper.view.layers[0].mlp_v.c3);
}

TEST(TranslationPlanTest, RefusesWhatCheckMapperViewRefuses) {
  RandomMapper mapper = MakeRandomMapper(RandomMapperSpec(), 4);
  mapper.view.layers[1].sigma_k = {7};
  absl::StatusOr<TranslationPlan> plan = TranslationPlan::Build(mapper.view);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("sigma_k"), absl::string_view::npos)
      << plan.status();
}

TEST(TokenPiecesTest, EvenPiecesCoverEveryTokenOnceAndReadTheWindow) {
  const std::vector<TokenPiece> pieces = EvenPieces(10, 3, 4);
  ASSERT_EQ(pieces.size(), 3u);
  int64_t next = 0;
  for (const TokenPiece& piece : pieces) {
    EXPECT_EQ(piece.begin, next);
    EXPECT_EQ(piece.read_begin, std::max<int64_t>(0, piece.begin - 3));
    EXPECT_EQ(piece.read_rows(), piece.begin + piece.rows - piece.read_begin);
    next += piece.rows;
  }
  EXPECT_EQ(next, 10);
  EXPECT_EQ(pieces[1].begin, 3);  // 10 * 1 / 3
}

TEST(TokenPiecesTest, FixedPiecesEndShort) {
  const std::vector<TokenPiece> pieces = FixedPieces(37, 16, 1);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[2].begin, 32);
  EXPECT_EQ(pieces[2].rows, 5);
  EXPECT_EQ(pieces[2].read_begin, 32);
  EXPECT_TRUE(FixedPieces(0, 16, 1).empty());
}

TEST(TranslationRopeTest, FillMatchesRopeTablesFor) {
  RopeConfig config;
  config.rotary_dim = 8;
  absl::StatusOr<TranslationRope> rope = TranslationRope::Create(config, 8, config, 8);
  ASSERT_TRUE(rope.ok()) << rope.status();
  const uint64_t explicit_positions[] = {5, 9, 100, 7, 3000};
  for (const Positions positions : {Positions{17, nullptr}, Positions{0, explicit_positions}}) {
    const RopeTableLayout layout = rope->TableLayout(5, 3);
    std::vector<float> tables(layout.floats);
    rope->Fill(positions, 0, 5, 2, 3, tables.data());
    std::vector<float> cos(5 * 4), sin(5 * 4);
    RopeTablesFor(rope->strip(), positions, 0, 5, cos.data(), sin.data());
    EXPECT_EQ(std::vector<float>(tables.begin() + layout.strip_cos,
                                 tables.begin() + layout.strip_cos + 20), cos);
    EXPECT_EQ(std::vector<float>(tables.begin() + layout.strip_sin,
                                 tables.begin() + layout.strip_sin + 20), sin);
    RopeTablesFor(rope->apply(), positions, 2, 3, cos.data(), sin.data());
    EXPECT_EQ(std::vector<float>(tables.begin() + layout.apply_cos,
                                 tables.begin() + layout.apply_cos + 12),
              std::vector<float>(cos.begin(), cos.begin() + 12));
    EXPECT_EQ(layout.floats, layout.apply_sin + 12);
  }
}

}  // namespace
}  // namespace kvt
