#include "transport/scatter_worker.h"

#include <utility>

namespace kvt {

ScatterWorker::ScatterWorker(int64_t max_queued_bytes)
    : max_queued_bytes_(max_queued_bytes), thread_([this] { Loop(); }) {}

ScatterWorker::~ScatterWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void ScatterWorker::Submit(const LayerGeometry& geometry, int64_t start, int64_t count,
                           ChunkBytes data, void* layer, std::function<void()> then) {
  const int64_t bytes = static_cast<int64_t>(data.size());
  std::unique_lock<std::mutex> lock(mutex_);
  // One chunk larger than the bound still goes through (alone), or it would wait forever.
  changed_.wait(lock, [&] {
    return queued_bytes_ == 0 || queued_bytes_ + bytes <= max_queued_bytes_;
  });
  queue_.push_back(Task{geometry, start, count, std::move(data), layer, std::move(then)});
  queued_bytes_ += bytes;
  lock.unlock();
  changed_.notify_all();
}

void ScatterWorker::Drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

void ScatterWorker::Loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return !queue_.empty() || stopping_; });
    if (queue_.empty()) return;  // stopping, and every queued copy is done
    Task task = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    ScatterChunkBytes(task.geometry, task.start, task.count, task.data, task.layer);
    if (task.then) task.then();
    const int64_t bytes = static_cast<int64_t>(task.data.size());
    task.data = ChunkBytes();  // gives the slices back to gRPC now
    lock.lock();
    busy_ = false;
    queued_bytes_ -= bytes;
    changed_.notify_all();
  }
}

}  // namespace kvt
