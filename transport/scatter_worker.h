// Copies received chunks into their layer buffers on a thread of its own, so the thread that
// reads the stream goes straight back to the socket: on the receive path the copy out of
// gRPC's slices is a third of the work (docs/BENCHMARKS.md, "Transport").
#pragma once

#include <cstdint>
#include <functional>

#include "common/work_queue.h"
#include "transport/chunk_wire.h"
#include "transport/kv_chunks.h"

namespace kvt {

class ScatterWorker {
 public:
  // `max_queued_bytes`: Submit blocks while more than this is queued, so a worker that falls
  // behind holds the reader (and through gRPC's flow control, the sender) instead of letting
  // received slices pile up.
  explicit ScatterWorker(int64_t max_queued_bytes);
  // Finishes every queued copy (they write into buffers the caller is about to free), joins.
  ~ScatterWorker() = default;
  ScatterWorker(const ScatterWorker&) = delete;
  ScatterWorker& operator=(const ScatterWorker&) = delete;

  // Queues ScatterChunkBytes(geometry, start, count, data, layer). `then` (optional) runs on
  // the worker after this copy and every one submitted before it. `data` keeps the received
  // slices alive until the copy is done; `layer` must outlive the worker or the next Drain().
  void Submit(const LayerGeometry& geometry, int64_t start, int64_t count, ChunkBytes data,
              void* layer, std::function<void()> then = nullptr);
  // Returns when every copy submitted so far (and its `then`) has run.
  void Drain() { queue_.Drain(); }

 private:
  WorkQueue queue_;  // one thread: copies and their `then`s run in submission order
};

}  // namespace kvt
