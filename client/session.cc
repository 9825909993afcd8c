#include "client/session.h"

#include <algorithm>
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

// Tokens [from, from + count) of `source` written to tokens [to, to + count) of `dest` (same
// dtype, layers, heads and head_dim; layouts may differ), through chunk form.
void CopyTokens(const HostCache& source, int64_t from, int64_t count, HostCache* dest,
                int64_t to) {
  const LayerGeometry source_geometry = Geometry(source, source.num_tokens);
  const LayerGeometry dest_geometry = Geometry(*dest, dest->num_tokens);
  std::vector<char> chunk(static_cast<size_t>(source_geometry.chunk_bytes(count)));
  for (int layer = 0; layer < source.num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<char>& in = (kind == 0 ? source.k : source.v)[layer];
      std::vector<char>& out = (kind == 0 ? dest->k : dest->v)[layer];
      GatherChunk(source_geometry, from, count, in.data(), chunk.data());
      ScatterChunk(dest_geometry, to, count, chunk.data(), out.data());
    }
  }
}

// An empty cache of `like`'s dtype, layout and shape with `tokens` tokens.
HostCache Shaped(const HostCache& like, int64_t tokens) {
  HostCache cache;
  cache.dtype = like.dtype;
  cache.layout = like.layout;
  cache.num_layers = like.num_layers;
  cache.num_kv_heads = like.num_kv_heads;
  cache.head_dim = like.head_dim;
  cache.num_tokens = tokens;
  cache.Allocate();
  return cache;
}

// Tokens [begin, end) of `cache` as a cache of their own.
HostCache Slice(const HostCache& cache, int64_t begin, int64_t end) {
  HostCache piece = Shaped(cache, end - begin);
  CopyTokens(cache, begin, end - begin, &piece, 0);
  return piece;
}

// `first`'s tokens, then `second`'s (same form).
HostCache Concat(const HostCache& first, const HostCache& second) {
  HostCache joined = Shaped(first, first.num_tokens + second.num_tokens);
  CopyTokens(first, 0, first.num_tokens, &joined, 0);
  CopyTokens(second, 0, second.num_tokens, &joined, first.num_tokens);
  return joined;
}

}  // namespace

TranslateSession::TranslateSession(Client* client, v1::TranslateHeader base)
    : client_(client), base_(std::move(base)) {}

absl::StatusOr<int> TranslateSession::FetchWindow(const std::string& mapper_id) {
  absl::StatusOr<v1::MapperInfo> info = client_->GetMapper(mapper_id);
  if (!info.ok()) {
    return absl::Status(info.status().code(),
                        absl::StrCat("session: GetMapper('", mapper_id,
                                     "') for the mapper's window: ", info.status().message()));
  }
  return std::max<int>(1, static_cast<int>(info->window()));
}

absl::StatusOr<TranslateResult> TranslateSession::Extend(const HostCache& added) {
  const uint32_t turn = turns_ + 1;
  if (added.num_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session: turn ", turn, " adds no tokens (num_tokens ", added.num_tokens,
                     ")"));
  }
  if (turns_ > 0 &&
      (added.dtype != source_shape_.dtype || added.layout != source_shape_.layout ||
       added.num_layers != source_shape_.num_layers ||
       added.num_kv_heads != source_shape_.num_kv_heads ||
       added.head_dim != source_shape_.head_dim)) {
    return absl::InvalidArgumentError(
        "session: the added tokens' dtype, layout, layers, heads and head_dim must match the "
        "first turn's");
  }
  // A named mapper's window is learned before anything is translated.
  if (mapper_id_.empty() && !base_.mapper_id().empty()) {
    absl::StatusOr<int> window = FetchWindow(base_.mapper_id());
    if (!window.ok()) return window.status();
    mapper_id_ = base_.mapper_id();
    window_ = *window;
  }

  // With a window mapper the kept tail goes first, at its own positions.
  const int64_t overlap = tail_.num_tokens;
  HostCache joined;
  if (overlap > 0) joined = Concat(tail_, added);
  const HostCache& request = overlap > 0 ? joined : added;
  v1::TranslateHeader header = base_;
  header.clear_positions();
  header.set_position_offset(static_cast<uint64_t>(tokens_ - overlap));
  header.set_turn(turn);
  absl::StatusOr<TranslateResult> result = client_->Translate(header, request);
  if (!result.ok()) return result.status();
  if (result->target.num_tokens != request.num_tokens) {
    return absl::InternalError(absl::StrCat("session: turn ", turn, " sent ",
                                            request.num_tokens, " tokens and got ",
                                            result->target.num_tokens, " back"));
  }

  // The mapper that served the turn (its id from the response header; the base header's when
  // the server named none) and its window: fetched when it is not the one already known (the
  // first turn of a pair, or a pair that now resolves to another mapper).
  std::string served = result->header.mapper_id();
  if (served.empty()) served = base_.mapper_id();
  int served_window = window_;
  if (!served.empty() && served != mapper_id_) {
    absl::StatusOr<int> window = FetchWindow(served);
    if (!window.ok()) {
      return absl::Status(window.status().code(),
                          absl::StrCat(window.status().message(), " (turn ", turn,
                                       " was translated but is not recorded)"));
    }
    served_window = *window;
    // Exact when the re-sent tokens cover the window or everything before this turn.
    if (served_window - 1 > overlap && overlap < tokens_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session: turn ", turn, " was served by mapper '", served, "' (window ",
          served_window, "), earlier turns by '", mapper_id_, "' (window ", window_,
          "); the turn re-sent ", overlap, " earlier tokens where the window needs ",
          served_window - 1, ", so it would not equal one translation; start a new session"));
    }
  }

  if (overlap > 0) {
    result->target = Slice(result->target, overlap, result->target.num_tokens);
    result->header.set_num_tokens(static_cast<uint32_t>(added.num_tokens));
  }
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
          "session: turn ", turn, " came back in a different target shape (mapper ",
          result->header.mapper_id(), "); start a new session"));
    }
    Append(part, &target_);
  }
  // The next turn's overlap: the last window - 1 source tokens so far (all of them while
  // fewer), which the request ends with.
  const int64_t keep = std::min<int64_t>(served_window - 1, request.num_tokens);
  tail_ = keep > 0 ? Slice(request, request.num_tokens - keep, request.num_tokens) : HostCache();
  if (!served.empty()) mapper_id_ = served;
  window_ = served_window;
  tokens_ += added.num_tokens;
  ++turns_;
  return result;
}

}  // namespace kvt
