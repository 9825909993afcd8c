#include "kernels/cuda/cuda_plan.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/mapper_view.h"

namespace kvt {
namespace cuda {
namespace {

using ::testing::HasSubstr;

// Qwen3 14B -> 32B, k = 8, bf16 caches and weights, everything device-resident.
StepShape Qwen14To32(int64_t tokens) {
  StepShape shape;
  shape.num_tokens = tokens;
  shape.num_layers = 64;
  shape.input_width = 8 * 8 * 128;
  shape.target_width = 8 * 128;
  shape.gemm_dtype = DType::kBF16;
  shape.rope_half_source = 64;
  shape.rope_half_target = 64;
  return shape;
}

// Recomputes what a plan's step needs from first principles: X (gemm dtype) and Y (fp32) per
// layer, kind and token, weight copies, tables and staging (a window mapper's source tables and
// staged sources also hold the window - 1 tokens before the chunk).
// MLP: the fp32 output buffer takes the widest GEMM output (hidden or target), plus the hidden
// activations in the gemm dtype, and the converted weights are A1 + A2 + A3.
int64_t StepBytes(const StepShape& s, int64_t tokens, int64_t layers) {
  const int64_t g = DTypeSize(s.gemm_dtype);
  int64_t bytes = layers * 2 * tokens *
                  (s.input_width * g + std::max(s.target_width, s.hidden_width) * 4 +
                   s.hidden_width * g);
  const int64_t weights =
      s.weight_elements > 0 ? s.weight_elements : s.input_width * s.target_width;
  if (s.convert_weights) bytes += layers * 2 * weights * 4;
  const int64_t read_tokens = tokens + s.window - 1;
  bytes += read_tokens * 2 * 4 * s.rope_half_source + tokens * 2 * 4 * s.rope_half_target;
  bytes += read_tokens * s.staged_source_bytes_per_token;
  bytes += layers * tokens * s.staged_target_bytes_per_layer_token;
  return bytes;
}

void ExpectCovers(const StepShape& shape, const StepPlan& plan) {
  EXPECT_GE(plan.chunk_tokens * plan.num_chunks, shape.num_tokens);
  EXPECT_LT(plan.chunk_tokens * (plan.num_chunks - 1), shape.num_tokens);
  EXPECT_GE(plan.layers_per_group * plan.num_groups, shape.num_layers);
  EXPECT_LT(plan.layers_per_group * (plan.num_groups - 1), shape.num_layers);
  EXPECT_EQ(plan.total_bytes(), StepBytes(shape, plan.chunk_tokens, plan.layers_per_group));
}

TEST(GemmDTypeTest, SameTypeKeptElseFp32) {
  EXPECT_EQ(GemmDType(DType::kBF16, DType::kBF16, DType::kBF16), DType::kBF16);
  EXPECT_EQ(GemmDType(DType::kFP16, DType::kFP16, DType::kFP16), DType::kFP16);
  EXPECT_EQ(GemmDType(DType::kFP32, DType::kFP32, DType::kFP32), DType::kFP32);
  EXPECT_EQ(GemmDType(DType::kFP32, DType::kBF16, DType::kFP32), DType::kFP32);
  EXPECT_EQ(GemmDType(DType::kBF16, DType::kFP32, DType::kBF16), DType::kFP32);
  EXPECT_EQ(GemmDType(DType::kFP16, DType::kBF16, DType::kFP16), DType::kFP32);
  // A more precise output than the input keeps the stripped inputs in fp32.
  EXPECT_EQ(GemmDType(DType::kBF16, DType::kBF16, DType::kFP32), DType::kFP32);
  EXPECT_EQ(GemmDType(DType::kBF16, DType::kBF16, DType::kFP16), DType::kFP32);
}

TEST(PlanStepsTest, ShortRequestTakesEveryLayerInOneStep) {
  const StepShape shape = Qwen14To32(64);
  absl::StatusOr<StepPlan> plan = PlanSteps(shape, 0, int64_t{2} << 30);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->chunk_tokens, 64);
  EXPECT_EQ(plan->num_chunks, 1);
  EXPECT_EQ(plan->layers_per_group, 64);
  EXPECT_EQ(plan->num_groups, 1);
  ExpectCovers(shape, *plan);
}

TEST(PlanStepsTest, LongRequestKeepsTokensWholeAndSplitsLayers) {
  // 32K tokens of one layer (K and V) need 1.3 GB: one chunk, one layer per step, so the
  // weights are read once.
  const StepShape shape = Qwen14To32(32768);
  absl::StatusOr<StepPlan> plan = PlanSteps(shape, 0, int64_t{2} << 30);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_chunks, 1);
  EXPECT_EQ(plan->chunk_tokens, 32768);
  EXPECT_EQ(plan->layers_per_group, 1);
  EXPECT_EQ(plan->num_groups, 64);
  EXPECT_LE(plan->total_bytes(), int64_t{2} << 30);
  ExpectCovers(shape, *plan);
}

TEST(PlanStepsTest, EveryPlanFitsTheBudgetAndCoversTheWork) {
  for (int64_t tokens : {1, 7, 63, 64, 65, 1000, 1024, 8192, 32768, 131072}) {
    for (int64_t budget : {int64_t{64} << 20, int64_t{512} << 20, int64_t{2} << 30}) {
      for (int64_t token_chunk : {0, 100, 4096}) {
        for (bool convert : {false, true}) {
          StepShape shape = Qwen14To32(tokens);
          shape.convert_weights = convert;
          shape.gemm_dtype = convert ? DType::kFP32 : DType::kBF16;
          shape.staged_source_bytes_per_token = convert ? 16 * 1024 * 2 : 0;
          shape.staged_target_bytes_per_layer_token = convert ? 2 * 1024 * 4 : 0;
          SCOPED_TRACE(testing::Message() << "T=" << tokens << " budget=" << budget
                                          << " chunk=" << token_chunk << " convert=" << convert);
          absl::StatusOr<StepPlan> plan = PlanSteps(shape, token_chunk, budget);
          if (StepBytes(shape, 1, 1) > budget) {  // 64 MiB of fp32 weights alone
            EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
            continue;
          }
          ASSERT_TRUE(plan.ok()) << plan.status();
          ExpectCovers(shape, *plan);
          EXPECT_LE(plan->total_bytes(), budget);
          if (token_chunk > 0) {
            EXPECT_LE(plan->chunk_tokens, token_chunk);
          }
          EXPECT_GE(plan->chunk_tokens, 1);
          EXPECT_GE(plan->layers_per_group, 1);
        }
      }
    }
  }
}

TEST(PlanStepsTest, ChunksAreBalanced) {
  // 1000 tokens in chunks of at most 300: four chunks of 250, not 300+300+300+100.
  StepShape shape = Qwen14To32(1000);
  absl::StatusOr<StepPlan> plan = PlanSteps(shape, 300, int64_t{2} << 30);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_chunks, 4);
  EXPECT_EQ(plan->chunk_tokens, 250);
}

TEST(PlanStepsTest, ZeroTokensIsAnEmptyPlan) {
  absl::StatusOr<StepPlan> plan = PlanSteps(Qwen14To32(0), 0, 1 << 20);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_chunks, 0);
  EXPECT_EQ(plan->total_bytes(), 0);
}

TEST(PlanStepsTest, BudgetBelowOneTokenIsResourceExhausted) {
  StepShape shape = Qwen14To32(10);
  shape.convert_weights = true;  // 64 MiB of fp32 weights per layer
  shape.gemm_dtype = DType::kFP32;
  absl::StatusOr<StepPlan> plan = PlanSteps(shape, 0, int64_t{32} << 20);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(plan.status().message(), HasSubstr("workspace_bytes"));
}

TEST(PlanStepsTest, BadShapeIsInvalidArgument) {
  StepShape shape = Qwen14To32(10);
  shape.num_layers = 0;
  absl::StatusOr<StepPlan> plan = PlanSteps(shape, 0, 1 << 30);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("num_layers=0"));
}

// A window mapper's input rows are `window` times wider, and every chunk also strips (and, for
// host-memory sources, stages) the window - 1 source tokens before it.
TEST(PlanStepsTest, WindowCountsTheTokensBeforeTheChunk) {
  for (int window : {1, 2, 4, 9}) {
    for (int64_t tokens : {1, 7, 65, 1000, 32768}) {
      for (int64_t budget : {int64_t{64} << 20, int64_t{2} << 30}) {
        for (int64_t token_chunk : {0, 3, 100}) {
          StepShape shape = Qwen14To32(tokens);
          shape.window = window;
          shape.input_width *= window;
          shape.staged_source_bytes_per_token = 3 * 1024 * 2;
          SCOPED_TRACE(testing::Message() << "window=" << window << " T=" << tokens
                                          << " budget=" << budget << " chunk=" << token_chunk);
          absl::StatusOr<StepPlan> plan = PlanSteps(shape, token_chunk, budget);
          ASSERT_TRUE(plan.ok()) << plan.status();
          ExpectCovers(shape, *plan);
          EXPECT_LE(plan->total_bytes(), budget);
          const int64_t t = plan->chunk_tokens, l = plan->layers_per_group;
          EXPECT_EQ(plan->x_bytes, l * 2 * t * 8 * 8 * 128 * window * 2);
          EXPECT_EQ(plan->table_bytes, (t + window - 1) * 2 * 4 * 64 + t * 2 * 4 * 64);
          EXPECT_EQ(plan->staged_source_bytes, (t + window - 1) * 3 * 1024 * 2);
        }
      }
    }
  }
  // A budget that holds one token but not the window's earlier tokens as well.
  StepShape shape = Qwen14To32(10);
  shape.window = 4;
  shape.staged_source_bytes_per_token = 1 << 20;
  const int64_t one_token = StepBytes(shape, 1, 1) - 3 * (2 * 4 * 64 + (1 << 20));
  absl::StatusOr<StepPlan> plan = PlanSteps(shape, 0, one_token);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
  plan = PlanSteps(shape, 0, StepBytes(shape, 1, 1));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->chunk_tokens, 1);
  EXPECT_EQ(plan->total_bytes(), StepBytes(shape, 1, 1));

  shape.window = 0;
  plan = PlanSteps(shape, 0, int64_t{1} << 30);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("window=0"));
}

// Qwen3 14B -> 32B as an MLP mapper of hidden width 1024 (the format's default).
StepShape Qwen14To32Mlp(int64_t tokens, bool per_head) {
  StepShape shape = Qwen14To32(tokens);
  const int64_t heads = per_head ? 8 : 1, hidden = 1024, in = shape.input_width;
  shape.hidden_width = heads * hidden;
  shape.weight_elements = in * heads * hidden + heads * hidden * hidden +
                          heads * hidden * (shape.target_width / heads);
  return shape;
}

TEST(PlanStepsTest, MlpCountsHiddenActivationsAndChunksTokens) {
  for (bool per_head : {false, true}) {
    for (int64_t tokens : {1, 64, 1000, 8192, 32768}) {
      for (int64_t budget : {int64_t{256} << 20, int64_t{2} << 30}) {
        for (bool convert : {false, true}) {
          StepShape shape = Qwen14To32Mlp(tokens, per_head);
          shape.convert_weights = convert;
          shape.gemm_dtype = convert ? DType::kFP32 : DType::kBF16;
          SCOPED_TRACE(testing::Message() << "per_head=" << per_head << " T=" << tokens
                                          << " budget=" << budget << " convert=" << convert);
          absl::StatusOr<StepPlan> plan = PlanSteps(shape, 0, budget);
          if (StepBytes(shape, 1, 1) > budget) {
            EXPECT_EQ(plan.status().code(), absl::StatusCode::kResourceExhausted);
            continue;
          }
          ASSERT_TRUE(plan.ok()) << plan.status();
          ExpectCovers(shape, *plan);
          EXPECT_LE(plan->total_bytes(), budget);
          const int64_t t = plan->chunk_tokens, l = plan->layers_per_group;
          const int64_t g = DTypeSize(shape.gemm_dtype);
          EXPECT_EQ(plan->hidden_bytes, l * 2 * t * shape.hidden_width * g);
          EXPECT_EQ(plan->y_bytes,
                    l * 2 * t * std::max(shape.hidden_width, shape.target_width) * 4);
          if (convert) {
            EXPECT_EQ(plan->weights32_bytes, l * 2 * shape.weight_elements * 4);
          }
        }
      }
    }
  }
  // per_head 32K tokens of one layer: 2 x 32768 x (8192 x 2 + 8192 x 4 + 8192 x 2) bytes is
  // 4 GiB, past the default 2 GiB workspace: the tokens are chunked, where ridge keeps them.
  absl::StatusOr<StepPlan> ridge = PlanSteps(Qwen14To32(32768), 0, int64_t{2} << 30);
  absl::StatusOr<StepPlan> mlp = PlanSteps(Qwen14To32Mlp(32768, true), 0, int64_t{2} << 30);
  ASSERT_TRUE(ridge.ok() && mlp.ok());
  EXPECT_EQ(ridge->num_chunks, 1);
  EXPECT_GE(mlp->num_chunks, 2);
  EXPECT_EQ(mlp->layers_per_group, 1);
  EXPECT_LE(mlp->total_bytes(), int64_t{2} << 30);
  ExpectCovers(Qwen14To32Mlp(32768, true), *mlp);
}

TEST(PlanStepsTest, NegativeHiddenWidthIsInvalidArgument) {
  StepShape shape = Qwen14To32(10);
  shape.hidden_width = -1;
  absl::StatusOr<StepPlan> plan = PlanSteps(shape, 0, 1 << 30);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("hidden_width=-1"));
}

// A random MLP mapper view over fp32 weights owned by `storage`: source n_s = 2, d_s = 3, two
// layers; target n_t = 3, d_t = 2, two layers; |sigma_k| = 2, |sigma_v| = 1 (padded on the
// device), hidden 5; A1 has window * |sigma| * 6 input rows.
struct SmallMlp {
  MapperView view;
  std::vector<std::vector<float>> storage;
};

SmallMlp MakeSmallMlp(bool per_head, uint64_t seed, int window = 1) {
  SmallMlp m;
  m.storage.reserve(2 * 2 * 6);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  m.view.kind = MapKind::kMlp;
  m.view.window = window;
  m.view.source = NeoxModelSpec("s", 2, 2, 3);
  m.view.target = NeoxModelSpec("t", 2, 3, 2);
  const int heads = per_head ? 3 : 1;
  const int64_t hidden = 5, out = 6 / heads;
  const auto tensor = [&](int64_t rows, int64_t cols) {
    m.storage.emplace_back(rows * cols);
    for (float& x : m.storage.back()) x = normal(rng);
    return WeightView{m.storage.back().data(), DType::kFP32, rows, cols};
  };
  const auto chain = [&](int64_t in) {
    MlpView c;
    c.heads = heads;
    c.hidden = hidden;
    c.a1 = tensor(heads * in, hidden);
    c.c1 = tensor(heads, hidden);
    c.a2 = tensor(heads * hidden, hidden);
    c.c2 = tensor(heads, hidden);
    c.a3 = tensor(heads * hidden, out);
    c.c3 = tensor(heads, out);
    return c;
  };
  for (int l = 0; l < 2; ++l) {
    LayerMapView layer;
    layer.sigma_k = {1, 0};
    layer.sigma_v = {l};
    layer.mlp_k = chain(window * 12);
    layer.mlp_v = chain(window * 6);
    m.view.layers.push_back(layer);
  }
  return m;
}

TEST(DeviceLayoutTest, MlpSizesAndPreparedBytes) {
  for (bool per_head : {false, true}) {
    const SmallMlp m = MakeSmallMlp(per_head, 1);
    absl::StatusOr<DeviceLayout> layout = DeviceLayoutOf(m.view);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const int64_t heads = per_head ? 3 : 1;
    EXPECT_EQ(layout->kind, MapKind::kMlp);
    EXPECT_EQ(layout->weight_dtype, DType::kFP32);
    EXPECT_EQ(layout->max_blocks, 2);
    EXPECT_TRUE(layout->padded);
    EXPECT_EQ(layout->input_width, 12);
    EXPECT_EQ(layout->heads, heads);
    EXPECT_EQ(layout->hidden, 5);
    EXPECT_EQ(layout->head_out, 6 / heads);
    EXPECT_EQ(layout->hidden_width(), heads * 5);
    // Weights padded to input_width rows, fp32 biases c1, c2, c3 and int sigma lists, per
    // (layer, kind): every MLP weight byte is counted.
    const uint64_t per_pair = (12 * heads * 5 + heads * 5 * 5 + heads * 5 * (6 / heads)) * 4 +
                              (2 * heads * 5 + 6) * 4 + 2 * 4;
    EXPECT_EQ(layout->prepared_bytes(2), 2 * 2 * per_pair);
    EXPECT_EQ(layout->stage_elements(0), layout->a1_elements());
    EXPECT_EQ(layout->stage_elements(1), layout->a2_elements());
    EXPECT_EQ(layout->stage_elements(2), layout->a3_elements());
  }
  // bf16 everywhere keeps bf16; one fp16 matrix makes the device copy fp32.
  SmallMlp m = MakeSmallMlp(false, 2);
  for (LayerMapView& layer : m.view.layers) {
    for (MlpView* c : {&layer.mlp_k, &layer.mlp_v}) {
      c->a1.dtype = c->a2.dtype = c->a3.dtype = DType::kBF16;
    }
  }
  EXPECT_EQ(DeviceLayoutOf(m.view)->weight_dtype, DType::kBF16);
  m.view.layers[1].mlp_v.a2.dtype = DType::kFP16;
  EXPECT_EQ(DeviceLayoutOf(m.view)->weight_dtype, DType::kFP32);
}

TEST(DeviceLayoutTest, RidgeSizesUnchanged) {
  MapperView view;
  view.source = NeoxModelSpec("s", 3, 2, 4);
  view.target = NeoxModelSpec("t", 2, 3, 2);
  for (int l = 0; l < 2; ++l) {
    LayerMapView layer;
    layer.sigma_k = {0, 2};
    layer.sigma_v = {1, 2};
    layer.w_k = layer.w_v = WeightView{nullptr, DType::kBF16, 16, 6};
    view.layers.push_back(layer);
  }
  absl::StatusOr<DeviceLayout> layout = DeviceLayoutOf(view);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->weight_dtype, DType::kBF16);
  EXPECT_FALSE(layout->padded);
  EXPECT_EQ(layout->hidden_width(), 0);
  EXPECT_EQ(layout->matrix_elements(), 16 * 6);
  EXPECT_EQ(layout->stage_elements(0), layout->matrix_elements());
  EXPECT_EQ(layout->prepared_bytes(2), 2u * 2 * (16 * 6 * 2 + 6 * 4 + 2 * 4));
}

// Window rows: window x the padded sigma blocks, counted in the prepared bytes; a matrix whose
// sigma is shorter than the longest moves to the device one token offset at a time.
TEST(DeviceLayoutTest, WindowWidensTheInputRowsPerOffset) {
  MapperView view;
  view.window = 3;
  view.source = NeoxModelSpec("s", 3, 2, 4);
  view.target = NeoxModelSpec("t", 2, 3, 2);
  for (int l = 0; l < 2; ++l) {
    LayerMapView layer;
    layer.sigma_k = {0, 2};
    layer.sigma_v = {1};
    layer.w_k = WeightView{nullptr, DType::kBF16, 3 * 16, 6};
    layer.w_v = WeightView{nullptr, DType::kBF16, 3 * 8, 6};
    view.layers.push_back(layer);
  }
  absl::StatusOr<DeviceLayout> layout = DeviceLayoutOf(view);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->window, 3);
  EXPECT_EQ(layout->max_blocks, 2);
  EXPECT_TRUE(layout->padded);
  EXPECT_EQ(layout->input_width, 3 * 2 * 8);
  EXPECT_EQ(layout->offset_width(), 2 * 8);
  EXPECT_EQ(layout->matrix_elements(), 48 * 6);
  // W, fp32 b, sigma per (layer, kind): sigma lists are not repeated per offset.
  EXPECT_EQ(layout->prepared_bytes(2), 2u * 2 * (48 * 6 * 2 + 6 * 4 + 2 * 4));

  const int64_t row_bytes = 6 * 2;
  const InputRowCopies k = InputRowCopiesOf(*layout, 48, row_bytes);
  EXPECT_EQ(k.count, 1);
  EXPECT_EQ(k.bytes, 48 * row_bytes);
  const InputRowCopies v = InputRowCopiesOf(*layout, 24, row_bytes);
  EXPECT_EQ(v.count, 3);
  EXPECT_EQ(v.bytes, 8 * row_bytes);
  EXPECT_EQ(v.device_stride, 16 * row_bytes);

  view.window = 0;
  EXPECT_EQ(DeviceLayoutOf(view).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceLayoutTest, MixedMlpShapesAreRefusedNamingTheChain) {
  SmallMlp m = MakeSmallMlp(false, 3);
  m.view.layers[1].mlp_v.hidden = 4;
  absl::StatusOr<DeviceLayout> layout = DeviceLayoutOf(m.view);
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(layout.status().message(), HasSubstr("layers[1].mlp_v has heads=1 hidden=4"));
}

TEST(InterleaveHeadsTest, HeadsSideBySidePerRow) {
  // 2 heads of 3 rows x 2 cols: [h][r][c] = 100 h + 10 r + c.
  std::vector<int16_t> src;
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 2; ++c) src.push_back(static_cast<int16_t>(100 * h + 10 * r + c));
    }
  }
  std::vector<int16_t> dst(src.size(), -1);
  InterleaveHeads(src.data(), sizeof(int16_t), 2, 3, 2, dst.data());
  EXPECT_THAT(dst, ::testing::ElementsAre(0, 1, 100, 101, 10, 11, 110, 111, 20, 21, 120, 121));
}

// Column-major strided-batched GEMM as cuBLAS defines it, every index checked against the
// buffers (sized as the step plan sizes the workspace).
void HostGemm(const StridedGemm& g, const std::vector<float>& a, const std::vector<float>& b,
              std::vector<float>* c) {
  for (int e = 0; e < g.batch; ++e) {
    for (int j = 0; j < g.n; ++j) {
      for (int i = 0; i < g.m; ++i) {
        double sum = 0;
        for (int p = 0; p < g.k; ++p) {
          const int64_t ai = e * g.stride_a + static_cast<int64_t>(p) * g.lda + i;
          const int64_t bi = e * g.stride_b + static_cast<int64_t>(j) * g.ldb + p;
          EXPECT_LT(ai, static_cast<int64_t>(a.size()));
          EXPECT_LT(bi, static_cast<int64_t>(b.size()));
          if (ai >= static_cast<int64_t>(a.size()) || bi >= static_cast<int64_t>(b.size())) return;
          sum += static_cast<double>(a[ai]) * b[bi];
        }
        const int64_t ci = e * g.stride_c + static_cast<int64_t>(j) * g.ldc + i;
        EXPECT_LT(ci, static_cast<int64_t>(c->size()));
        if (ci >= static_cast<int64_t>(c->size())) return;
        (*c)[ci] = static_cast<float>(sum);
      }
    }
  }
}

// The BiasRelu kernel's contract (cuda_kernels.h): Y (interleaved or head-major) + bias, ReLU,
// into [pair][head][T][H].
void HostBiasRelu(const std::vector<float>& y, bool interleaved, const std::vector<float>& bias,
                  int64_t pairs, int heads, int64_t hidden, int64_t tokens,
                  std::vector<float>* out) {
  for (int64_t pair = 0; pair < pairs; ++pair) {
    for (int64_t i = 0; i < tokens; ++i) {
      for (int h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < hidden; ++j) {
          const int64_t o = ((pair * heads + h) * tokens + i) * hidden + j;
          const int64_t in = interleaved ? (pair * tokens + i) * heads * hidden + h * hidden + j : o;
          const float v = y[in] + bias[(pair * heads + h) * hidden + j];
          (*out)[o] = v < 0 ? 0 : v;
        }
      }
    }
  }
}

// The three GEMMs of MlpGemms on the device layout (A1 interleaved by head and placed by
// InputRowCopiesOf, padded to the longest sigma per token offset, A2 / A3 as stored), with
// bias + ReLU between them, give every chain's relu(relu(x A1 + c1) A2 + c2) A3 computed
// directly from the stored tensors, x's blocks offset-major over the chain's own sigma as the
// gather writes them (GatherParams).
TEST(MlpGemmsTest, ChainOnTheDeviceLayoutMatchesTheStoredMlp) {
  for (const auto& [per_head, window] : {std::pair<bool, int>{false, 1}, {true, 1},
                                         {false, 3}, {true, 2}}) {
    SCOPED_TRACE(testing::Message() << (per_head ? "per_head" : "per_layer") << " window "
                                    << window);
    const SmallMlp m = MakeSmallMlp(per_head, 4, window);
    absl::StatusOr<DeviceLayout> layout_or = DeviceLayoutOf(m.view);
    ASSERT_TRUE(layout_or.ok()) << layout_or.status();
    const DeviceLayout& layout = *layout_or;
    const int64_t pairs = 4, tokens = 7, width = layout.input_width;
    const int heads = layout.heads;
    const int64_t hidden = layout.hidden, hw = layout.hidden_width(), out = layout.head_out;
    // Device arrays as BeginPrepare / PrepareLayer build them.
    std::vector<float> a1(pairs * layout.a1_elements(), 0.0f), a2, a3, c1, c2;
    std::vector<const MlpView*> chains;
    for (const LayerMapView& layer : m.view.layers) {
      chains.push_back(&layer.mlp_k);
      chains.push_back(&layer.mlp_v);
    }
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const MlpView& c = *chains[pair];
      const float* stored = static_cast<const float*>(c.a1.data);
      const int64_t rows = c.a1.rows / heads;
      std::vector<float> interleaved(c.a1.rows * c.a1.cols);
      InterleaveHeads(stored, sizeof(float), heads, rows, hidden, interleaved.data());
      const InputRowCopies copies = InputRowCopiesOf(layout, rows, hw * sizeof(float));
      char* slot = reinterpret_cast<char*>(a1.data() + pair * layout.a1_elements());
      for (int o = 0; o < copies.count; ++o) {
        ASSERT_LE(o * copies.device_stride + copies.bytes,
                  static_cast<int64_t>(layout.a1_elements() * sizeof(float)));
        std::memcpy(slot + o * copies.device_stride,
                    reinterpret_cast<const char*>(interleaved.data()) + o * copies.bytes,
                    copies.bytes);
      }
      for (const WeightView* w : {&c.a2, &c.a3, &c.c1, &c.c2}) {
        std::vector<float>& to = w == &c.a2 ? a2 : w == &c.a3 ? a3 : w == &c.c1 ? c1 : c2;
        const float* from = static_cast<const float*>(w->data);
        to.insert(to.end(), from, from + w->rows * w->cols);
      }
    }
    std::mt19937_64 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(pairs * tokens * width);
    for (float& v : x) v = normal(rng);
    // Workspace buffers of the plan's sizes for one step of `pairs / 2` layers.
    StepShape shape;
    shape.num_tokens = tokens;
    shape.num_layers = 2;
    shape.input_width = width;
    shape.target_width = 6;
    shape.hidden_width = hw;
    absl::StatusOr<StepPlan> plan = PlanSteps(shape, 0, int64_t{1} << 30);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->layers_per_group, 2);
    std::vector<float> y(plan->y_bytes / 4), act(plan->hidden_bytes / 4);

    const std::array<StridedGemm, 3> gemms = MlpGemms(layout, tokens, pairs);
    HostGemm(gemms[0], a1, x, &y);
    HostBiasRelu(y, true, c1, pairs, heads, hidden, tokens, &act);
    HostGemm(gemms[1], a2, act, &y);
    HostBiasRelu(y, false, c2, pairs, heads, hidden, tokens, &act);
    HostGemm(gemms[2], a3, act, &y);

    for (int64_t pair = 0; pair < pairs; ++pair) {
      const MlpView& c = *chains[pair];
      const int64_t in = c.a1.rows / heads;  // this chain's own window |sigma| n_s d_s
      const int64_t own_blocks = in / window / 6;
      // Stored row r is block o * |sigma| + b, element e; the gather put it in the device row
      // at block o * max_blocks + b.
      const auto x_column = [&](int64_t r) {
        const int64_t block = r / 6, e = r % 6;
        const int64_t o = block / own_blocks, b = block % own_blocks;
        return (o * layout.max_blocks + b) * 6 + e;
      };
      const auto at = [](const WeightView& w, int64_t r, int64_t col) {
        return static_cast<double>(static_cast<const float*>(w.data)[r * w.cols + col]);
      };
      for (int64_t i = 0; i < tokens; ++i) {
        const float* xi = x.data() + (pair * tokens + i) * width;
        for (int h = 0; h < heads; ++h) {
          std::vector<double> h1(hidden), h2(hidden);
          for (int64_t j = 0; j < hidden; ++j) {
            double s = at(c.c1, h, j);
            for (int64_t r = 0; r < in; ++r) s += xi[x_column(r)] * at(c.a1, h * in + r, j);
            h1[j] = std::max(s, 0.0);
          }
          for (int64_t j = 0; j < hidden; ++j) {
            double s = at(c.c2, h, j);
            for (int64_t r = 0; r < hidden; ++r) s += h1[r] * at(c.a2, h * hidden + r, j);
            h2[j] = std::max(s, 0.0);
          }
          for (int64_t col = 0; col < out; ++col) {
            double s = 0;
            for (int64_t r = 0; r < hidden; ++r) s += h2[r] * at(c.a3, h * hidden + r, col);
            // Y as the epilogue reads it: per_layer [pair][T][n_t d_t], per_head (y_head_major)
            // [pair][head][T][d_t].
            const int64_t yi = ((pair * heads + h) * tokens + i) * out + col;
            EXPECT_NEAR(y[yi], s, 1e-4 * (1 + std::abs(s)))
                << "pair " << pair << " token " << i << " head " << h << " col " << col;
          }
        }
      }
    }
  }
}

// Head-local ridge on the device layout: W chain by chain, each padded per token offset, X
// head-major as the gather writes it (chain c: heads [first_c, first_c + g) of every block), one
// strided batch over (pair, head) (RidgeHeadGemm) into the epilogue's head-major Y; checked
// against the stored per-chain matrices applied to the whole row in double.
TEST(RidgeHeadGemmTest, ChainsOnTheDeviceLayoutMatchTheStoredMatrices) {
  const int ns = 4, ds = 2, nt = 2, dt = 3, window = 2, g = 2;
  MapperView view;
  view.window = window;
  view.head_local = true;
  view.source = NeoxModelSpec("s", 3, ns, ds);
  view.target = NeoxModelSpec("t", 2, nt, dt);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> stored;  // per pair: [nt][window |sigma| g ds][dt]
  std::vector<int> sigma_sizes;
  for (int l = 0; l < 2; ++l) {
    LayerMapView layer;
    layer.sigma_k = {1, 0};
    layer.sigma_v = {2};
    for (const std::vector<int>* sigma : {&layer.sigma_k, &layer.sigma_v}) {
      const int64_t rows = static_cast<int64_t>(window) * sigma->size() * g * ds;
      stored.emplace_back(nt * rows * dt);
      for (float& v : stored.back()) v = normal(rng);
      sigma_sizes.push_back(static_cast<int>(sigma->size()));
    }
    layer.w_k = WeightView{stored[stored.size() - 2].data(), DType::kFP32, nt * 16, dt};
    layer.w_v = WeightView{stored.back().data(), DType::kFP32, nt * 8, dt};
    view.layers.push_back(layer);
  }
  absl::StatusOr<DeviceLayout> layout_or = DeviceLayoutOf(view);
  ASSERT_TRUE(layout_or.ok()) << layout_or.status();
  const DeviceLayout& layout = *layout_or;
  EXPECT_TRUE(layout.head_local());
  EXPECT_EQ(layout.ridge_heads, nt);
  EXPECT_EQ(layout.group, g);
  EXPECT_EQ(layout.chain_width, window * 2 * g * ds);
  EXPECT_EQ(layout.head_out, dt);
  EXPECT_EQ(layout.gathered_width(), nt * 16);
  EXPECT_EQ(layout.offset_width(), 2 * g * ds);
  EXPECT_EQ(layout.matrix_elements(), nt * 16 * dt);
  EXPECT_EQ(layout.prepared_bytes(2), 2u * 2 * (nt * 16 * dt * 4 + nt * dt * 4 + 2 * 4) + nt * 4);

  const int64_t pairs = 4, tokens = 5, cw = layout.chain_width;
  // W as PrepareLayer's UploadChains lays it out.
  std::vector<float> w(pairs * layout.stage_elements(0), 0.0f);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t rows = static_cast<int64_t>(window) * sigma_sizes[pair] * g * ds;
    const InputRowCopies copies = InputRowCopiesOf(layout, rows, dt * sizeof(float));
    for (int c = 0; c < nt; ++c) {
      char* slot = reinterpret_cast<char*>(w.data() + pair * layout.stage_elements(0) +
                                           c * cw * dt);
      const char* from = reinterpret_cast<const char*>(stored[pair].data() + c * rows * dt);
      for (int o = 0; o < copies.count; ++o) {
        std::memcpy(slot + o * copies.device_stride, from + o * copies.bytes, copies.bytes);
      }
    }
  }
  // Whole rows [pair][T][window][max_blocks][ns][ds] (padding blocks zero), and X head-major.
  std::vector<float> row(pairs * tokens * window * 2 * ns * ds, 0.0f);
  std::vector<float> x(pairs * tokens * layout.gathered_width(), 0.0f);
  const auto row_at = [&](int64_t pair, int64_t i, int o, int b, int h, int d) -> float& {
    return row[((((pair * tokens + i) * window + o) * 2 + b) * ns + h) * ds + d];
  };
  for (int64_t pair = 0; pair < pairs; ++pair) {
    for (int64_t i = 0; i < tokens; ++i) {
      for (int o = 0; o < window; ++o) {
        for (int b = 0; b < sigma_sizes[pair]; ++b) {
          for (int h = 0; h < ns; ++h) {
            for (int d = 0; d < ds; ++d) row_at(pair, i, o, b, h, d) = normal(rng);
          }
        }
      }
      for (int c = 0; c < nt; ++c) {
        const HeadSources src = HeadLocalSources(view.source, view.target, c);
        for (int o = 0; o < window; ++o) {
          for (int b = 0; b < 2; ++b) {
            for (int sl = 0; sl < g; ++sl) {
              for (int d = 0; d < ds; ++d) {
                x[((pair * nt + c) * tokens + i) * cw + ((o * 2 + b) * g + sl) * ds + d] =
                    row_at(pair, i, o, b, src.first + sl, d);
              }
            }
          }
        }
      }
    }
  }
  const StridedGemm gemm = RidgeHeadGemm(layout, tokens, pairs);
  EXPECT_EQ(gemm.batch, pairs * nt);
  std::vector<float> y(pairs * nt * tokens * dt, 0.0f);
  HostGemm(gemm, w, x, &y);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int sig = sigma_sizes[pair];
    const int64_t rows = static_cast<int64_t>(window) * sig * g * ds;
    for (int c = 0; c < nt; ++c) {
      const HeadSources src = HeadLocalSources(view.source, view.target, c);
      for (int64_t i = 0; i < tokens; ++i) {
        for (int col = 0; col < dt; ++col) {
          double sum = 0;
          for (int o = 0; o < window; ++o) {
            for (int b = 0; b < sig; ++b) {
              for (int sl = 0; sl < g; ++sl) {
                for (int d = 0; d < ds; ++d) {
                  const int64_t r = ((o * sig + b) * g + sl) * ds + d;
                  sum += row_at(pair, i, o, b, src.first + sl, d) *
                         static_cast<double>(stored[pair][(c * rows + r) * dt + col]);
                }
              }
            }
          }
          const float got = y[((pair * nt + c) * tokens + i) * dt + col];
          EXPECT_NEAR(got, sum, 1e-4 * (1 + std::abs(sum)))
              << "pair " << pair << " chain " << c << " token " << i << " col " << col;
        }
      }
    }
  }
  // Head counts neither divides: refused naming both.
  view.target.num_kv_heads = 3;
  EXPECT_THAT(DeviceLayoutOf(view).status().message(), HasSubstr("target.num_kv_heads=3"));
}

TEST(CudaCallStatusTest, NamesTheCallAndCodeWithTheRightCanonicalCode) {
  absl::Status oom = CudaCallStatus("cudaMalloc", CudaFailure::kOutOfMemory, 2,
                                    "cudaErrorMemoryAllocation", "out of memory");
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(oom.message(), HasSubstr("cudaMalloc failed: cudaErrorMemoryAllocation (2): out of memory"));

  absl::Status unsupported =
      CudaCallStatus("cublasGemmStridedBatchedEx", CudaFailure::kNotSupported, 15,
                     "CUBLAS_STATUS_NOT_SUPPORTED", "the functionality requested is not supported");
  EXPECT_EQ(unsupported.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(unsupported.message(),
              HasSubstr("cublasGemmStridedBatchedEx failed: CUBLAS_STATUS_NOT_SUPPORTED (15)"));

  EXPECT_EQ(CudaCallStatus("cudaSetDevice", CudaFailure::kNoDevice, 100, "cudaErrorNoDevice", "")
                .code(),
            absl::StatusCode::kFailedPrecondition);
  absl::Status other =
      CudaCallStatus("Gather<<<>>>", CudaFailure::kOther, 700, "cudaErrorIllegalAddress",
                     "an illegal memory access was encountered");
  EXPECT_EQ(other.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(other.message(), HasSubstr("Gather<<<>>> failed: cudaErrorIllegalAddress (700)"));
}

}  // namespace
}  // namespace cuda
}  // namespace kvt
