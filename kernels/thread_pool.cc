#include "kernels/thread_pool.h"

#include <algorithm>
#include <thread>

namespace kvt {
namespace {

int64_t PartBegin(int64_t n, int parts, int part) { return n * part / parts; }

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  if (num_threads == 1) return;
  WorkQueue::Options options;
  options.num_threads = num_threads - 1;
  workers_.emplace(options);
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
  MutexLock run_lock(&run_mu_);
  for (int part = 1; part < parts; ++part) {
    workers_->Submit(
        [&fn, n, parts, part] { fn(PartBegin(n, parts, part), PartBegin(n, parts, part + 1)); });
  }
  fn(PartBegin(n, parts, 0), PartBegin(n, parts, 1));
  // run_mu_ keeps other jobs out, so the queue holds this job's parts alone.
  workers_->Drain();
}

}  // namespace kvt
