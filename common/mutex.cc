#include "common/mutex.h"

namespace kvt {

// Each wait adopts the already-held std::mutex for the duration of the call and hands it back
// still locked, so ownership stays with the caller's MutexLock / UniqueLock.

void CondVar::Wait(Mutex* mu) {
  std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
  cv_.wait(lock);
  lock.release();
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) {  // ToChronoTime would overflow wait_until
    Wait(mu);
    return false;
  }
  std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
  const bool timed_out =
      cv_.wait_until(lock, absl::ToChronoTime(deadline)) == std::cv_status::timeout;
  lock.release();
  return timed_out;
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  if (timeout == absl::InfiniteDuration()) {
    Wait(mu);
    return false;
  }
  return WaitUntil(mu, std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout));
}

bool CondVar::WaitUntil(Mutex* mu, std::chrono::steady_clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
  const bool timed_out = cv_.wait_until(lock, until) == std::cv_status::timeout;
  lock.release();
  return timed_out;
}

}  // namespace kvt
