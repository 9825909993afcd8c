#include "client/session.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "transport/kv_chunks.h"

namespace kvt {
namespace {

LayerGeometry Geometry(const HostCache& cache, int64_t tokens) {
  return LayerGeometry{cache.layout, cache.num_kv_heads, tokens, cache.head_dim,
                       static_cast<int64_t>(DTypeSize(cache.dtype))};
}

// `whole` (tokens [0, old)) grown by `part` (tokens [old, old + part.num_tokens)). In HND a
// layer is [heads, tokens, dim], so appending tokens re-strides every head: chunk form (the
// wire's token-range layout) is the common ground for both layouts.
void Append(const HostCache& part, HostCache* whole) {
  const int64_t old_tokens = whole->num_tokens;
  const int64_t new_tokens = old_tokens + part.num_tokens;
  const LayerGeometry old_geometry = Geometry(*whole, old_tokens);
  const LayerGeometry new_geometry = Geometry(*whole, new_tokens);
  const LayerGeometry part_geometry = Geometry(part, part.num_tokens);
  std::vector<char> chunk;
  for (int layer = 0; layer < whole->num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      std::vector<char>& buffer = (kind == 0 ? whole->k : whole->v)[layer];
      const std::vector<char>& added = (kind == 0 ? part.k : part.v)[layer];
      std::vector<char> grown(static_cast<size_t>(new_geometry.layer_bytes()));
      chunk.resize(static_cast<size_t>(old_geometry.chunk_bytes(old_tokens)));
      GatherChunk(old_geometry, 0, old_tokens, buffer.data(), chunk.data());
      ScatterChunk(new_geometry, 0, old_tokens, chunk.data(), grown.data());
      chunk.resize(static_cast<size_t>(part_geometry.chunk_bytes(part.num_tokens)));
      GatherChunk(part_geometry, 0, part.num_tokens, added.data(), chunk.data());
      ScatterChunk(new_geometry, old_tokens, part.num_tokens, chunk.data(), grown.data());
      buffer = std::move(grown);
    }
  }
  whole->num_tokens = new_tokens;
}

}  // namespace

TranslateSession::TranslateSession(Client* client, v1::TranslateHeader base)
    : client_(client), base_(std::move(base)) {}

absl::StatusOr<TranslateResult> TranslateSession::Extend(const HostCache& added) {
  if (turns_ > 0 &&
      (added.dtype != source_shape_.dtype || added.layout != source_shape_.layout ||
       added.num_layers != source_shape_.num_layers ||
       added.num_kv_heads != source_shape_.num_kv_heads ||
       added.head_dim != source_shape_.head_dim)) {
    return absl::InvalidArgumentError(
        "session: the added tokens' dtype, layout, layers, heads and head_dim must match the "
        "first turn's");
  }
  v1::TranslateHeader header = base_;
  header.clear_positions();
  header.set_position_offset(static_cast<uint64_t>(tokens_));
  header.set_turn(turns_ + 1);
  absl::StatusOr<TranslateResult> result = client_->Translate(header, added);
  if (!result.ok()) return result.status();
  if (turns_ == 0) {
    source_shape_.dtype = added.dtype;
    source_shape_.layout = added.layout;
    source_shape_.num_layers = added.num_layers;
    source_shape_.num_kv_heads = added.num_kv_heads;
    source_shape_.head_dim = added.head_dim;
    target_ = result->target;
  } else {
    const HostCache& part = result->target;
    if (part.dtype != target_.dtype || part.layout != target_.layout ||
        part.num_layers != target_.num_layers || part.num_kv_heads != target_.num_kv_heads ||
        part.head_dim != target_.head_dim) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session: turn ", turns_ + 1, " came back in a different target shape (mapper ",
          result->header.mapper_id(), "); start a new session"));
    }
    Append(part, &target_);
  }
  tokens_ += added.num_tokens;
  ++turns_;
  return result;
}

}  // namespace kvt
