// layer_pipeline: LayerArrivals' ready order; the producer computing the tiny mapper's target
// layers on the real CPU backend and ComputeExecutor into small collecting sinks (bit-identical
// to Backend::TranslateLayer called directly), on its own output thread with arrivals in any
// order, and abandoned or failed cleanly.
#include "server/translate/layer_pipeline.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "server/translate/translate_testing.h"

namespace kvt {
namespace {

using testing::TinyHeader;
using testing::TinyStore;

std::vector<LayerMapView> Maps(const std::vector<std::vector<int>>& sigma) {
  std::vector<LayerMapView> maps(sigma.size());
  for (size_t t = 0; t < sigma.size(); ++t) maps[t].sigma_k = maps[t].sigma_v = sigma[t];
  return maps;
}

TEST(LayerArrivalsTest, TargetLayersGoWhenTheirSourcesAreIn) {
  const std::vector<LayerMapView> maps = Maps({{1}, {0}, {0, 1}});
  LayerArrivals arrivals(&maps, 2, /*all_arrived=*/false);
  EXPECT_EQ(arrivals.TakeReadyNow(), -1);
  arrivals.Arrived(0, 0);
  EXPECT_EQ(arrivals.TakeReadyNow(), -1);  // layer 0's V is still out
  arrivals.Arrived(0, 1);
  EXPECT_EQ(arrivals.TakeReadyNow(), 1);
  EXPECT_EQ(arrivals.TakeReadyNow(), -1);  // taken once only
  std::thread late([&] { arrivals.Arrived(1, 0), arrivals.Arrived(1, 1); });
  EXPECT_EQ(arrivals.WaitAndTake(), 0);
  late.join();
  EXPECT_EQ(arrivals.TakeReadyNow(), 2);
  std::thread abort([&] { arrivals.Abort(); });
  EXPECT_EQ(arrivals.WaitAndTake(), -1);
  abort.join();

  LayerArrivals all(&maps, 2, /*all_arrived=*/true);
  EXPECT_EQ(all.TakeReadyNow(), 0);
  EXPECT_EQ(all.TakeReadyNow(), 1);
  EXPECT_EQ(all.TakeReadyNow(), 2);
}

// Copies each delivered layer out; or, in place, hands out its own packed buffer.
class CollectingSink : public LayerSink {
 public:
  CollectingSink(int layers, int64_t layer_bytes, bool in_place)
      : layer_bytes_(layer_bytes), in_place_(in_place), packed_(2 * layers * layer_bytes, '\0') {
    out_.k.resize(layers);
    out_.v.resize(layers);
  }
  bool in_place() const override { return in_place_; }
  char* InPlace(int layer, int kind) override {
    return &packed_[(2 * layer + kind) * layer_bytes_];
  }
  grpc::Status Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                       const std::shared_ptr<LayerBuffer>& v) override {
    order.push_back(layer);
    const char* k_bytes = in_place_ ? InPlace(layer, 0) : k->bytes.get();
    const char* v_bytes = in_place_ ? InPlace(layer, 1) : v->bytes.get();
    out_.k[layer].assign(k_bytes, layer_bytes_);
    out_.v[layer].assign(v_bytes, layer_bytes_);
    output_bytes_ += 2 * layer_bytes_;
    return order.size() == static_cast<size_t>(fail_at) ? grpc::Status::CANCELLED
                                                         : grpc::Status::OK;
  }
  const testing::Layers& out() const { return out_; }
  std::vector<int> order;
  int fail_at = -1;  // the delivery (1-based) that fails

 private:
  const int64_t layer_bytes_;
  const bool in_place_;
  std::string packed_;
  testing::Layers out_;
};

class LayerProducerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PairLabels pair = PairLabels::Unknown();
    absl::StatusOr<TranslatePlan> plan =
        PlanTranslate(header_, tiny_.context(), absl::InfiniteFuture(), &pair);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = std::make_unique<TranslatePlan>(std::move(*plan));
    absl::StatusOr<ComputeMapper> mapper = PinForCompute(tiny_.store(), &shift_, &plan_->handle,
                                                         absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(mapper.ok()) << mapper.status();
    source_layers_ = testing::RandomLayers(4, plan_->source_geometry, 5);
    source_ = testing::ViewOf(source_layers_, DType::kFP32, plan_->source_geometry);
    inputs_.plan = plan_.get();
    inputs_.source = &source_;
    inputs_.mapper = *mapper;
    inputs_.options.token_chunk = 7;  // several compute steps per layer
    inputs_.compute = &compute_;
    inputs_.buffers = pool_.get();
    expected_ = testing::DirectTranslate(tiny_.store(), source_, plan_->positions,
                                         DType::kFP32, Layout::kNHD, inputs_.options);
  }
  void ExpectTranslated(const CollectingSink& sink) {
    for (int l = 0; l < 6; ++l) {
      EXPECT_EQ(sink.out().k[l], expected_.k[l]) << "layer " << l;
      EXPECT_EQ(sink.out().v[l], expected_.v[l]) << "layer " << l;
    }
  }
  StreamHooks Hooks() {
    return StreamHooks{[](const absl::Status& s) { return grpc::Status(grpc::StatusCode::INTERNAL, std::string(s.message())); },
                       [this] { return cancelled_; },
                       [] { return grpc::Status(grpc::StatusCode::CANCELLED, "gone"); }};
  }

  TinyStore tiny_;
  const v1::TranslateHeader header_ = TinyHeader(20);
  InputShiftCache shift_;
  ComputeExecutor compute_{1};
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create(0);
  std::unique_ptr<TranslatePlan> plan_;
  testing::Layers source_layers_, expected_;
  CacheView source_;
  ProducerInputs inputs_;
  bool cancelled_ = false;
};

TEST_F(LayerProducerTest, EveryLayerComputedIntoSlotsAndInPlace) {
  for (bool in_place : {false, true}) {
    LayerArrivals arrivals(&plan_->view().layers, 4, /*all_arrived=*/true);
    CollectingSink sink(6, plan_->target_geometry.layer_bytes(), in_place);
    LayerProducer producer(inputs_, &arrivals, &sink, Hooks());
    bool first_ran = false;
    const grpc::Status status = producer.Run([&] { first_ran = true; });
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_TRUE(first_ran);
    EXPECT_EQ(sink.order, (std::vector<int>{0, 1, 2, 3, 4, 5}));
    EXPECT_GT(producer.compute_ms(), 0);
    EXPECT_NE(producer.first_output(), absl::InfiniteFuture());
    ExpectTranslated(sink);
  }
}

TEST_F(LayerProducerTest, OutputThreadFollowsArrivalsInAnyOrder) {
  LayerArrivals arrivals(&plan_->view().layers, 4, /*all_arrived=*/false);
  CollectingSink sink(6, plan_->target_geometry.layer_bytes(), false);
  LayerProducer producer(inputs_, &arrivals, &sink, Hooks());
  OutputThread output(&producer, &arrivals, [](TranslateRequestMessage*) { return false; });
  for (int layer = 3; layer >= 0; --layer) {
    arrivals.Arrived(layer, 1);
    arrivals.Arrived(layer, 0);
  }
  const grpc::Status status = output.Join();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(output.failed());
  std::vector<int> sorted = sink.order;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  ExpectTranslated(sink);
}

TEST_F(LayerProducerTest, StopAbandonsAWaitingProducer) {
  LayerArrivals arrivals(&plan_->view().layers, 4, /*all_arrived=*/false);
  CollectingSink sink(6, plan_->target_geometry.layer_bytes(), false);
  LayerProducer producer(inputs_, &arrivals, &sink, Hooks());
  int discarded = 0;
  OutputThread output(&producer, &arrivals, [&](TranslateRequestMessage*) {
    return ++discarded < 3;  // a client still writing two more messages
  });
  const grpc::Status status = output.Stop();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(sink.order.empty());
  EXPECT_EQ(output.Stop().error_code(), grpc::StatusCode::CANCELLED);  // idempotent
}

TEST_F(LayerProducerTest, SinkFailureAndCancellationEndTheRun) {
  {
    LayerArrivals arrivals(&plan_->view().layers, 4, /*all_arrived=*/true);
    CollectingSink sink(6, plan_->target_geometry.layer_bytes(), false);
    sink.fail_at = 2;
    LayerProducer producer(inputs_, &arrivals, &sink, Hooks());
    OutputThread output(&producer, &arrivals, [](TranslateRequestMessage*) { return false; });
    const grpc::Status status = output.Join();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_TRUE(output.failed());
    EXPECT_EQ(sink.order.size(), 2u);
  }
  {
    cancelled_ = true;
    LayerArrivals arrivals(&plan_->view().layers, 4, /*all_arrived=*/true);
    CollectingSink sink(6, plan_->target_geometry.layer_bytes(), false);
    LayerProducer producer(inputs_, &arrivals, &sink, Hooks());
    const grpc::Status status = producer.Run(nullptr);
    EXPECT_EQ(status.error_message(), "gone");
    EXPECT_TRUE(sink.order.empty());
  }
}

}  // namespace
}  // namespace kvt
