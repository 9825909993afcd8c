// Step 3 of a TranslateKV: the inline source chunks read off the request stream (through a
// reader function, so it runs without gRPC), each checked, its tokens recorded in a
// CoverageTracker and scattered into its layer buffer (on a ScatterWorker for large uploads),
// with a signal per source (layer, K|V) once every byte of it is in.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "server/request_checks.h"
#include "server/translate/request_plan.h"
#include "transport/chunk_wire.h"
#include "transport/kv_chunks.h"
#include "transport/scatter_worker.h"

namespace kvt {

class ChunkIntake {
 public:
  // Most received chunk bytes waiting for a request's ScatterWorker.
  static constexpr int64_t kAsyncScatterQueueBytes = 64ll << 20;

  // `layer(l, kind)`: the buffer source (layer l, kind 0=K / 1=V) is scattered into; it must
  // outlive this object. `arrived(l, kind)` (optional) runs once every byte of it has landed
  // (on the scatter worker's thread when there is one). Uploads of at least
  // `async_scatter_min_bytes` (> 0) bytes copy on a worker thread of their own.
  ChunkIntake(const TranslatePlan& plan, std::function<char*(int, int)> layer,
              std::function<void(int, int)> arrived, int64_t async_scatter_min_bytes);

  // Reads messages until the stream ends or `stop()` turns true; the first bad message ends it
  // with INVALID_ARGUMENT naming the field. Every copy has landed when this returns.
  absl::Status ReadAll(const RequestReader& read, const std::function<bool()>& stop);
  // INVALID_ARGUMENT naming the first gap unless every source token has arrived.
  absl::Status CheckComplete() const;

 private:
  absl::Status Take(TranslateRequestMessage* message);

  const TranslatePlan& plan_;
  const std::function<char*(int, int)> layer_;
  const std::function<void(int, int)> arrived_;
  CoverageTracker coverage_;
  const ChunkExpectation expectation_;
  std::optional<ScatterWorker> scatter_worker_;
};

}  // namespace kvt
