#include "kernels/thread_pool.h"

#include <algorithm>

namespace kvt {
namespace {

int64_t PartBegin(int64_t n, int parts, int part) { return n * part / parts; }

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::ParallelFor(int64_t n, int64_t min_grain,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  min_grain = std::max<int64_t>(min_grain, 1);
  const int parts =
      static_cast<int>(std::min<int64_t>(num_threads(), n / min_grain));
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    num_parts_ = parts;
    pending_ = parts - 1;
    ++generation_;
  }
  work_cv_.notify_all();
  fn(PartBegin(n, parts, 0), PartBegin(n, parts, 1));
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  fn_ = nullptr;
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    // A job with fewer parts than workers leaves this worker idle (and uncounted).
    if (index >= num_parts_) continue;
    const std::function<void(int64_t, int64_t)>* fn = fn_;
    const int64_t begin = PartBegin(n_, num_parts_, index);
    const int64_t end = PartBegin(n_, num_parts_, index + 1);
    lock.unlock();
    (*fn)(begin, end);
    lock.lock();
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

}  // namespace kvt
