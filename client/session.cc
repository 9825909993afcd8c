#include "client/session.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "host_cache/host_cache.h"

namespace kvt {

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

absl::StatusOr<int> TranslateSession::ServedWindow(const TranslateResult& result,
                                                   const std::string& served, uint32_t turn) {
  if (result.header.window() > 0) return static_cast<int>(result.header.window());
  // A server older than the response's window: its mapper's window, fetched once per mapper.
  if (served.empty() || served == mapper_id_) return window_;
  absl::StatusOr<int> window = FetchWindow(served);
  if (!window.ok()) {
    return absl::Status(window.status().code(),
                        absl::StrCat(window.status().message(), " (turn ", turn,
                                     " was translated but is not recorded)"));
  }
  return window;
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
  // With a window mapper the kept tail goes first, at its own positions.
  const int64_t overlap = tail_.num_tokens;
  HostCache joined;
  if (overlap > 0) joined = ConcatTokens(tail_, added);
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
  // the server named none) and the window of the version that served it.
  std::string served = result->header.mapper_id();
  if (served.empty()) served = base_.mapper_id();
  absl::StatusOr<int> served_window = ServedWindow(*result, served, turn);
  if (!served_window.ok()) return served_window.status();
  // Exact when the re-sent tokens cover the window or everything before this turn.
  if (*served_window - 1 > overlap && overlap < tokens_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session: turn ", turn, " was served by mapper '", served, "' with window ",
        *served_window, ", earlier turns by '", mapper_id_, "' with window ", window_,
        " (another mapper, or the same one reloaded); the turn re-sent ", overlap,
        " earlier tokens where the window needs ", *served_window - 1,
        ", so it would not equal one translation; start a new session"));
  }

  if (overlap > 0) {
    result->target = SliceTokens(result->target, overlap, result->target.num_tokens);
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
    target_ = ConcatTokens(target_, part);
  }
  // The next turn's overlap: the last window - 1 source tokens so far (all of them while
  // fewer), which the request ends with.
  const int64_t keep = std::min<int64_t>(*served_window - 1, request.num_tokens);
  tail_ = keep > 0 ? SliceTokens(request, request.num_tokens - keep, request.num_tokens)
                   : HostCache();
  if (!served.empty()) mapper_id_ = served;
  window_ = *served_window;
  tokens_ += added.num_tokens;
  ++turns_;
  return result;
}

}  // namespace kvt
