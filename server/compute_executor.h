// Runs translation work (GEMMs) on a fixed set of compute threads, one queue per backend device,
// so gRPC handler threads only move bytes and slow translations cannot starve health checks or
// new streams, and the cores are not oversubscribed by concurrent BLAS calls.
#pragma once

#include <deque>
#include <functional>
#include <future>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include <condition_variable>
#include <mutex>


namespace kvt {

class ComputeExecutor {
 public:
  explicit ComputeExecutor(int num_threads);
  ~ComputeExecutor();  // finishes queued work, then joins
  ComputeExecutor(const ComputeExecutor&) = delete;
  ComputeExecutor& operator=(const ComputeExecutor&) = delete;

  std::future<absl::Status> Submit(std::function<absl::Status()> task);

  // Tasks waiting (not running).
  size_t queued() const;

 private:
  void WorkerLoop();

  // std::mutex: TSan sees it (Debian's absl is not TSan-instrumented).
  mutable std::mutex mutex_;
  std::condition_variable work_available_;
  std::deque<std::packaged_task<absl::Status()>> queue_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvt
