#include "server/compute_executor.h"

#include <utility>

namespace kvt {

ComputeExecutor::ComputeExecutor(int num_threads) {
  if (num_threads < 1) num_threads = 1;
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ComputeExecutor::~ComputeExecutor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_available_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

std::future<absl::Status> ComputeExecutor::Submit(std::function<absl::Status()> task) {
  std::packaged_task<absl::Status()> packaged(std::move(task));
  std::future<absl::Status> result = packaged.get_future();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(std::move(packaged));
  }
  work_available_.notify_one();
  return result;
}

size_t ComputeExecutor::queued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size();
}

void ComputeExecutor::WorkerLoop() {
  while (true) {
    std::packaged_task<absl::Status()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_available_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace kvt
