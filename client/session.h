// kvt::TranslateSession: incremental handoffs of one conversation. Each turn sends only the
// tokens added since the previous handoff, at absolute positions continuing where it stopped,
// and appends their translation to the target cache the session keeps.
#pragma once

#include <cstdint>

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
  // layer) at positions [tokens(), tokens() + added.num_tokens) and appends the result to
  // target(). Returns this turn's result (its target holds only the added tokens). The source
  // dtype, layout and shape must stay the same across turns (INVALID_ARGUMENT otherwise).
  absl::StatusOr<TranslateResult> Extend(const HostCache& added);

  // Tokens translated so far; the translated cache of all of them; turns completed.
  int64_t tokens() const { return tokens_; }
  const HostCache& target() const { return target_; }
  uint32_t turns() const { return turns_; }

 private:
  Client* const client_;
  const v1::TranslateHeader base_;
  int64_t tokens_ = 0;
  uint32_t turns_ = 0;
  HostCache source_shape_;  // of the first turn, no buffers
  HostCache target_;
};

}  // namespace kvt
