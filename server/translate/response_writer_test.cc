// response_writer: the header and trailer messages, and the sinks: inline chunks through a
// collecting writer function (reassembled and compared), packed in-place output, a paged
// region (read back with GatherPaged), and MakeLayerSink's choice.
#include "server/translate/response_writer.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "server/translate/translate_testing.h"
#include "transport/paged.h"

namespace kvt {
namespace {

using testing::TinyHeader;
using testing::TinyStore;

class ResponseWriterTest : public ::testing::Test {
 protected:
  std::shared_ptr<LayerBuffer> Buffer(const std::string& bytes) {
    auto buffer = std::make_shared<LayerBuffer>(pool_.get(), bytes.size());
    std::memcpy(buffer->bytes.get(), bytes.data(), bytes.size());
    return buffer;
  }

  TinyStore tiny_;
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create(0);
};

TEST_F(ResponseWriterTest, HeaderNamesMapperShapeAndBackend) {
  v1::TranslateHeader header = TinyHeader(9);
  header.set_output_layout(v1::LAYOUT_HND);
  const TranslatePlan plan = tiny_.Plan(header);
  const TranslateResponseMessage message = ResponseHeader("r-7", plan, *tiny_.backend());
  const v1::TranslateResponseHeader& out = message.proto.header();
  EXPECT_EQ(out.request_id(), "r-7");
  EXPECT_EQ(out.mapper_id(), "tiny");
  EXPECT_EQ(out.target_model(), tiny_.view().target.name);
  EXPECT_EQ(out.target_shape().num_layers(), 6u);
  EXPECT_EQ(out.output_layout(), v1::LAYOUT_HND);
  EXPECT_EQ(out.num_tokens(), 9u);
  EXPECT_EQ(out.backend(), tiny_.backend()->name());
}

TEST_F(ResponseWriterTest, InlineChunksCarryTheLayerZeroCopy) {
  v1::TranslateHeader header = TinyHeader(10);
  header.mutable_output()->mutable_inline_()->set_chunk_tokens(4);
  const TranslatePlan plan = tiny_.Plan(header);
  const testing::Layers layers = testing::RandomLayers(1, plan.target_geometry, 6);
  const std::shared_ptr<LayerBuffer> k = Buffer(layers.k[0]), v = Buffer(layers.v[0]);
  std::vector<v1::KVChunk> chunks;
  std::string k_out, v_out;
  InlineChunkSink sink(
      plan, /*response_chunk_bytes=*/1 << 20,
      [&](const TranslateResponseMessage& message) {
        chunks.push_back(message.proto.chunk());
        // The slices point into the layer buffer they keep alive.
        EXPECT_EQ(message.data.spans()[0].data(),
                  (message.proto.chunk().kind() == v1::CACHE_KIND_K ? k : v)->bytes.get() +
                      plan.target_geometry.chunk_bytes(message.proto.chunk().token_start()));
        (message.proto.chunk().kind() == v1::CACHE_KIND_K ? k_out : v_out) +=
            message.data.ToString();
        return true;
      },
      [] { return grpc::Status::CANCELLED; });
  EXPECT_EQ(sink.tokens_per_chunk(), 4);
  ASSERT_TRUE(sink.Deliver(3, k, v).ok());
  ASSERT_EQ(chunks.size(), 6u);  // tokens [0,4) [4,8) [8,10), K then V
  EXPECT_EQ(chunks[2].token_start(), 8u);
  EXPECT_EQ(chunks[2].token_count(), 2u);
  EXPECT_EQ(chunks[5].layer(), 3u);
  EXPECT_EQ(k_out, layers.k[0]);
  EXPECT_EQ(v_out, layers.v[0]);
  EXPECT_EQ(sink.output_bytes(), 2 * plan.target_geometry.layer_bytes());

  InlineChunkSink closed(plan, 1 << 20, [](const TranslateResponseMessage&) { return false; },
                         [] { return grpc::Status(grpc::StatusCode::CANCELLED, "gone"); });
  EXPECT_EQ(closed.Deliver(0, k, v).error_message(), "gone");
  // limits.response_chunk_bytes bounds chunks too: a token is 2 heads x 32 x 4 = 256 bytes, so
  // 600 bytes hold 2 tokens.
  InlineChunkSink by_bytes(plan, 600, [](const TranslateResponseMessage&) { return true; },
                           [] { return grpc::Status::CANCELLED; });
  EXPECT_EQ(by_bytes.tokens_per_chunk(), 2);
}

TEST_F(ResponseWriterTest, RegionSinks) {
  const TranslatePlan plan = tiny_.Plan(TinyHeader(6));
  const int64_t layer_bytes = plan.target_geometry.layer_bytes();
  std::string packed(2 * 6 * layer_bytes, '\0');
  PackedRegionSink in_place(&packed[0], layer_bytes);
  EXPECT_TRUE(in_place.in_place());
  EXPECT_EQ(in_place.InPlace(2, 1), &packed[0] + 5 * layer_bytes);
  ASSERT_TRUE(in_place.Deliver(2, nullptr, nullptr).ok());
  EXPECT_EQ(in_place.output_bytes(), 2 * layer_bytes);

  const PagedLayout pages{Layout::kNHD, 4, 2, 2, 32, 4};
  const uint32_t table[] = {3, 1, 0};
  std::string region(6 * pages.layer_bytes(), '\0');
  PagedRegionSink paged(pages, table, {0, plan.target_geometry.num_tokens}, &region[0],
                        plan.target_geometry);
  EXPECT_FALSE(paged.in_place());
  const testing::Layers layers = testing::RandomLayers(1, plan.target_geometry, 8);
  ASSERT_TRUE(paged.Deliver(4, Buffer(layers.k[0]), Buffer(layers.v[0])).ok());
  std::string k(layer_bytes, '\0'), v(layer_bytes, '\0');
  const char* layer = region.data() + 4 * pages.layer_bytes();
  GatherPaged(pages, table, 0, layer, plan.target_geometry, &k[0]);
  GatherPaged(pages, table, 1, layer, plan.target_geometry, &v[0]);
  EXPECT_EQ(k, layers.k[0]);
  EXPECT_EQ(v, layers.v[0]);
  EXPECT_EQ(paged.output_bytes(), 2 * layer_bytes);
}

TEST_F(ResponseWriterTest, LayerNoticesFollowEachRegionLayer) {
  const TranslatePlan plan = tiny_.Plan(TinyHeader(6));
  const int64_t layer_bytes = plan.target_geometry.layer_bytes();
  std::string packed(2 * 6 * layer_bytes, '\0');
  std::vector<TranslateResponseMessage> sent;
  LayerNoticeSink noticed(std::make_unique<PackedRegionSink>(&packed[0], layer_bytes),
                          plan.num_tokens,
                          [&](const TranslateResponseMessage& message) {
                            sent.push_back(message);
                            return true;
                          },
                          [] { return grpc::Status(grpc::StatusCode::CANCELLED, "gone"); });
  // The wrapper computes in place exactly where the region sink would.
  EXPECT_TRUE(noticed.in_place());
  EXPECT_EQ(noticed.InPlace(2, 1), &packed[0] + 5 * layer_bytes);
  ASSERT_TRUE(noticed.Deliver(2, nullptr, nullptr).ok());
  ASSERT_EQ(sent.size(), 2u);
  for (int kind = 0; kind < 2; ++kind) {
    const v1::KVChunk& chunk = sent[kind].proto.chunk();
    EXPECT_EQ(chunk.layer(), 2u);
    EXPECT_EQ(chunk.kind(), kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
    EXPECT_EQ(chunk.token_start(), 0u);
    EXPECT_EQ(chunk.token_count(), 6u);
    EXPECT_TRUE(chunk.data().empty());
    EXPECT_EQ(sent[kind].data.size(), 0u);
  }
  EXPECT_EQ(noticed.output_bytes(), 2 * layer_bytes);  // the region's bytes, not the notices

  // A caller gone: the stream ends with the closed status.
  LayerNoticeSink closed(std::make_unique<PackedRegionSink>(&packed[0], layer_bytes), 6,
                         [](const TranslateResponseMessage&) { return false; },
                         [] { return grpc::Status(grpc::StatusCode::CANCELLED, "gone"); });
  EXPECT_EQ(closed.Deliver(0, nullptr, nullptr).error_message(), "gone");
}

TEST_F(ResponseWriterTest, MakeLayerSinkFollowsTheOutputKind) {
  const v1::TranslateHeader header = TinyHeader(6);
  const TranslatePlan plan = tiny_.Plan(header);
  SystemMemoryRegistry system;
  CudaMemoryRegistry cuda;
  absl::StatusOr<std::unique_ptr<RequestStaging>> staging =
      RequestStaging::Lease(plan, header, &system, &cuda);
  ASSERT_TRUE(staging.ok()) << staging.status();
  const StreamHooks hooks{nullptr, [] { return false; }, [] { return grpc::Status::CANCELLED; }};
  const std::unique_ptr<LayerSink> sink = MakeLayerSink(
      plan, **staging, tiny_.config(), [](const TranslateResponseMessage&) { return true; },
      hooks);
  EXPECT_NE(dynamic_cast<InlineChunkSink*>(sink.get()), nullptr);
}

TEST_F(ResponseWriterTest, TrailerReportsTimingsAndFillsTheRecord) {
  KvtdConfig config;
  config.metrics.prefill_cost["target"] = {10, 1, 0};  // 10 ms + 1 ms per token
  TrailerInputs in;
  in.request_id = "r-1";
  in.start = absl::FromUnixMillis(1000);
  in.admitted = absl::FromUnixMillis(1002);
  in.staged_in = absl::FromUnixMillis(1007);
  in.end = absl::FromUnixMillis(1020);
  in.first_output = absl::FromUnixMillis(1010);
  in.compute_ms = 8;
  in.stage_out_ms = 3;
  in.pipelined = true;
  in.num_tokens = 30;
  in.input_bytes = 100;
  in.output_bytes = 200;
  in.input_shift = 0.25;
  TranslateRecord record;
  const TranslateResponseMessage message = ResponseTrailer(in, config, "target", &record);
  const v1::TranslateTrailer& trailer = message.proto.trailer();
  EXPECT_EQ(trailer.request_id(), "r-1");
  EXPECT_DOUBLE_EQ(trailer.timings().queue_ms(), 2);
  EXPECT_DOUBLE_EQ(trailer.timings().stage_in_ms(), 5);
  EXPECT_DOUBLE_EQ(trailer.timings().total_ms(), 20);
  EXPECT_DOUBLE_EQ(trailer.timings().first_output_ms(), 10);
  EXPECT_TRUE(trailer.pipelined());
  EXPECT_EQ(trailer.output_bytes(), 200u);
  EXPECT_DOUBLE_EQ(trailer.speedup_estimate(), 40.0 / 20);  // (10 + 30) ms / 20 ms
  EXPECT_DOUBLE_EQ(trailer.input_shift_score(), 0.25);
  EXPECT_DOUBLE_EQ(record.total_s, 0.02);
  EXPECT_DOUBLE_EQ(record.compute_s, 0.008);
  EXPECT_EQ(record.tokens, 30);
  ASSERT_TRUE(record.speedup.has_value());

  in.reprefill_estimate_ms = 60;  // the caller's estimate wins
  EXPECT_DOUBLE_EQ(ResponseTrailer(in, config, "target", &record).proto.trailer().speedup_estimate(), 3);
}

}  // namespace
}  // namespace kvt
