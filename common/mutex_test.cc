#include "common/mutex.h"

#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(MutexTest, MutexLockExcludesOtherThreads) {
  Mutex mu;
  int64_t count = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        MutexLock lock(&mu);
        ++count;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(count, 40000);
}

TEST(MutexTest, UniqueLockLetsGoAndRetakes) {
  Mutex mu;
  UniqueLock lock(&mu);
  lock.Unlock();
  // Another thread can take it only if it was really released.
  std::thread other([&] { MutexLock inner(&mu); });
  other.join();
  lock.Lock();
}

TEST(CondVarTest, WaitWithDeadlineTimesOut) {
  Mutex mu;
  CondVar cv;
  MutexLock lock(&mu);
  const absl::Time start = absl::Now();
  EXPECT_TRUE(cv.WaitWithDeadline(&mu, start + absl::Milliseconds(20)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(19));
}

TEST(CondVarTest, WaitWithTimeoutTimesOut) {
  Mutex mu;
  CondVar cv;
  MutexLock lock(&mu);
  EXPECT_TRUE(cv.WaitWithTimeout(&mu, absl::Milliseconds(10)));
}

TEST(CondVarTest, AwaitWithDeadlineSeesTheSignalledCondition) {
  Mutex mu;
  CondVar cv;
  bool ready = false;
  absl::Notification locked;
  // The setter takes `mu` only once the waiter has let go of it, i.e. from inside the wait.
  std::thread setter([&] {
    locked.WaitForNotification();
    MutexLock lock(&mu);
    ready = true;
    cv.SignalAll();
  });
  {
    MutexLock lock(&mu);
    locked.Notify();
    EXPECT_TRUE(cv.AwaitWithDeadline(&mu, absl::InfiniteFuture(), [&] { return ready; }));
  }
  setter.join();
}

TEST(CondVarTest, AwaitWithDeadlineReportsAFalseConditionAtTheDeadline) {
  Mutex mu;
  CondVar cv;
  MutexLock lock(&mu);
  EXPECT_FALSE(
      cv.AwaitWithDeadline(&mu, absl::Now() + absl::Milliseconds(5), [] { return false; }));
  EXPECT_FALSE(cv.AwaitWithDeadline(&mu, absl::InfinitePast(), [] { return false; }));
}

TEST(CondVarTest, AwaitReturnsOnceTheConditionHolds) {
  Mutex mu;
  CondVar cv;
  int stage = 0;
  std::thread bumper([&] {
    for (int i = 0; i < 3; ++i) {
      MutexLock lock(&mu);
      ++stage;
      cv.Signal();
    }
  });
  {
    MutexLock lock(&mu);
    cv.Await(&mu, [&] { return stage == 3; });
    EXPECT_EQ(stage, 3);
  }
  bumper.join();
}

}  // namespace
}  // namespace kvt
