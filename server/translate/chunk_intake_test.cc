// chunk_intake: inline chunks from a real reader function (a vector of messages) scattered into
// the real staging buffers, synchronously and on the ScatterWorker, with arrival signals and
// the errors a bad stream gets.
#include "server/translate/chunk_intake.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <utility>

#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "server/translate/staging.h"
#include "server/translate/translate_testing.h"

namespace kvt {
namespace {

using testing::TinyHeader;
using testing::TinyStore;

class ChunkIntakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PairLabels pair = PairLabels::Unknown();
    absl::StatusOr<TranslatePlan> plan =
        PlanTranslate(header_, tiny_.context(), absl::InfiniteFuture(), &pair);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = std::make_unique<TranslatePlan>(std::move(*plan));
    absl::StatusOr<std::unique_ptr<RequestStaging>> staging =
        RequestStaging::Lease(*plan_, header_, &system_, &cuda_);
    ASSERT_TRUE(staging.ok()) << staging.status();
    staging_ = std::move(*staging);
    staging_->StageSource(pool_.get());
    layers_ = testing::RandomLayers(4, plan_->source_geometry, 3);
  }
  ChunkIntake Intake(int64_t async_scatter_min_bytes) {
    return ChunkIntake(
        *plan_, [this](int layer, int kind) { return staging_->SourceLayer(layer, kind); },
        [this](int layer, int kind) {
          std::lock_guard<std::mutex> lock(mutex_);
          arrived_.push_back({layer, kind});
        },
        async_scatter_min_bytes);
  }
  void ExpectSourceArrived() {
    const int64_t bytes = plan_->source_geometry.layer_bytes();
    for (int l = 0; l < 4; ++l) {
      EXPECT_EQ(std::memcmp(staging_->SourceLayer(l, 0), layers_.k[l].data(), bytes), 0);
      EXPECT_EQ(std::memcmp(staging_->SourceLayer(l, 1), layers_.v[l].data(), bytes), 0);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    EXPECT_EQ(arrived_.size(), 8u);
    const std::set<std::pair<int, int>> distinct(arrived_.begin(), arrived_.end());
    EXPECT_EQ(distinct.size(), 8u);
  }

  TinyStore tiny_;
  const v1::TranslateHeader header_ = TinyHeader(16);
  SystemMemoryRegistry system_;
  CudaMemoryRegistry cuda_;
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create(0);
  std::unique_ptr<TranslatePlan> plan_;
  std::unique_ptr<RequestStaging> staging_;
  testing::Layers layers_;
  std::mutex mutex_;
  std::vector<std::pair<int, int>> arrived_;
};

const auto kNeverStop = [] { return false; };

TEST_F(ChunkIntakeTest, ChunksInAnyOrderLandInTheirLayers) {
  std::vector<TranslateRequestMessage> messages =
      testing::ChunkMessages(layers_, plan_->source_geometry, 5);
  std::shuffle(messages.begin(), messages.end(), std::mt19937(7));
  ChunkIntake intake = Intake(0);
  KVT_ASSERT_OK(intake.ReadAll(testing::ReaderOf(&messages), kNeverStop));
  KVT_EXPECT_OK(intake.CheckComplete());
  ExpectSourceArrived();
}

TEST_F(ChunkIntakeTest, ScatterWorkerCopiesLargeUploads) {
  std::vector<TranslateRequestMessage> messages =
      testing::ChunkMessages(layers_, plan_->source_geometry, 3);
  ChunkIntake intake = Intake(/*async_scatter_min_bytes=*/1);
  KVT_ASSERT_OK(intake.ReadAll(testing::ReaderOf(&messages), kNeverStop));
  KVT_EXPECT_OK(intake.CheckComplete());
  ExpectSourceArrived();  // every copy has landed when ReadAll returns
}

TEST_F(ChunkIntakeTest, MissingAndOverlappingChunks) {
  std::vector<TranslateRequestMessage> messages =
      testing::ChunkMessages(layers_, plan_->source_geometry, 8);
  messages.pop_back();  // layer 3 V, tokens [8, 16)
  ChunkIntake intake = Intake(0);
  KVT_ASSERT_OK(intake.ReadAll(testing::ReaderOf(&messages), kNeverStop));
  KVT_EXPECT_ERROR(intake.CheckComplete(), absl::StatusCode::kInvalidArgument,
                   "stream ended before every source chunk arrived: layer 3 V");

  std::vector<TranslateRequestMessage> twice =
      testing::ChunkMessages(layers_, plan_->source_geometry, 8);
  std::vector<TranslateRequestMessage> again =
      testing::ChunkMessages(layers_, plan_->source_geometry, 8);
  twice.push_back(std::move(again[0]));
  ChunkIntake overlapping = Intake(0);
  EXPECT_EQ(overlapping.ReadAll(testing::ReaderOf(&twice), kNeverStop).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ChunkIntakeTest, BadMessagesEndTheStream) {
  std::vector<TranslateRequestMessage> messages(1);
  messages[0].proto.mutable_header();
  KVT_EXPECT_ERROR(Intake(0).ReadAll(testing::ReaderOf(&messages), kNeverStop),
                   absl::StatusCode::kInvalidArgument, "second header in the stream");

  std::vector<TranslateRequestMessage> empty(1);
  KVT_EXPECT_ERROR(Intake(0).ReadAll(testing::ReaderOf(&empty), kNeverStop),
                   absl::StatusCode::kInvalidArgument, "empty TranslateKVRequest");

  std::vector<TranslateRequestMessage> wrong_size =
      testing::ChunkMessages(layers_, plan_->source_geometry, 8);
  wrong_size[0].data = ChunkBytes({absl::string_view("abc")}, nullptr);
  EXPECT_EQ(Intake(0).ReadAll(testing::ReaderOf(&wrong_size), kNeverStop).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ChunkIntakeTest, StopEndsReading) {
  std::vector<TranslateRequestMessage> messages =
      testing::ChunkMessages(layers_, plan_->source_geometry, 8);
  KVT_EXPECT_OK(Intake(0).ReadAll(testing::ReaderOf(&messages), [] { return true; }));
  EXPECT_EQ(messages[0].data.size(),
            static_cast<size_t>(plan_->source_geometry.chunk_bytes(8)));  // never read
}

TEST(ChunkIntakeInPlaceTest, ARegionInputTakesNoChunks) {
  TinyStore tiny;
  v1::TranslateHeader header = TinyHeader(8);
  header.mutable_input()->mutable_region()->set_region("in");
  PairLabels pair = PairLabels::Unknown();
  absl::StatusOr<TranslatePlan> plan =
      PlanTranslate(header, tiny.context(), absl::InfiniteFuture(), &pair);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const testing::Layers layers = testing::RandomLayers(4, plan->source_geometry, 4);
  std::vector<TranslateRequestMessage> messages =
      testing::ChunkMessages(layers, plan->source_geometry, 8);
  ChunkIntake intake(*plan, [](int, int) -> char* { return nullptr; }, nullptr, 0);
  KVT_EXPECT_ERROR(intake.ReadAll(testing::ReaderOf(&messages), kNeverStop),
                   absl::StatusCode::kInvalidArgument,
                   "header.input.region is set: the source cache is read from the region, so "
                   "the stream must carry no chunks");
  KVT_EXPECT_OK(intake.CheckComplete());
}

}  // namespace
}  // namespace kvt
