// translate_kv: whole TranslateKV calls over the real services (mapper store with the tiny
// synthetic mapper, CPU backend, ComputeExecutor, admission, shm registry) with the stream as
// plain functions over vectors: inline and pipelined results bit-identical to the backend called
// directly, packed shm regions both ways, and the errors of bad or abandoned streams.
#include "server/translate/translate_kv.h"

#include <cstring>
#include <map>
#include <vector>

#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "server/translate/translate_testing.h"
#include "tests/shm_object.h"

namespace kvt {
namespace {

using testing::TinyHeader;
using testing::TinyStore;

class TranslateKVTest : public ::testing::Test {
 protected:
  TranslateServices Services() {
    TranslateServices services;
    services.config = &tiny_.config();
    services.store = tiny_.store();
    services.shift_stats = &shift_;
    services.system_memory = &system_;
    services.cuda_memory = &cuda_;
    services.admission = &admission_;
    services.compute = &compute_;
    services.buffers = pool_.get();
    services.request_ids = &ids_;
    services.draining = &draining_;
    return services;
  }
  // Runs one call: `messages` in, every response message out (chunk data copied as written).
  grpc::Status Run(std::vector<TranslateRequestMessage> messages, bool client_gone = false) {
    responses_.clear();
    TranslateCall call;
    call.read = testing::ReaderOf(&messages);
    call.write = [this, client_gone](const TranslateResponseMessage& message) {
      if (client_gone) return false;
      responses_.push_back({message.proto, message.data.ToString()});
      return true;
    };
    call.cancelled = [] { return false; };
    call.closed = [] { return grpc::Status(grpc::StatusCode::CANCELLED, "client went away"); };
    record_ = TranslateRecord();
    return TranslateKV(Services(), call, &record_);
  }
  std::vector<TranslateRequestMessage> Request(const v1::TranslateHeader& header,
                                               const testing::Layers* source) {
    std::vector<TranslateRequestMessage> messages(1);
    *messages[0].proto.mutable_header() = header;
    if (source != nullptr) {
      const LayerGeometry geometry{Layout::kNHD, 2, header.num_tokens(), 32, 4};
      for (TranslateRequestMessage& chunk : testing::ChunkMessages(*source, geometry, 7)) {
        messages.push_back(std::move(chunk));
      }
    }
    return messages;
  }
  // The inline target reassembled from the response chunks.
  testing::Layers Target(int64_t tokens) {
    const int64_t token_bytes = 2 * 32 * 4;
    testing::Layers target;
    target.k.assign(6, std::string(tokens * token_bytes, '\0'));
    target.v = target.k;
    for (const auto& [proto, data] : responses_) {
      if (!proto.has_chunk()) continue;
      const v1::KVChunk& chunk = proto.chunk();
      std::string& layer = target.at(chunk.layer(), chunk.kind() == v1::CACHE_KIND_K ? 0 : 1);
      std::memcpy(&layer[chunk.token_start() * token_bytes], data.data(), data.size());
    }
    return target;
  }
  testing::Layers Expected(const testing::Layers& source, int64_t tokens) {
    const LayerGeometry geometry{Layout::kNHD, 2, tokens, 32, 4};
    TranslateOptions options;
    options.token_chunk = tiny_.config().backend.token_chunk;
    return testing::DirectTranslate(tiny_.store(), testing::ViewOf(source, DType::kFP32, geometry),
                                    Positions(), DType::kFP32, Layout::kNHD, options);
  }
  const v1::TranslateTrailer& Trailer() { return responses_.back().first.trailer(); }

  TinyStore tiny_;
  InputShiftCache shift_;
  SystemMemoryRegistry system_;
  CudaMemoryRegistry cuda_;
  AdmissionController admission_{8, 1ll << 30};
  ComputeExecutor compute_{1};
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create(1 << 20);
  RequestIds ids_;
  std::atomic<bool> draining_{false};
  std::vector<std::pair<v1::TranslateKVResponse, std::string>> responses_;
  TranslateRecord record_;
};

TEST_F(TranslateKVTest, InlineResultIsTheBackendsToTheBit) {
  for (int64_t min_tokens : {1024, 1}) {  // everything first; pipelined
    tiny_.config().transport.pipeline_min_tokens = min_tokens;
    const LayerGeometry geometry{Layout::kNHD, 2, 33, 32, 4};
    const testing::Layers source = testing::RandomLayers(4, geometry, 11);
    const grpc::Status status = Run(Request(TinyHeader(33), &source));
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_GE(responses_.size(), 3u);
    EXPECT_TRUE(responses_.front().first.has_header());
    EXPECT_EQ(responses_.front().first.header().request_id(), Trailer().request_id());
    EXPECT_EQ(Trailer().pipelined(), min_tokens == 1);
    EXPECT_EQ(Trailer().num_tokens(), 33u);
    EXPECT_EQ(Trailer().output_bytes(), 6u * 2 * 33 * 256);
    const testing::Layers expected = Expected(source, 33);
    const testing::Layers target = Target(33);
    for (int l = 0; l < 6; ++l) {
      EXPECT_EQ(target.k[l], expected.k[l]) << "layer " << l;
      EXPECT_EQ(target.v[l], expected.v[l]) << "layer " << l;
    }
    EXPECT_EQ(record_.tokens, 33);
    EXPECT_EQ(record_.pair.target(), tiny_.view().target.name);
    EXPECT_EQ(admission_.inflight_requests(), 0);  // the ticket went with the call
  }
}

TEST_F(TranslateKVTest, PackedRegionsBothWays) {
  const int64_t tokens = 12;
  const LayerGeometry geometry{Layout::kNHD, 2, tokens, 32, 4};
  const testing::Layers source = testing::RandomLayers(4, geometry, 12);
  const std::string packed = testing::Packed(source);
  test::ShmObject input(packed.size()), output(6 * 2 * geometry.layer_bytes());
  std::memcpy(input.data(), packed.data(), packed.size());
  KVT_ASSERT_OK(system_.Register("in", input.key(), 0, input.size()));
  KVT_ASSERT_OK(system_.Register("out", output.key(), 0, output.size()));
  v1::TranslateHeader header = TinyHeader(tokens);
  header.mutable_input()->mutable_region()->set_region("in");
  header.mutable_input()->mutable_region()->set_byte_size(input.size());
  header.mutable_output()->mutable_region()->set_region("out");
  header.mutable_output()->mutable_region()->set_byte_size(output.size());
  const grpc::Status status = Run(Request(header, nullptr));
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(responses_.size(), 2u);  // header and trailer: the target is in the region
  EXPECT_FALSE(Trailer().pipelined());
  const std::string expected = testing::Packed(Expected(source, tokens));
  EXPECT_EQ(std::string(output.data(), output.size()), expected);
}

TEST_F(TranslateKVTest, BadAndAbandonedStreams) {
  EXPECT_EQ(Run({}).error_message(),
            "stream ended before its header: send a TranslateHeader first");
  std::vector<TranslateRequestMessage> chunk_first(1);
  chunk_first[0].proto.mutable_chunk();
  EXPECT_EQ(Run(std::move(chunk_first)).error_message(),
            "first message must be a header (TranslateKVRequest.header)");

  const LayerGeometry geometry{Layout::kNHD, 2, 10, 32, 4};
  const testing::Layers source = testing::RandomLayers(4, geometry, 13);
  std::vector<TranslateRequestMessage> short_stream = Request(TinyHeader(10), &source);
  short_stream.pop_back();
  grpc::Status status = Run(std::move(short_stream));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("stream ended before every source chunk arrived"),
            std::string::npos);

  EXPECT_EQ(Run(Request(TinyHeader(10), &source), /*client_gone=*/true).error_message(),
            "client went away");

  draining_ = true;
  EXPECT_EQ(Run(Request(TinyHeader(10), &source)).error_code(), grpc::StatusCode::UNAVAILABLE);
  draining_ = false;

  tiny_.config().transport.pipeline_min_tokens = 1;  // errors with the output thread running
  std::vector<TranslateRequestMessage> second_header = Request(TinyHeader(10), &source);
  const TranslateRequestMessage header_again = second_header.front();
  second_header.insert(second_header.begin() + 3, header_again);
  status = Run(std::move(second_header));
  EXPECT_EQ(status.error_message(),
            "second header in the stream: a TranslateKV stream carries exactly one header");
  EXPECT_EQ(admission_.inflight_requests(), 0);
}

}  // namespace
}  // namespace kvt
