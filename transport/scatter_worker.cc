#include "transport/scatter_worker.h"

#include <utility>

namespace kvt {
namespace {

WorkQueue::Options OneThread(int64_t max_queued_bytes) {
  WorkQueue::Options options;
  options.num_threads = 1;
  options.max_queued_cost = max_queued_bytes;
  return options;
}

}  // namespace

ScatterWorker::ScatterWorker(int64_t max_queued_bytes) : queue_(OneThread(max_queued_bytes)) {}

void ScatterWorker::Submit(const LayerGeometry& geometry, int64_t start, int64_t count,
                           ChunkBytes data, void* layer, std::function<void()> then) {
  const int64_t bytes = static_cast<int64_t>(data.size());
  // The queue destroys the task (giving the slices back to gRPC) before it releases `bytes`.
  queue_.Submit(
      [geometry, start, count, data = std::move(data), layer, then = std::move(then)] {
        ScatterChunkBytes(geometry, start, count, data, layer);
        if (then) then();
      },
      bytes);
}

}  // namespace kvt
