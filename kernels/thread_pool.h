// A small fixed-size pool for the CPU backend's data-parallel work (token pieces, weight
// conversion): one blocking ParallelFor, the calling thread taking a share.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "common/work_queue.h"

namespace kvt {

class ThreadPool {
 public:
  // `num_threads` is the total parallelism, the caller included (so num_threads - 1 workers).
  // 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return workers_ ? workers_->num_threads() + 1 : 1; }

  // Calls fn(begin, end) on disjoint contiguous ranges covering [0, n), at most num_threads of
  // them and none shorter than `min_grain` items (except when n itself is), and returns when all
  // are done. Concurrent callers are served one after another.
  void ParallelFor(int64_t n, int64_t min_grain, const std::function<void(int64_t, int64_t)>& fn)
      ABSL_LOCKS_EXCLUDED(run_mu_);

 private:
  // Held for a whole ParallelFor: one job at a time, so the queue holds only that job's parts.
  Mutex run_mu_;
  std::optional<WorkQueue> workers_;  // none for a pool of one
};

}  // namespace kvt
