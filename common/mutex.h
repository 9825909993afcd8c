// Annotated mutex, scoped locks and condition variable: clang's thread-safety analysis checks them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"

namespace kvt {

// A std::mutex that clang's analysis can see (libstdc++'s is not annotated). Not absl::Mutex:
// Debian's Abseil is not built with ThreadSanitizer, so TSan cannot see absl::Mutex hand-offs
// and reports false races; std::mutex it intercepts. The API follows absl::Mutex.
class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Tells the analysis the caller holds it (no runtime check: std::mutex has no owner query).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` for its scope, like absl::MutexLock.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A scoped lock that can be let go and taken again (std::unique_lock's unlock()/lock()): for
// code that drops the lock around slow work. Releases it at scope end only if held.
class ABSL_SCOPED_LOCKABLE UniqueLock {
 public:
  explicit UniqueLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~UniqueLock() ABSL_UNLOCK_FUNCTION() {
    if (held_) mu_->Unlock();
  }
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;

  void Unlock() ABSL_UNLOCK_FUNCTION() {
    mu_->Unlock();
    held_ = false;
  }
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    mu_->Lock();
    held_ = true;
  }

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// A condition variable over Mutex, with absl::CondVar's API. Waits may wake spuriously:
// callers loop on their condition, or use Await / AwaitWithDeadline.
class CondVar {
 public:
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // True if `deadline` passed first; InfiniteFuture() waits for a signal.
  bool WaitWithDeadline(Mutex* mu, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // True if `timeout` (on the monotonic clock) passed first.
  bool WaitWithTimeout(Mutex* mu, absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

  // Waits until done(). `done` runs with `mu` held: annotate the lambda with
  // ABSL_EXCLUSIVE_LOCKS_REQUIRED(the mutex) so the analysis checks what it reads.
  template <typename Predicate>
  void Await(Mutex* mu, Predicate done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    while (!done()) Wait(mu);
  }
  // Waits until done() or `deadline`; returns done() (std::condition_variable::wait_until's
  // contract), so a condition that came true as the deadline passed still counts.
  template <typename Predicate>
  bool AwaitWithDeadline(Mutex* mu, absl::Time deadline, Predicate done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    while (!done()) {
      if (WaitWithDeadline(mu, deadline)) return done();
    }
    return true;
  }
  // Waits until done() or `timeout` (monotonic clock, from now); returns done().
  template <typename Predicate>
  bool AwaitWithTimeout(Mutex* mu, absl::Duration timeout, Predicate done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (timeout == absl::InfiniteDuration()) {
      Await(mu, done);
      return true;
    }
    const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
    while (!done()) {
      if (WaitUntil(mu, until)) return done();
    }
    return true;
  }

 private:
  // True if `until` passed first.
  bool WaitUntil(Mutex* mu, std::chrono::steady_clock::time_point until)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  std::condition_variable cv_;
};

}  // namespace kvt
