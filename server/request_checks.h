// Checks shared by the streaming RPCs (TranslateKV, ValidateKV): the header fields both carry
// (dtype, layout, token count, positions, mapper or pair) and inline KV chunks, each error
// naming the offending request field, so both RPCs reject bad input with the same words.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/repeated_field.h"
#include "kernels/backend.h"
#include "kernels/types.h"
#include "mapper_store/store.h"
#include "proto/kvt/v1/common.pb.h"
#include "transport/kv_chunks.h"

namespace kvt {

// The source-cache description of a header. `positions` points into the header's repeated
// field when explicit positions were sent: keep the header alive while it is used.
struct InputHeader {
  DType dtype = DType::kFP32;
  Layout layout = Layout::kHND;
  int64_t num_tokens = 0;
  Positions positions;
};

// header.dtype and header.layout set; 0 < header.num_tokens <= max_tokens
// (RESOURCE_EXHAUSTED naming limits.max_tokens above it); header.positions either empty or one
// per token, and exclusive with header.position_offset; offset + num_tokens within 64 bits.
absl::StatusOr<InputHeader> CheckInputHeader(
    v1::DType dtype, v1::Layout layout, uint32_t num_tokens, uint64_t position_offset,
    const google::protobuf::RepeatedField<uint64_t>& positions, int64_t max_tokens);
template <typename Header>  // TranslateHeader, ValidateHeader
absl::StatusOr<InputHeader> CheckInputHeader(const Header& header, int64_t max_tokens) {
  return CheckInputHeader(header.dtype(), header.layout(), header.num_tokens(),
                          header.position_offset(), header.positions(), max_tokens);
}

// The mapper a header names, pinned in host memory (loaded first if it is not resident):
// header.mapper_id (and, if also set, the pair must agree with it) or header.source_model +
// header.target_model. `options` bounds the wait for a load or for room.
absl::StatusOr<MapperHandle> AcquireMapper(MapperStore* store, const std::string& mapper_id,
                                           const std::string& source_model,
                                           const std::string& target_model,
                                           const AcquireOptions& options);
template <typename Header>
absl::StatusOr<MapperHandle> AcquireMapper(MapperStore* store, const Header& header,
                                           const AcquireOptions& options) {
  return AcquireMapper(store, header.mapper_id(), header.source_model(), header.target_model(),
                       options);
}

// The same as a shared pointer that holds the pin while it lives.
absl::StatusOr<std::shared_ptr<const LoadedMapper>> ResolveMapper(
    MapperStore* store, const std::string& mapper_id, const std::string& source_model,
    const std::string& target_model);
template <typename Header>
absl::StatusOr<std::shared_ptr<const LoadedMapper>> ResolveMapper(MapperStore* store,
                                                                  const Header& header) {
  return ResolveMapper(store, header.mapper_id(), header.source_model(), header.target_model());
}

// What the chunks of one cache must look like.
struct ChunkExpectation {
  std::string field;       // how errors name the chunk: "chunk", "chunk.chunk"
  std::string model_name;  // for messages
  int num_layers = 0;
  LayerGeometry geometry;  // heads, tokens (header.num_tokens), head_dim, element size
  DType dtype = DType::kFP32;
  bool keys_only = false;  // queries: only CACHE_KIND_K is valid
};

// Layer in range, kind K or V (K only if keys_only), token_count > 0, tokens within
// header.num_tokens, data size exact. Returns the kind index: 0 = K, 1 = V.
absl::StatusOr<int> CheckChunk(const v1::KVChunk& chunk, const ChunkExpectation& expect);
// The same for a chunk whose data travels outside the proto (transport/chunk_wire.h).
absl::StatusOr<int> CheckChunk(const v1::KVChunk& chunk, int64_t data_size,
                               const ChunkExpectation& expect);

}  // namespace kvt
