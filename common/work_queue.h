// The one worker-queue type: a FIFO of tasks served by a fixed set of threads, optionally
// bounded by the cost of what is queued, that finishes every queued task before it is destroyed.
// The CPU backend's ThreadPool, kvtd's ComputeExecutor, the transport's ScatterWorker and the
// mapper store's per-device page-in worker are built on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace kvt {

class WorkQueue {
 public:
  struct Options {
    int num_threads = 1;  // values below 1 mean 1
    // > 0: Submit blocks while the queued (and running) tasks' costs would pass this, so a
    // producer that outruns the workers waits instead of piling up memory. 0: unbounded.
    int64_t max_queued_cost = 0;
  };

  explicit WorkQueue(Options options);
  // Runs every task already queued, then joins the threads.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // Queues `task`; tasks start in submission order. A task whose cost alone passes the bound
  // still goes through (when nothing else is queued), or it would wait forever. A task is
  // destroyed (and whatever it captured released) before its cost is given back.
  void Submit(std::function<void()> task, int64_t cost = 0) ABSL_LOCKS_EXCLUDED(mutex_);

  // Returns when every task submitted so far has run and been destroyed.
  void Drain() ABSL_LOCKS_EXCLUDED(mutex_);

  // Tasks waiting to start (not the running ones).
  size_t queued() const ABSL_LOCKS_EXCLUDED(mutex_);

  int num_threads() const { return static_cast<int>(threads_.size()); }

 private:
  struct Entry {
    std::function<void()> task;
    int64_t cost = 0;
  };
  void Loop() ABSL_LOCKS_EXCLUDED(mutex_);

  const int64_t max_queued_cost_;
  // kvt::Mutex, not absl::Mutex: TSan sees it (common/mutex.h).
  mutable Mutex mutex_;
  CondVar changed_;
  std::deque<Entry> queue_ ABSL_GUARDED_BY(mutex_);
  int64_t queued_cost_ ABSL_GUARDED_BY(mutex_) = 0;  // including the running tasks
  int running_ ABSL_GUARDED_BY(mutex_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> threads_;  // last: they start after the fields they read
};

}  // namespace kvt
