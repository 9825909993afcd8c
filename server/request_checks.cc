#include "server/request_checks.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "transport/proto_convert.h"
#include "common/echo.h"

namespace kvt {

absl::StatusOr<InputHeader> CheckInputHeader(
    v1::DType dtype, v1::Layout layout, uint32_t num_tokens, uint64_t position_offset,
    const google::protobuf::RepeatedField<uint64_t>& positions, int64_t max_tokens) {
  InputHeader out;
  absl::StatusOr<DType> input_dtype = DTypeFromProto(dtype, "header.dtype");
  if (!input_dtype.ok()) return input_dtype.status();
  absl::StatusOr<Layout> input_layout = LayoutFromProto(layout, "header.layout");
  if (!input_layout.ok()) return input_layout.status();
  out.dtype = *input_dtype;
  out.layout = *input_layout;
  if (num_tokens == 0) return absl::InvalidArgumentError("header.num_tokens must be > 0");
  if (num_tokens > max_tokens) {
    return absl::ResourceExhaustedError(
        absl::StrCat("header.num_tokens=", num_tokens, " exceeds limits.max_tokens=", max_tokens,
                     "; split the cache into several requests (with a window mapper each "
                     "after the first starting MapperInfo.window - 1 tokens early)"));
  }
  out.num_tokens = num_tokens;
  if (positions.size() > 0) {
    if (static_cast<uint32_t>(positions.size()) != num_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("header.positions has ", positions.size(),
                                                     " entries but header.num_tokens=",
                                                     num_tokens));
    }
    if (position_offset != 0) {
      return absl::InvalidArgumentError(
          "header.position_offset and header.positions are exclusive: set one");
    }
    out.positions.explicit_positions = positions.data();
  } else {
    if (position_offset > UINT64_MAX - num_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.position_offset=", position_offset,
                       " + num_tokens overflows a 64-bit position"));
    }
    out.positions.offset = position_offset;
  }
  return out;
}

absl::StatusOr<MapperHandle> AcquireMapper(MapperStore* store, const std::string& mapper_id,
                                           const std::string& source_model,
                                           const std::string& target_model,
                                           const AcquireOptions& options) {
  if (mapper_id.empty()) {
    if (source_model.empty() || target_model.empty()) {
      return absl::InvalidArgumentError(
          "header.source_model and header.target_model (or header.mapper_id) are required");
    }
    return store->AcquirePair(source_model, target_model, options);
  }
  absl::StatusOr<MapperHandle> handle = store->Acquire(mapper_id, options);
  if (!handle.ok()) return handle.status();
  const MapperView& view = handle->mapper().view();
  if ((!source_model.empty() && source_model != view.source.name) ||
      (!target_model.empty() && target_model != view.target.name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.mapper_id='", Echo(mapper_id), "' maps ", view.source.name, " -> ", view.target.name,
        ", not header.source_model='", Echo(source_model), "' -> header.target_model='", Echo(target_model),
        "'"));
  }
  return handle;
}

absl::StatusOr<std::shared_ptr<const LoadedMapper>> ResolveMapper(
    MapperStore* store, const std::string& mapper_id, const std::string& source_model,
    const std::string& target_model) {
  absl::StatusOr<MapperHandle> handle =
      AcquireMapper(store, mapper_id, source_model, target_model, AcquireOptions());
  if (!handle.ok()) return handle.status();
  auto holder = std::make_shared<MapperHandle>(std::move(*handle));
  return std::shared_ptr<const LoadedMapper>(holder, &holder->mapper());
}

absl::StatusOr<int> CheckChunk(const v1::KVChunk& chunk, const ChunkExpectation& expect) {
  return CheckChunk(chunk, static_cast<int64_t>(chunk.data().size()), expect);
}

absl::StatusOr<int> CheckChunk(const v1::KVChunk& chunk, int64_t data_size,
                               const ChunkExpectation& expect) {
  const std::string& f = expect.field;
  if (chunk.layer() >= static_cast<uint32_t>(expect.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat(f, ".layer=", chunk.layer(),
                                                   " out of range: ", expect.model_name,
                                                   " has ", expect.num_layers, " layers"));
  }
  if (expect.keys_only ? chunk.kind() != v1::CACHE_KIND_K
                       : chunk.kind() != v1::CACHE_KIND_K && chunk.kind() != v1::CACHE_KIND_V) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ".kind must be CACHE_KIND_K", expect.keys_only ? "" : " or CACHE_KIND_V",
                     " (layer ", chunk.layer(), ")"));
  }
  if (chunk.token_count() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(f, ".token_count must be > 0 (layer ", chunk.layer(), ")"));
  }
  const int64_t end =
      static_cast<int64_t>(chunk.token_start()) + static_cast<int64_t>(chunk.token_count());
  if (end > expect.geometry.num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        f, ".token_start=", chunk.token_start(), " + ", f, ".token_count=", chunk.token_count(),
        " exceeds header.num_tokens=", expect.geometry.num_tokens));
  }
  const int kind = chunk.kind() == v1::CACHE_KIND_K ? 0 : 1;
  const int64_t expected = expect.geometry.chunk_bytes(chunk.token_count());
  if (data_size != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        f, ".data has ", data_size, " bytes, expected ", expected, " (layer ",
        chunk.layer(), " ", kind == 0 ? "K" : "V", ", ", expect.geometry.num_heads, " heads x ",
        chunk.token_count(), " tokens x ", expect.geometry.head_dim, " dims x ",
        DTypeSize(expect.dtype), " bytes of ", DTypeName(expect.dtype), ")"));
  }
  return kind;
}

}  // namespace kvt
