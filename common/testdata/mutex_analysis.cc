// Compiled by common/mutex_analysis_test.sh with clang -Werror=thread-safety, once as is (must
// compile) and once with -DKVT_BREAK_<CASE> (each must fail): proves the analysis sees kvt::Mutex.
#include "common/mutex.h"

namespace kvt {

class Counter {
 public:
  void Add() ABSL_LOCKS_EXCLUDED(mu_) {
#ifndef KVT_BREAK_UNLOCKED_WRITE
    MutexLock lock(&mu_);
#endif
    ++count_;
    changed_.SignalAll();
  }
  void AwaitAtLeast(int n) ABSL_LOCKS_EXCLUDED(mu_) {
    UniqueLock lock(&mu_);
    changed_.Await(&mu_, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_ >= n; });
    lock.Unlock();
#ifdef KVT_BREAK_READ_AFTER_UNLOCK
    if (count_ < 0) return;
#endif
    lock.Lock();
    AddLocked();
  }
  void Helper() {
#ifdef KVT_BREAK_LOCKED_CALL_UNLOCKED
    AddLocked();
#endif
  }

 private:
  void AddLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { ++count_; }

  Mutex mu_;
  CondVar changed_;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvt
