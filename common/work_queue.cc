#include "common/work_queue.h"

#include <algorithm>
#include <utility>

namespace kvt {

WorkQueue::WorkQueue(Options options) : max_queued_cost_(options.max_queued_cost) {
  const int num_threads = std::max(1, options.num_threads);
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { Loop(); });
}

WorkQueue::~WorkQueue() {
  {
    MutexLock lock(&mutex_);
    stopping_ = true;
    changed_.SignalAll();
  }
  for (std::thread& thread : threads_) thread.join();
}

void WorkQueue::Submit(std::function<void()> task, int64_t cost) {
  MutexLock lock(&mutex_);
  while (max_queued_cost_ > 0 && queued_cost_ > 0 && queued_cost_ + cost > max_queued_cost_) {
    changed_.Wait(&mutex_);
  }
  queue_.push_back(Entry{std::move(task), cost});
  queued_cost_ += cost;
  changed_.SignalAll();
}

void WorkQueue::Drain() {
  MutexLock lock(&mutex_);
  while (!queue_.empty() || running_ > 0) changed_.Wait(&mutex_);
}

size_t WorkQueue::queued() const {
  MutexLock lock(&mutex_);
  return queue_.size();
}

void WorkQueue::Loop() {
  UniqueLock lock(&mutex_);
  while (true) {
    while (queue_.empty() && !stopping_) changed_.Wait(&mutex_);
    if (queue_.empty()) return;  // stopping, and every queued task has run
    Entry entry = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    lock.Unlock();
    entry.task();
    entry.task = nullptr;  // releases what it captured before its cost is given back
    lock.Lock();
    --running_;
    queued_cost_ -= entry.cost;
    changed_.SignalAll();
  }
}

}  // namespace kvt
