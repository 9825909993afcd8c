// Copies received chunks into their layer buffers on a thread of its own, so the thread that
// reads the stream goes straight back to the socket: on the receive path the copy out of
// gRPC's slices is a third of the work (docs/BENCHMARKS.md, "Transport").
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/base/thread_annotations.h"
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
  ~ScatterWorker();
  ScatterWorker(const ScatterWorker&) = delete;
  ScatterWorker& operator=(const ScatterWorker&) = delete;

  // Queues ScatterChunkBytes(geometry, start, count, data, layer). `then` (optional) runs on
  // the worker after this copy and every one submitted before it. `data` keeps the received
  // slices alive until the copy is done; `layer` must outlive the worker or the next Drain().
  void Submit(const LayerGeometry& geometry, int64_t start, int64_t count, ChunkBytes data,
              void* layer, std::function<void()> then = nullptr);
  // Returns when every copy submitted so far (and its `then`) has run.
  void Drain();

 private:
  struct Task {
    LayerGeometry geometry;
    int64_t start = 0;
    int64_t count = 0;
    ChunkBytes data;
    void* layer = nullptr;
    std::function<void()> then;
  };
  void Loop();

  const int64_t max_queued_bytes_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mutex_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mutex_) = 0;  // including the task being copied
  bool busy_ ABSL_GUARDED_BY(mutex_) = false;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::thread thread_;  // last: starts after the fields it reads
};

}  // namespace kvt
