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
    absl::MutexLock lock(&mu_);
    stop_ = true;
    work_cv_.SignalAll();
  }
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
  absl::MutexLock run_lock(&run_mu_);
  {
    absl::MutexLock lock(&mu_);
    fn_ = &fn;
    n_ = n;
    num_parts_ = parts;
    pending_ = parts - 1;
    ++generation_;
    work_cv_.SignalAll();
  }
  fn(PartBegin(n, parts, 0), PartBegin(n, parts, 1));
  absl::MutexLock lock(&mu_);
  while (pending_ > 0) done_cv_.Wait(&mu_);
  fn_ = nullptr;
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  mu_.Lock();
  while (true) {
    while (!stop_ && generation_ == seen) work_cv_.Wait(&mu_);
    if (stop_) break;
    seen = generation_;
    // A job with fewer parts than workers leaves this worker idle (and uncounted).
    if (index >= num_parts_) continue;
    const std::function<void(int64_t, int64_t)>* fn = fn_;
    const int64_t begin = PartBegin(n_, num_parts_, index);
    const int64_t end = PartBegin(n_, num_parts_, index + 1);
    mu_.Unlock();
    (*fn)(begin, end);
    mu_.Lock();
    if (--pending_ == 0) done_cv_.Signal();
  }
  mu_.Unlock();
}

}  // namespace kvt
