// kvt::TranslateSession: incremental handoffs of one conversation. Each turn sends the tokens
// added since the previous handoff, at absolute positions continuing where it stopped, and
// appends their translation to the target cache the session keeps.
//
// The pieces equal one translation of the whole sequence for every mapper:
//  * A token-wise mapper (MapperInfo.window 1, or 0 from an older server; SPEC 3) maps each
//    token on its own, so a turn sends only its added tokens.
//  * A window mapper (window w > 1; docs/MAPPER_FORMAT.md, "Window mappers") maps token p from
//    the source cache of tokens p, p-1, ..., p-w+1 of the same request. The session therefore
//    keeps the last w-1 source tokens of the turns so far (host memory, in the source's dtype
//    and layout), sends them again in front of each later turn's added tokens (at their own
//    positions: position_offset = tokens() - kept) and drops their outputs, so every output
//    token sees the same w-1 predecessors as in one request. A turn shorter than w-1 tokens is
//    fine: the kept tail then spans several turns.
//
// Every response header names the window of the mapper version that served it
// (TranslateResponseHeader.window), so the session needs no extra RPC: a turn keeps the last
// window - 1 source tokens for the next one. Each turn's window is checked against the overlap
// it carried, so a later turn served with a larger window (a pair re-resolved to another mapper
// after a store reload, or a mapper hot-reloaded under the same id) is refused when the overlap
// was too short for it (FAILED_PRECONDITION, the session unchanged: start a new session). A
// server older than that field reports 0; the window then comes from GetMapper, once per mapper
// the responses name.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "proto/kvt/v1/translate.pb.h"

namespace kvt {

class TranslateSession {
 public:
  // `base` names the pair or mapper, the output dtype/layout and the session id; its token
  // count, positions and turn are set per call. `client` must outlive the session.
  TranslateSession(Client* client, v1::TranslateHeader base);

  // Translates `added` (the source cache of the tokens appended since the last call, every
  // layer, at least one token) at positions [tokens(), tokens() + added.num_tokens) and appends
  // the result to target(). Returns this turn's result: its target holds only the added
  // tokens' translation and header.num_tokens their count; the trailer is the server's for the
  // request as sent, so with a window mapper its num_tokens and input_bytes include the window
  // - 1 re-sent tokens. The source dtype, layout and shape must stay the same across turns
  // (INVALID_ARGUMENT otherwise). On any error the session is unchanged (the turn may be
  // retried).
  absl::StatusOr<TranslateResult> Extend(const HostCache& added);

  // Tokens translated so far; the translated cache of all of them; turns completed.
  int64_t tokens() const { return tokens_; }
  const HostCache& target() const { return target_; }
  uint32_t turns() const { return turns_; }
  // The window of the mapper that served the session (1 until it is known: token-wise) and the
  // source tokens kept for the next turn's overlap (min(window - 1, tokens())).
  int window() const { return window_; }
  int64_t kept_tokens() const { return tail_.num_tokens; }

 private:
  // GetMapper(mapper_id).window, 0 read as 1 (servers older than the response's window).
  absl::StatusOr<int> FetchWindow(const std::string& mapper_id);
  // The window of the version that served `result`; `turn` names it in errors.
  absl::StatusOr<int> ServedWindow(const TranslateResult& result, const std::string& served,
                                   uint32_t turn);

  Client* const client_;
  const v1::TranslateHeader base_;
  int64_t tokens_ = 0;
  uint32_t turns_ = 0;
  HostCache source_shape_;  // of the first turn, no buffers
  HostCache target_;
  // The mapper that served the last turn ("" before the first) and its window.
  std::string mapper_id_;
  int window_ = 1;
  // The last min(window_ - 1, tokens_) source tokens (no buffers when none).
  HostCache tail_;
};

}  // namespace kvt
