#include "transport/chunk_wire.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvt {
namespace {

// Protobuf wire types and the field numbers this codec reads without protobuf.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
constexpr int kChunkField = 2;  // TranslateKVRequest.chunk, TranslateKVResponse.chunk
constexpr int kDataField = 5;   // KVChunk.data

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

size_t VarintSize(uint64_t value) {
  size_t size = 1;
  while (value >= 0x80) {
    value >>= 7;
    ++size;
  }
  return size;
}

// Reads a message spread over received slices, whose boundaries fall anywhere (inside a tag,
// a varint, the data).
class Cursor {
 public:
  explicit Cursor(const std::vector<absl::string_view>& spans) : spans_(spans) {
    for (absl::string_view span : spans) size_ += span.size();
  }
  size_t pos() const { return pos_; }
  size_t size() const { return size_; }
  size_t remaining() const { return size_ - pos_; }

  // False when the message ends inside the varint or it is longer than 10 bytes.
  bool ReadVarint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      uint8_t byte;
      if (!ReadByte(&byte)) return false;
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;
  }
  // False (and nothing skipped) when fewer than `n` bytes remain.
  bool Skip(uint64_t n) {
    if (n > remaining()) return false;
    pos_ += n;
    while (n > 0) {
      const size_t here = std::min<uint64_t>(n, spans_[span_].size() - offset_);
      n -= here;
      offset_ += here;
      if (offset_ == spans_[span_].size() && n > 0) NextSpan();
    }
    return true;
  }
  // The spans covering [pos, pos + n) (n <= remaining()); advances past them.
  std::vector<absl::string_view> Take(uint64_t n) {
    std::vector<absl::string_view> out;
    pos_ += n;
    while (n > 0) {
      if (offset_ == spans_[span_].size()) NextSpan();
      const size_t here = std::min<uint64_t>(n, spans_[span_].size() - offset_);
      out.push_back(spans_[span_].substr(offset_, here));
      n -= here;
      offset_ += here;
    }
    return out;
  }

 private:
  bool ReadByte(uint8_t* byte) {
    if (pos_ == size_) return false;
    while (offset_ == spans_[span_].size()) NextSpan();
    *byte = static_cast<uint8_t>(spans_[span_][offset_++]);
    ++pos_;
    return true;
  }
  void NextSpan() {
    ++span_;
    offset_ = 0;
  }

  const std::vector<absl::string_view>& spans_;
  size_t size_ = 0;
  size_t pos_ = 0;     // absolute
  size_t span_ = 0;    // current span
  size_t offset_ = 0;  // inside it
};

enum class FastParse { kDone, kSlowPath, kError };

// The common case read in place: a message holding one KVChunk (field 2) whose data field is
// left in the slices. Anything unusual but valid (a header, a repeated chunk field to merge,
// groups) goes to protobuf's parser instead; kError only for bytes protobuf rejects too.
template <class Proto>
FastParse ParseChunkInPlace(Cursor* in, ChunkMessage<Proto>* message, std::string* error) {
  const std::string type = Proto::descriptor()->name();
  v1::KVChunk* chunk = nullptr;
  std::vector<absl::string_view> data;
  while (in->remaining() > 0) {
    uint64_t tag;
    if (!in->ReadVarint(&tag)) {
      *error = absl::StrCat(type, ": truncated field tag at byte ", in->pos());
      return FastParse::kError;
    }
    if (tag >> 3 != kChunkField || (tag & 7) != kLengthDelimited || chunk != nullptr) {
      return FastParse::kSlowPath;
    }
    uint64_t length;
    if (!in->ReadVarint(&length)) {
      *error = absl::StrCat(type, ".chunk: truncated length");
      return FastParse::kError;
    }
    if (length > in->remaining()) {
      *error = absl::StrCat(type, ".chunk: declares ", length, " bytes but only ",
                            in->remaining(), " remain in the message");
      return FastParse::kError;
    }
    chunk = message->proto.mutable_chunk();
    const size_t end = in->pos() + length;
    while (in->pos() < end) {
      uint64_t field_tag;
      if (!in->ReadVarint(&field_tag) || in->pos() > end) {
        *error = absl::StrCat(type, ".chunk: truncated field tag");
        return FastParse::kError;
      }
      const uint64_t field = field_tag >> 3;
      const int wire_type = static_cast<int>(field_tag & 7);
      if (field == 0) return FastParse::kSlowPath;  // invalid: protobuf words the error
      const bool known = field >= 1 && field <= kDataField;
      if (known && wire_type != (field == kDataField ? kLengthDelimited : kVarint)) {
        return FastParse::kSlowPath;
      }
      uint64_t value = 0;
      switch (wire_type) {
        case kVarint:
          if (!in->ReadVarint(&value) || in->pos() > end) {
            *error = absl::StrCat(type, ".chunk: truncated varint of field ", field);
            return FastParse::kError;
          }
          // Protobuf's own narrowing of a 64-bit varint into a 32-bit field.
          if (field == 1) chunk->set_layer(static_cast<uint32_t>(value));
          if (field == 2) chunk->set_kind(static_cast<v1::CacheKind>(static_cast<int32_t>(value)));
          if (field == 3) chunk->set_token_start(static_cast<uint32_t>(value));
          if (field == 4) chunk->set_token_count(static_cast<uint32_t>(value));
          break;
        case kFixed64:
        case kFixed32:
          if (!in->Skip(wire_type == kFixed64 ? 8 : 4) || in->pos() > end) {
            *error = absl::StrCat(type, ".chunk: truncated fixed-width field ", field);
            return FastParse::kError;
          }
          break;
        case kLengthDelimited: {
          const std::string name = field == kDataField ? "data" : absl::StrCat("field ", field);
          if (!in->ReadVarint(&value) || in->pos() > end) {
            *error = absl::StrCat(type, ".chunk.", name, ": truncated length");
            return FastParse::kError;
          }
          if (value > end - in->pos()) {
            *error = absl::StrCat(type, ".chunk.", name, ": declares ", value,
                                  " bytes but only ", end - in->pos(),
                                  " remain in the chunk");
            return FastParse::kError;
          }
          if (field == kDataField) {
            data = in->Take(value);  // a repeated field: the last one wins, as in protobuf
          } else {
            in->Skip(value);
          }
          break;
        }
        default:  // groups (3, 4) are legal to skip, 6 and 7 are not: protobuf decides
          return FastParse::kSlowPath;
      }
    }
  }
  if (chunk == nullptr) return FastParse::kSlowPath;  // an empty message
  message->data = ChunkBytes(std::move(data), nullptr);
  return FastParse::kDone;
}

}  // namespace

ChunkBytes::ChunkBytes(std::vector<absl::string_view> spans, std::shared_ptr<const void> owner)
    : spans_(std::move(spans)), owner_(std::move(owner)) {
  for (absl::string_view span : spans_) size_ += span.size();
}

void ChunkBytes::CopyTo(size_t offset, size_t length, char* out) const {
  for (absl::string_view span : spans_) {
    if (length == 0) return;
    if (offset >= span.size()) {
      offset -= span.size();
      continue;
    }
    const size_t here = std::min(length, span.size() - offset);
    std::memcpy(out, span.data() + offset, here);
    out += here;
    length -= here;
    offset = 0;
  }
}

std::string ChunkBytes::ToString() const {
  std::string out(size_, '\0');
  CopyTo(0, size_, out.data());
  return out;
}

ChunkBytes ChunkBytesOfLayer(const LayerGeometry& geometry, int64_t start, int64_t count,
                             const char* layer_base, std::shared_ptr<const void> owner) {
  std::vector<absl::string_view> spans;
  for (const auto& [offset, length] : ChunkRanges(geometry, start, count)) {
    spans.emplace_back(layer_base + offset, static_cast<size_t>(length));
  }
  return ChunkBytes(std::move(spans), std::move(owner));
}

void ScatterChunkBytes(const LayerGeometry& geometry, int64_t start, int64_t count,
                       const ChunkBytes& data, void* layer) {
  char* base = static_cast<char*>(layer);
  // Walks the destination ranges and the source spans together: their boundaries need not
  // line up (a received slice may end anywhere).
  const std::vector<absl::string_view>& spans = data.spans();
  size_t span = 0, span_offset = 0;
  for (const auto& [offset, length] : ChunkRanges(geometry, start, count)) {
    char* out = base + offset;
    int64_t left = length;
    while (left > 0) {
      while (span_offset == spans[span].size()) {
        ++span;
        span_offset = 0;
      }
      const size_t here = std::min<size_t>(left, spans[span].size() - span_offset);
      std::memcpy(out, spans[span].data() + span_offset, here);
      out += here;
      left -= static_cast<int64_t>(here);
      span_offset += here;
    }
  }
}

namespace chunk_wire {
namespace {

// What a zero-copy slice holds: a reference to the tensor memory it points into. gRPC drops the
// slice on one of its own threads; `handed_over` makes that hand-off (synchronized inside gRPC,
// which ThreadSanitizer cannot see: Debian's gRPC is not instrumented) visible to TSan as a
// release/acquire pair, so the memory's owner and its freeing are not reported as a race.
struct SliceOwner {
  explicit SliceOwner(std::shared_ptr<const void> memory) : memory(std::move(memory)) {
    handed_over.store(true, std::memory_order_release);
  }
  std::shared_ptr<const void> memory;
  std::atomic<bool> handed_over{false};
};

void ReleaseOwner(void* owner) {
  auto* slice_owner = static_cast<SliceOwner*>(owner);
  (void)slice_owner->handed_over.load(std::memory_order_acquire);
  delete slice_owner;
}

}  // namespace

template <class Proto>
grpc::Status Serialize(const ChunkMessage<Proto>& message, grpc::ByteBuffer* buffer) {
  std::vector<grpc::Slice> slices;
  if (!message.proto.has_chunk() || message.data.empty()) {
    // Headers, trailers, chunks whose data sits in the proto: protobuf's encoding as it is.
    std::string bytes;
    if (!message.proto.SerializeToString(&bytes)) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "message failed to serialize");
    }
    slices.emplace_back(bytes);
  } else {
    if (!message.proto.chunk().data().empty()) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          "chunk data both in the proto and in ChunkMessage.data");
    }
    // Field order as protobuf writes it: KVChunk fields 1-4, then data (5) last, so the bytes
    // equal SerializeToString of the same message with the data inside.
    std::string chunk_head;
    message.proto.chunk().SerializeToString(&chunk_head);
    const uint64_t data_size = message.data.size();
    const uint64_t chunk_size = chunk_head.size() + 1 + VarintSize(data_size) + data_size;
    std::string prefix;
    prefix.push_back(static_cast<char>(kChunkField << 3 | kLengthDelimited));
    AppendVarint(chunk_size, &prefix);
    prefix += chunk_head;
    prefix.push_back(static_cast<char>(kDataField << 3 | kLengthDelimited));
    AppendVarint(data_size, &prefix);
    slices.emplace_back(prefix);
    for (absl::string_view span : message.data.spans()) {
      if (span.empty()) continue;
      // gRPC reads the memory in place until it drops the slice, which drops this reference.
      slices.emplace_back(const_cast<char*>(span.data()), span.size(), &ReleaseOwner,
                          new SliceOwner(message.data.owner()));
    }
  }
  grpc::ByteBuffer encoded(slices.data(), slices.size());
  buffer->Swap(&encoded);
  return grpc::Status::OK;
}

template <class Proto>
void Parse(std::vector<grpc::Slice> slices, ChunkMessage<Proto>* message) {
  message->proto.Clear();
  message->data = ChunkBytes();
  message->error = absl::OkStatus();
  std::vector<absl::string_view> spans;
  spans.reserve(slices.size());
  for (const grpc::Slice& slice : slices) {
    spans.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  Cursor in(spans);
  std::string error;
  switch (ParseChunkInPlace(&in, message, &error)) {
    case FastParse::kDone:
      // The spans point into the received slices: keep them for as long as the data is read.
      message->data = ChunkBytes(message->data.spans(),
                                 std::make_shared<std::vector<grpc::Slice>>(std::move(slices)));
      return;
    case FastParse::kError:
      message->proto.Clear();
      message->error = absl::InvalidArgumentError(error);
      return;
    case FastParse::kSlowPath:
      break;
  }
  message->proto.Clear();
  std::string flat;
  flat.reserve(in.size());
  for (absl::string_view span : spans) flat.append(span.data(), span.size());
  if (!message->proto.ParseFromString(flat)) {
    message->proto.Clear();
    message->error = absl::InvalidArgumentError(
        absl::StrCat(Proto::descriptor()->name(), ": ", flat.size(),
                     " bytes that are not a valid protobuf encoding of the message"));
    return;
  }
  if (message->proto.has_chunk() && !message->proto.chunk().data().empty()) {
    auto owned = std::make_shared<std::string>(std::move(*message->proto.mutable_chunk()->mutable_data()));
    message->proto.mutable_chunk()->clear_data();
    message->data = ChunkBytes({absl::string_view(*owned)}, owned);
  }
}

template grpc::Status Serialize(const TranslateRequestMessage&, grpc::ByteBuffer*);
template grpc::Status Serialize(const TranslateResponseMessage&, grpc::ByteBuffer*);
template void Parse(std::vector<grpc::Slice>, TranslateRequestMessage*);
template void Parse(std::vector<grpc::Slice>, TranslateResponseMessage*);

}  // namespace chunk_wire
}  // namespace kvt
