// Zero-copy gRPC serialization of the TranslateKV stream messages: a chunk's tensor bytes
// (KVChunk.data) go out as gRPC slices pointing straight into the sender's memory and are
// scattered from the received slices into the destination buffer, so neither side copies them
// through a protobuf string. The bytes on the wire are exactly protobuf's own encoding: peers
// that use the generated protobuf classes (the Python client, grpcurl) see no difference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/impl/serialization_traits.h"
#include "grpcpp/support/slice.h"
#include "grpcpp/support/status.h"
#include "proto/kvt/v1/translate.pb.h"
#include "transport/kv_chunks.h"

namespace kvt {

// The bytes of one KVChunk.data, as spans that stay valid while `owner` lives: received gRPC
// slices, a protobuf string (when a message took the slow path), or the sender's tensor memory.
class ChunkBytes {
 public:
  ChunkBytes() = default;
  // `spans` in wire order; `owner` keeps their memory alive. On send, gRPC holds a reference to
  // `owner` until it has released the last slice made from the spans.
  ChunkBytes(std::vector<absl::string_view> spans, std::shared_ptr<const void> owner);

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const std::vector<absl::string_view>& spans() const { return spans_; }
  const std::shared_ptr<const void>& owner() const { return owner_; }
  // Copies bytes [offset, offset + length) into `out` (the caller checks the range).
  void CopyTo(size_t offset, size_t length, char* out) const;
  std::string ToString() const;

 private:
  std::vector<absl::string_view> spans_;
  std::shared_ptr<const void> owner_;
  size_t size_ = 0;
};

// One TranslateKVRequest or TranslateKVResponse on the stream. `proto` carries every field but
// a chunk's data, which lives in `data` (proto.chunk().data() stays empty). A received message
// that is not valid protobuf is not a transport failure: `error` then says why, naming the
// field, so the reader can end the call with INVALID_ARGUMENT instead of a bare "stream ended".
template <class Proto>
struct ChunkMessage {
  Proto proto;
  ChunkBytes data;
  absl::Status error;
};
using TranslateRequestMessage = ChunkMessage<v1::TranslateKVRequest>;
using TranslateResponseMessage = ChunkMessage<v1::TranslateKVResponse>;

// A chunk of `layer_base` (a whole-layer buffer of `geometry`), tokens [start, start + count),
// without copying: the spans point into the layer (one for NHD, one per head for HND). `owner`
// must keep the layer alive for as long as gRPC may read it.
ChunkBytes ChunkBytesOfLayer(const LayerGeometry& geometry, int64_t start, int64_t count,
                             const char* layer_base, std::shared_ptr<const void> owner);

// The inverse of ChunkBytesOfLayer: copies `data` (exactly geometry.chunk_bytes(count) bytes,
// the caller checks) into tokens [start, start + count) of `layer`. The one copy a received
// tensor byte makes after the kernel's.
void ScatterChunkBytes(const LayerGeometry& geometry, int64_t start, int64_t count,
                       const ChunkBytes& data, void* layer);

namespace chunk_wire {

// Encoding and decoding of ChunkMessage<Proto> (Proto: a message whose field 2 is a KVChunk).
// Exposed for tests; gRPC reaches them through the SerializationTraits below.
template <class Proto>
grpc::Status Serialize(const ChunkMessage<Proto>& message, grpc::ByteBuffer* buffer);
// Never fails for bad bytes: those set message->error. `slices` is the received message.
template <class Proto>
void Parse(std::vector<grpc::Slice> slices, ChunkMessage<Proto>* message);

}  // namespace chunk_wire
}  // namespace kvt

namespace grpc {

template <class Proto>
class SerializationTraits<kvt::ChunkMessage<Proto>, void> {
 public:
  static Status Serialize(const kvt::ChunkMessage<Proto>& message, ByteBuffer* buffer,
                          bool* own_buffer) {
    *own_buffer = true;
    return kvt::chunk_wire::Serialize(message, buffer);
  }
  static Status Deserialize(ByteBuffer* buffer, kvt::ChunkMessage<Proto>* message) {
    std::vector<Slice> slices;
    Status dumped = buffer->Dump(&slices);  // references, no copy
    buffer->Clear();
    if (!dumped.ok()) return dumped;
    kvt::chunk_wire::Parse(std::move(slices), message);
    return Status::OK;
  }
};

}  // namespace grpc
