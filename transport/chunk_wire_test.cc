#include "transport/chunk_wire.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "grpcpp/impl/grpc_library.h"
#include "transport/kv_chunks.h"

namespace kvt {
namespace {

// grpc::Slice calls into gRPC core through a table a channel or server normally installs.
grpc::internal::GrpcLibraryInitializer g_grpc_library;

struct Env : public ::testing::Environment {
  void SetUp() override { g_grpc_library.summon(); }
};
const auto* const g_env = ::testing::AddGlobalTestEnvironment(new Env);

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` cut into slices at random points (some of them empty, many inside varints).
std::vector<grpc::Slice> RandomSlices(const std::string& bytes, std::mt19937* rng,
                                      size_t max_slice) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n = std::uniform_int_distribution<size_t>(0, max_slice)(*rng);
    const size_t take = std::min(n, bytes.size() - at);
    slices.emplace_back(bytes.data() + at, take);
    at += take;
  }
  return slices;
}

std::string RandomBytes(size_t n, std::mt19937* rng) {
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>((*rng)() & 0xff);
  return out;
}

v1::KVChunk RandomChunkFields(std::mt19937* rng) {
  v1::KVChunk chunk;
  // Large values exercise multi-byte varints; zero ones are omitted by protobuf.
  chunk.set_layer((*rng)() % 3 == 0 ? 0 : (*rng)() % 100000);
  chunk.set_kind((*rng)() % 2 == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
  chunk.set_token_start((*rng)() % 2 == 0 ? 0 : (*rng)());
  chunk.set_token_count(1 + (*rng)() % 70000);
  return chunk;
}

TEST(ChunkWire, ChunkEncodingEqualsProtobufs) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::string data = RandomBytes(std::uniform_int_distribution<size_t>(1, 70000)(rng), &rng);
    TranslateResponseMessage message;
    *message.proto.mutable_chunk() = RandomChunkFields(&rng);
    // The data as several spans, as a HND layer gives them.
    std::vector<absl::string_view> spans;
    for (size_t at = 0; at < data.size();) {
      const size_t n = std::min<size_t>(data.size() - at, 1 + rng() % 9000);
      spans.emplace_back(data.data() + at, n);
      at += n;
    }
    message.data = ChunkBytes(spans, nullptr);
    grpc::ByteBuffer buffer;
    ASSERT_TRUE(chunk_wire::Serialize(message, &buffer).ok());

    v1::TranslateKVResponse reference = message.proto;
    reference.mutable_chunk()->set_data(data);
    ASSERT_EQ(Flatten(buffer), reference.SerializeAsString()) << "trial " << trial;
  }
}

TEST(ChunkWire, NonChunkMessagesUseProtobufsEncoding) {
  TranslateRequestMessage request;
  request.proto.mutable_header()->set_mapper_id("bench");
  request.proto.mutable_header()->set_num_tokens(4096);
  request.proto.mutable_header()->add_positions(17);
  grpc::ByteBuffer buffer;
  ASSERT_TRUE(chunk_wire::Serialize(request, &buffer).ok());
  EXPECT_EQ(Flatten(buffer), request.proto.SerializeAsString());

  TranslateRequestMessage parsed;
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(buffer.Dump(&slices).ok());
  chunk_wire::Parse(slices, &parsed);
  ASSERT_TRUE(parsed.error.ok()) << parsed.error;
  EXPECT_EQ(parsed.proto.SerializeAsString(), request.proto.SerializeAsString());
  EXPECT_TRUE(parsed.data.empty());
}

TEST(ChunkWire, ParsesProtobufBytesSplitAnywhere) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    v1::TranslateKVRequest reference;
    *reference.mutable_chunk() = RandomChunkFields(&rng);
    const std::string data = RandomBytes(rng() % 5000, &rng);  // 0: no data field at all
    reference.mutable_chunk()->set_data(data);
    const std::string bytes = reference.SerializeAsString();
    TranslateRequestMessage parsed;
    chunk_wire::Parse(RandomSlices(bytes, &rng, trial % 2 == 0 ? 3 : 700), &parsed);
    ASSERT_TRUE(parsed.error.ok()) << parsed.error;
    EXPECT_TRUE(parsed.proto.chunk().data().empty());
    EXPECT_EQ(parsed.data.ToString(), data);
    v1::TranslateKVRequest rebuilt = parsed.proto;
    rebuilt.mutable_chunk()->set_data(parsed.data.ToString());
    EXPECT_EQ(rebuilt.SerializeAsString(), bytes) << "trial " << trial;
  }
}

// Valid protobuf the in-place reader does not handle itself (the chunk field twice, which
// protobuf merges; unknown fields; a repeated data field) must parse exactly as protobuf does.
TEST(ChunkWire, UnusualValidMessagesParseAsProtobufDoes) {
  v1::TranslateKVRequest first, second;
  first.mutable_chunk()->set_layer(3);
  first.mutable_chunk()->set_data("abc");
  second.mutable_chunk()->set_token_count(9);
  second.mutable_chunk()->set_data("defgh");
  std::string unknown;  // KVChunk field 9 (varint) and field 10 (fixed32)
  unknown += static_cast<char>(9 << 3 | 0);
  unknown += '\x05';
  unknown += static_cast<char>(10 << 3 | 5);
  unknown += std::string(4, '\x01');
  std::string chunk_with_unknown = "\x08\x02" + unknown + "\x2a\x02xy" + "\x2a\x03zzz";
  const std::string inputs[] = {
      first.SerializeAsString() + second.SerializeAsString(),  // merged by protobuf
      std::string("\x12") + static_cast<char>(chunk_with_unknown.size()) + chunk_with_unknown,
  };
  std::mt19937 rng(3);
  for (const std::string& bytes : inputs) {
    v1::TranslateKVRequest reference;
    ASSERT_TRUE(reference.ParseFromString(bytes));
    TranslateRequestMessage parsed;
    chunk_wire::Parse(RandomSlices(bytes, &rng, 4), &parsed);
    ASSERT_TRUE(parsed.error.ok()) << parsed.error;
    EXPECT_EQ(parsed.data.ToString(), reference.chunk().data());
    EXPECT_EQ(parsed.proto.chunk().layer(), reference.chunk().layer());
    EXPECT_EQ(parsed.proto.chunk().token_count(), reference.chunk().token_count());
  }
}

TEST(ChunkWire, TruncatedMessagesAreRejectedNamingTheField) {
  v1::TranslateKVRequest reference;
  reference.mutable_chunk()->set_layer(300);
  reference.mutable_chunk()->set_kind(v1::CACHE_KIND_V);
  reference.mutable_chunk()->set_token_count(200);
  reference.mutable_chunk()->set_data(std::string(1000, 'x'));
  const std::string bytes = reference.SerializeAsString();
  std::mt19937 rng(5);
  for (size_t cut = 1; cut < bytes.size(); ++cut) {
    const std::string truncated = bytes.substr(0, cut);
    v1::TranslateKVRequest by_protobuf;
    EXPECT_FALSE(by_protobuf.ParseFromString(truncated)) << cut;
    TranslateRequestMessage parsed;
    chunk_wire::Parse(RandomSlices(truncated, &rng, 64), &parsed);
    ASSERT_FALSE(parsed.error.ok()) << "cut at " << cut;
    EXPECT_EQ(parsed.error.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.error.message().find("TranslateKVRequest.chunk"), std::string::npos)
        << parsed.error;
  }
  // The outer length is consistent, the data length inside is not.
  std::string inner = std::string("\x08\x01\x2a\xe8\x07", 5) + std::string(10, 'y');
  const std::string lying = std::string("\x12") + static_cast<char>(inner.size()) + inner;
  TranslateRequestMessage parsed;
  chunk_wire::Parse(RandomSlices(lying, &rng, 2), &parsed);
  ASSERT_FALSE(parsed.error.ok());
  EXPECT_EQ(parsed.error.message(),
            "TranslateKVRequest.chunk.data: declares 1000 bytes but only 10 remain in the chunk");
  // Not protobuf at all (wire type 7): protobuf's parser decides, the message says so.
  chunk_wire::Parse({grpc::Slice(std::string("\x12\x02\x0f\x00", 4))}, &parsed);
  EXPECT_EQ(parsed.error.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.error.message().find("TranslateKVRequest: 4 bytes"), std::string::npos)
      << parsed.error;
}

// A layer's chunk sent from the layer in place and received into another layer buffer through
// slices cut anywhere equals the protobuf path (GatherChunk / ScatterChunk), in both layouts.
TEST(ChunkWire, LayerChunksRoundTripInBothLayouts) {
  std::mt19937 rng(13);
  for (Layout layout : {Layout::kHND, Layout::kNHD}) {
    const LayerGeometry geometry{layout, 3, 37, 5, 2};
    const std::string layer = RandomBytes(static_cast<size_t>(geometry.layer_bytes()), &rng);
    std::string received(layer.size(), '\0');
    for (int64_t start = 0; start < geometry.num_tokens;) {
      const int64_t count = std::min<int64_t>(1 + rng() % 11, geometry.num_tokens - start);
      TranslateResponseMessage message;
      message.proto.mutable_chunk()->set_token_start(static_cast<uint32_t>(start));
      message.proto.mutable_chunk()->set_token_count(static_cast<uint32_t>(count));
      message.data = ChunkBytesOfLayer(geometry, start, count, layer.data(), nullptr);
      grpc::ByteBuffer buffer;
      ASSERT_TRUE(chunk_wire::Serialize(message, &buffer).ok());

      std::string expected_data(static_cast<size_t>(geometry.chunk_bytes(count)), '\0');
      GatherChunk(geometry, start, count, layer.data(), expected_data.data());
      v1::TranslateKVResponse reference = message.proto;
      reference.mutable_chunk()->set_data(expected_data);
      const std::string wire = Flatten(buffer);
      ASSERT_EQ(wire, reference.SerializeAsString());

      TranslateResponseMessage parsed;
      chunk_wire::Parse(RandomSlices(wire, &rng, 7), &parsed);
      ASSERT_TRUE(parsed.error.ok()) << parsed.error;
      ASSERT_EQ(parsed.data.size(), expected_data.size());
      ScatterChunkBytes(geometry, start, count, parsed.data, received.data());
      start += count;
    }
    EXPECT_EQ(received, layer) << (layout == Layout::kHND ? "HND" : "NHD");
  }
}

// The sender's memory stays referenced exactly as long as gRPC holds a slice of it.
TEST(ChunkWire, SerializedSlicesKeepTheOwnerAlive) {
  auto owner = std::make_shared<std::string>(4096, 'k');
  std::weak_ptr<std::string> watch = owner;
  TranslateRequestMessage message;
  message.proto.mutable_chunk()->set_token_count(1);
  message.data = ChunkBytes({absl::string_view(*owner).substr(0, 2048),
                             absl::string_view(*owner).substr(2048)},
                            owner);
  auto buffer = std::make_unique<grpc::ByteBuffer>();
  ASSERT_TRUE(chunk_wire::Serialize(message, buffer.get()).ok());
  message = TranslateRequestMessage();
  owner.reset();
  ASSERT_FALSE(watch.expired());  // only the slices hold it now
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(buffer->Dump(&slices).ok());
  buffer.reset();
  EXPECT_FALSE(watch.expired());
  // Read through the slices after the buffer is gone: ASan would flag freed memory.
  TranslateRequestMessage parsed;
  chunk_wire::Parse(slices, &parsed);
  slices.clear();
  ASSERT_TRUE(parsed.error.ok());
  EXPECT_EQ(parsed.data.ToString(), std::string(4096, 'k'));
  parsed = TranslateRequestMessage();
  EXPECT_TRUE(watch.expired());
}

}  // namespace
}  // namespace kvt
