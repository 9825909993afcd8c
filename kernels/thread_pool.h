// A small fixed-size pool for the CPU backend's data-parallel work (token pieces, weight
// conversion): one blocking ParallelFor, the calling thread taking a share.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace kvt {

class ThreadPool {
 public:
  // `num_threads` is the total parallelism, the caller included (so num_threads - 1 workers).
  // 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) on disjoint contiguous ranges covering [0, n), at most num_threads of
  // them and none shorter than `min_grain` items (except when n itself is), and returns when all
  // are done. Concurrent callers are served one after another.
  void ParallelFor(int64_t n, int64_t min_grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  // std::mutex rather than absl::Mutex: the system's absl is not built with ThreadSanitizer,
  // which then cannot see absl::Mutex's synchronisation and reports every handoff as a race.
  std::mutex run_mu_;  // held for a whole ParallelFor: one job at a time
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  const std::function<void(int64_t, int64_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t n_ ABSL_GUARDED_BY(mu_) = 0;
  int num_parts_ ABSL_GUARDED_BY(mu_) = 0;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvt
