#include "server/compute_executor.h"

#include <utility>

namespace kvt {

ComputeExecutor::ComputeExecutor(int num_threads) {
  if (num_threads < 1) num_threads = 1;
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ComputeExecutor::~ComputeExecutor() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
}

std::future<absl::Status> ComputeExecutor::Submit(std::function<absl::Status()> task) {
  std::packaged_task<absl::Status()> packaged(std::move(task));
  std::future<absl::Status> result = packaged.get_future();
  absl::MutexLock lock(&mutex_);
  queue_.push_back(std::move(packaged));
  return result;
}

size_t ComputeExecutor::queued() const {
  absl::MutexLock lock(&mutex_);
  return queue_.size();
}

void ComputeExecutor::WorkerLoop() {
  while (true) {
    std::packaged_task<absl::Status()> task;
    {
      absl::MutexLock lock(&mutex_);
      mutex_.Await(absl::Condition(
          +[](ComputeExecutor* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mutex_) {
            return self->stopping_ || !self->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace kvt
