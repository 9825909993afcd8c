// The zero-copy TranslateKV transport (transport/chunk_wire.h) against a real kvtd on port 0:
// its bytes are plain protobuf to a client that uses the generated stub (results identical to
// the zero-copy client's, HND chunks crossing many slices), malformed frames end the call with
// INVALID_ARGUMENT naming the field, and abandoned calls leave no buffer in use (run under ASan
// by CI).
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "server/kvtd_server.h"
#include "tests/in_process_kvtd.h"
#include "transport/kv_chunks.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

std::string StoreDir() {
  SynthOptions options;
  options.source = NeoxModelSpec("test/src", 3, 2, 32, 10000);
  options.target = NeoxModelSpec("test/dst", 4, 3, 16, 500000);
  options.k = 2;
  options.dtype = DType::kFP32;
  options.seed = 5;
  return SynthStoreForTest("zero_copy_store", options);
}

class ZeroCopyTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvtdConfig config;
    config.transport.pipeline_min_tokens = 0;
    config.transport.async_scatter_min_bytes = 1;  // every upload through the ScatterWorker
    config.limits.response_chunk_bytes = 3000;  // many response chunks per layer
    InProcessKvtdOptions options;
    options.client.chunk_bytes = 2500;  // not a multiple of a token's bytes: chunk edges move
    kvtd_ = StartKvtdForTest(StoreDir(), config, std::move(options));
    ASSERT_NE(kvtd_, nullptr);
  }

  HostCache Source(int64_t tokens, Layout layout) {
    HostCache cache = HostCache::Zeros(DType::kFP32, layout, 3, 2, 32, tokens);
    std::mt19937 rng(static_cast<uint32_t>(tokens));
    std::normal_distribution<float> normal;
    for (int l = 0; l < cache.num_layers; ++l) {
      for (std::vector<char>* buffer : {&cache.k[l], &cache.v[l]}) {
        float* x = reinterpret_cast<float*>(buffer->data());
        for (size_t i = 0; i < buffer->size() / sizeof(float); ++i) x[i] = normal(rng);
      }
    }
    return cache;
  }

  v1::TranslateHeader Header(const HostCache& source) {
    v1::TranslateHeader header;
    header.set_mapper_id("m");
    header.set_dtype(v1::DTYPE_FP32);
    header.set_layout(source.layout == Layout::kHND ? v1::LAYOUT_HND : v1::LAYOUT_NHD);
    header.set_num_tokens(static_cast<uint32_t>(source.num_tokens));
    header.set_position_offset(7);
    return header;
  }

  std::unique_ptr<InProcessKvtd> kvtd_;
};

// The generated stub serializes with protobuf: what it sends and receives must mean the same
// to kvtd as the zero-copy client's slices, byte for byte in the result.
TEST_F(ZeroCopyTransportTest, ProtobufStubAndZeroCopyClientGetIdenticalResults) {
  for (Layout layout : {Layout::kHND, Layout::kNHD}) {
    const HostCache source = Source(97, layout);
    absl::StatusOr<TranslateResult> zero_copy = kvtd_->client().Translate(Header(source), source);
    ASSERT_TRUE(zero_copy.ok()) << zero_copy.status();

    grpc::ClientContext context;
    auto stream = kvtd_->client().stub()->TranslateKV(&context);
    v1::TranslateKVRequest request;
    *request.mutable_header() = Header(source);
    ASSERT_TRUE(stream->Write(request));
    const LayerGeometry geometry{layout, 2, 97, 32, 4};
    for (int l = 0; l < 3; ++l) {
      for (int kind = 0; kind < 2; ++kind) {
        for (int64_t start = 0; start < 97; start += 10) {
          const int64_t count = std::min<int64_t>(10, 97 - start);
          v1::KVChunk* chunk = request.mutable_chunk();
          chunk->set_layer(l);
          chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
          chunk->set_token_start(static_cast<uint32_t>(start));
          chunk->set_token_count(static_cast<uint32_t>(count));
          chunk->mutable_data()->resize(static_cast<size_t>(geometry.chunk_bytes(count)));
          GatherChunk(geometry, start, count, (kind == 0 ? source.k : source.v)[l].data(),
                      chunk->mutable_data()->data());
          ASSERT_TRUE(stream->Write(request));
        }
      }
    }
    stream->WritesDone();
    const HostCache& expected = zero_copy->target;
    const LayerGeometry target{layout, 3, 97, 16, 4};
    std::vector<std::string> k(4, std::string(expected.k[0].size(), '\0'));
    std::vector<std::string> v = k;
    int chunks = 0;
    bool trailer = false;
    v1::TranslateKVResponse response;
    while (stream->Read(&response)) {
      if (response.has_chunk()) {
        const v1::KVChunk& chunk = response.chunk();
        ASSERT_EQ(static_cast<int64_t>(chunk.data().size()),
                  target.chunk_bytes(chunk.token_count()));
        ScatterChunk(target, chunk.token_start(), chunk.token_count(), chunk.data().data(),
                     (chunk.kind() == v1::CACHE_KIND_K ? k : v)[chunk.layer()].data());
        ++chunks;
      }
      trailer = trailer || response.has_trailer();
    }
    ASSERT_TRUE(stream->Finish().ok());
    EXPECT_TRUE(trailer);
    EXPECT_GT(chunks, 8);
    for (int l = 0; l < 4; ++l) {
      EXPECT_EQ(k[l], std::string(expected.k[l].begin(), expected.k[l].end())) << l;
      EXPECT_EQ(v[l], std::string(expected.v[l].begin(), expected.v[l].end())) << l;
    }
  }
}

// Raw bytes on the stream: a valid header, then a chunk whose data length runs past its end.
TEST_F(ZeroCopyTransportTest, TruncatedChunkIsInvalidArgumentNamingTheField) {
  const HostCache source = Source(16, Layout::kNHD);
  grpc::ClientContext context;
  grpc::internal::RpcMethod method("/kvt.v1.KvTranslator/TranslateKV",
                                   grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          kvtd_->client().channel().get(), method, &context));
  v1::TranslateKVRequest header;
  *header.mutable_header() = Header(source);
  auto bytes = [](const std::string& s) {
    grpc::Slice slice(s);
    return grpc::ByteBuffer(&slice, 1);
  };
  ASSERT_TRUE(stream->Write(bytes(header.SerializeAsString())));
  // KVChunk{token_count: 16, data: <declares 4096 bytes, carries 3996>} inside a
  // TranslateKVRequest.chunk whose own length is consistent.
  const std::string inner =
      std::string("\x20\x10\x2a\x80\x20", 5) + std::string(3996, 'x');
  std::string wire = "\x12";
  for (uint64_t n = inner.size(); ; n >>= 7) {
    wire.push_back(static_cast<char>((n & 0x7f) | (n >= 0x80 ? 0x80 : 0)));
    if (n < 0x80) break;
  }
  wire += inner;
  stream->Write(bytes(wire));
  stream->WritesDone();
  grpc::ByteBuffer response;
  while (stream->Read(&response)) {
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("TranslateKVRequest.chunk.data: declares 4096"));
}

// Streams given up halfway (output still in gRPC's hands, the source slices still queued) and
// then a full translation: nothing is read after it was freed or reused (ASan) and the last
// result is still right.
TEST_F(ZeroCopyTransportTest, AbandonedStreamsLeaveNothingBehind) {
  const HostCache source = Source(300, Layout::kHND);
  absl::StatusOr<TranslateResult> before = kvtd_->client().Translate(Header(source), source);
  ASSERT_TRUE(before.ok()) << before.status();
  for (int trial = 0; trial < 5; ++trial) {
    absl::StatusOr<std::unique_ptr<TranslateStream>> stream =
        kvtd_->client().StartTranslate(Header(source), source);
    ASSERT_TRUE(stream.ok());
    for (int l = 0; l <= trial % 3; ++l) {
      ASSERT_TRUE((*stream)->PushLayer(l, source.k[l].data(), source.v[l].data()).ok());
    }
    stream->reset();  // cancels; waits until gRPC no longer reads `source`
  }
  absl::StatusOr<TranslateResult> after = kvtd_->client().Translate(Header(source), source);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->target.k, before->target.k);
  EXPECT_EQ(after->target.v, before->target.v);
}

}  // namespace
}  // namespace kvt
