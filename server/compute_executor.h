// Runs translation work (GEMMs) on a fixed set of compute threads, one queue per backend device,
// so gRPC handler threads only move bytes and slow translations cannot starve health checks or
// new streams, and the cores are not oversubscribed by concurrent BLAS calls.
#pragma once

#include <functional>
#include <future>

#include "absl/status/status.h"
#include "common/work_queue.h"

namespace kvt {

class ComputeExecutor {
 public:
  explicit ComputeExecutor(int num_threads);
  ~ComputeExecutor() = default;  // finishes queued work, then joins
  ComputeExecutor(const ComputeExecutor&) = delete;
  ComputeExecutor& operator=(const ComputeExecutor&) = delete;

  std::future<absl::Status> Submit(std::function<absl::Status()> task);

  // Tasks waiting (not running).
  size_t queued() const { return queue_.queued(); }

 private:
  WorkQueue queue_;
};

}  // namespace kvt
