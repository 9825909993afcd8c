// request_plan: headers of the real tiny mapper turned into plans, and the errors that name
// the header field; the prologue pieces ValidateKV shares.
#include "server/translate/request_plan.h"

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "server/translate/translate_testing.h"

namespace kvt {
namespace {

using testing::TinyHeader;
using testing::TinyStore;

absl::StatusOr<TranslatePlan> Plan(TinyStore& tiny, const v1::TranslateHeader& header,
                                   PairLabels* pair = nullptr) {
  PairLabels ignored = PairLabels::Unknown();
  return PlanTranslate(header, tiny.context(), absl::InfiniteFuture(),
                       pair != nullptr ? pair : &ignored);
}

TEST(RequestPlanTest, InlineHeaderGivesGeometryBytesAndMapper) {
  TinyStore tiny;
  v1::TranslateHeader header = TinyHeader(24);
  header.set_output_dtype(v1::DTYPE_BF16);
  header.mutable_output()->mutable_inline_()->set_chunk_tokens(5);
  PairLabels pair = PairLabels::Unknown();
  absl::StatusOr<TranslatePlan> plan = Plan(tiny, header, &pair);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mapper->id(), "tiny");
  EXPECT_EQ(plan->num_tokens, 24);
  EXPECT_EQ(plan->input_dtype, DType::kFP32);
  EXPECT_EQ(plan->output_dtype, DType::kBF16);
  EXPECT_EQ(plan->output_layout, Layout::kNHD);
  EXPECT_EQ(plan->response_chunk_tokens, 5);
  EXPECT_FALSE(plan->input_in_place());
  EXPECT_FALSE(plan->output_in_region);
  // 4 source layers x K,V x 2 heads x 24 tokens x 32 dims x 4 bytes; 6 target layers in bf16.
  EXPECT_EQ(plan->source_bytes, 4 * 2 * 2 * 24 * 32 * 4);
  EXPECT_EQ(plan->target_bytes, 6 * 2 * 2 * 24 * 32 * 2);
  EXPECT_EQ(plan->source_geometry.layer_bytes(), 2 * 24 * 32 * 4);
  EXPECT_EQ(plan->target_geometry.element_size, 2);
  EXPECT_EQ(pair.source(), tiny.view().source.name);
}

TEST(RequestPlanTest, RegionSidesAreClassified) {
  TinyStore tiny;
  v1::TranslateHeader header = TinyHeader(8);
  header.mutable_input()->mutable_region()->set_region("in");
  header.mutable_output()->mutable_region()->mutable_paged()->set_num_blocks(1);
  absl::StatusOr<TranslatePlan> plan = Plan(tiny, header);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->input_in_region);
  EXPECT_TRUE(plan->input_in_place());
  EXPECT_FALSE(plan->input_paged);
  EXPECT_TRUE(plan->output_in_region);
  EXPECT_TRUE(plan->output_paged);
}

TEST(RequestPlanTest, ErrorsNameTheField) {
  TinyStore tiny;
  v1::TranslateHeader no_dtype = TinyHeader(8);
  no_dtype.clear_dtype();
  KVT_EXPECT_ERROR(Plan(tiny, no_dtype), absl::StatusCode::kInvalidArgument, "header.dtype");

  v1::TranslateHeader cached_output = TinyHeader(8);
  cached_output.mutable_output()->mutable_cached();
  KVT_EXPECT_ERROR(Plan(tiny, cached_output), absl::StatusCode::kInvalidArgument,
                   "header.output.cached");

  // No prefix cache in this context.
  v1::TranslateHeader cached_input = TinyHeader(8);
  cached_input.mutable_input()->mutable_cached()->set_lease_id("x");
  KVT_EXPECT_ERROR(Plan(tiny, cached_input), absl::StatusCode::kFailedPrecondition,
                   "prefix_cache.enabled");

  tiny.config().shared_memory.allow_client_regions = false;
  v1::TranslateHeader region = TinyHeader(8);
  region.mutable_output()->mutable_region()->set_region("out");
  KVT_EXPECT_ERROR(Plan(tiny, region), absl::StatusCode::kFailedPrecondition,
                   "header.output.region: client shared memory is disabled");

  v1::TranslateHeader unknown = TinyHeader(8);
  unknown.set_mapper_id("no-such-mapper");
  EXPECT_FALSE(Plan(tiny, unknown).ok());
}

TEST(RequestPlanTest, MaxRequestBytesIsEnforced) {
  TinyStore tiny;
  tiny.config().limits.max_request_bytes = 1000;
  KVT_EXPECT_ERROR(Plan(tiny, TinyHeader(8)), absl::StatusCode::kResourceExhausted,
                   "over limits.max_request_bytes=1000");
}

TEST(RequestPlanTest, PrologueSharedWithValidateKV) {
  RequestIds ids;
  EXPECT_EQ(ids.Next(""), "kvt-1");
  EXPECT_EQ(ids.Next("mine"), "mine");
  EXPECT_EQ(ids.Next(""), "kvt-2");

  EXPECT_TRUE(CheckNotDraining(false).ok());
  KVT_EXPECT_ERROR(CheckNotDraining(true), absl::StatusCode::kUnavailable, "draining");

  const FailureLog fail("translate failed", "r-1");
  const grpc::Status status = fail(absl::InvalidArgumentError("header.dtype: bad"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "header.dtype: bad");

  KvtdConfig config;
  config.mapper_store.acquire_timeout_seconds = 5;
  const absl::Time soon = absl::Now() + absl::Seconds(1);
  EXPECT_EQ(MapperWait(config, soon).deadline, soon);
  const absl::Time capped = MapperWait(config, absl::InfiniteFuture()).deadline;
  EXPECT_LE(capped, absl::Now() + absl::Seconds(5));
  EXPECT_GT(capped, absl::Now() + absl::Seconds(4));

  TinyStore tiny;
  absl::StatusOr<TranslatePlan> plan = Plan(tiny, TinyHeader(4));
  ASSERT_TRUE(plan.ok()) << plan.status();
  InputShiftCache shift;
  absl::StatusOr<ComputeMapper> mapper =
      PinForCompute(tiny.store(), &shift, &plan->handle, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  EXPECT_EQ(mapper->backend, tiny.backend());
  EXPECT_NE(mapper->prepared, nullptr);
}

}  // namespace
}  // namespace kvt
