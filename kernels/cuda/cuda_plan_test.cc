#include "kernels/cuda/cuda_plan.h"

#include <cstdint>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
// layer, kind and token, weight copies, tables and staging.
int64_t StepBytes(const StepShape& s, int64_t tokens, int64_t layers) {
  const int64_t g = DTypeSize(s.gemm_dtype);
  int64_t bytes = layers * 2 * tokens * (s.input_width * g + s.target_width * 4);
  if (s.convert_weights) bytes += layers * 2 * s.input_width * s.target_width * 4;
  bytes += tokens * 2 * 4 * (s.rope_half_source + s.rope_half_target);
  bytes += tokens * s.staged_source_bytes_per_token;
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
