#include "common/work_queue.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace kvt {
namespace {

WorkQueue::Options Threads(int n, int64_t max_queued_cost = 0) {
  WorkQueue::Options options;
  options.num_threads = n;
  options.max_queued_cost = max_queued_cost;
  return options;
}

TEST(WorkQueueTest, OneThreadRunsTasksInSubmissionOrder) {
  WorkQueue queue(Threads(1));
  std::vector<int> order;  // one thread: no race
  for (int i = 0; i < 100; ++i) queue.Submit([i, &order] { order.push_back(i); });
  queue.Drain();
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(WorkQueueTest, ThreadCountIsAtLeastOne) {
  EXPECT_EQ(WorkQueue(Threads(0)).num_threads(), 1);
  EXPECT_EQ(WorkQueue(Threads(-3)).num_threads(), 1);
  EXPECT_EQ(WorkQueue(Threads(3)).num_threads(), 3);
}

// Each task waits for all the others to start: only as many threads as tasks get through.
TEST(WorkQueueTest, ThreadsRunTasksConcurrently) {
  constexpr int kThreads = 3;
  WorkQueue queue(Threads(kThreads));
  std::atomic<int> inside{0}, overlapped{0};
  for (int i = 0; i < kThreads; ++i) {
    queue.Submit([&] {
      ++inside;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (inside < kThreads && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
      if (inside == kThreads) ++overlapped;
    });
  }
  queue.Drain();
  EXPECT_EQ(overlapped, kThreads);
}

TEST(WorkQueueTest, DestructorRunsEveryQueuedTask) {
  std::atomic<int> done{0};
  {
    WorkQueue queue(Threads(1));
    absl::Notification release;
    queue.Submit([&] { release.WaitForNotification(); });
    for (int i = 0; i < 50; ++i) queue.Submit([&] { ++done; });
    EXPECT_GE(queue.queued(), 50u);  // held behind the blocked task
    release.Notify();
  }
  EXPECT_EQ(done.load(), 50);
}

TEST(WorkQueueTest, DrainWaitsForRunningTasksAndCountsOnlyWaitingOnes) {
  WorkQueue queue(Threads(1));
  absl::Notification started, draining;
  std::atomic<bool> finished{false}, drained{false};
  queue.Submit([&] {
    started.Notify();
    // Released once the drainer is on its way into Drain; Drain cannot have returned while
    // this task runs.
    draining.WaitForNotification();
    EXPECT_FALSE(drained.load());
    finished = true;
  });
  queue.Submit([] {});
  started.WaitForNotification();
  EXPECT_EQ(queue.queued(), 1u);  // the running task is not counted
  std::thread drainer([&] {
    draining.Notify();
    queue.Drain();
    drained = true;
    EXPECT_TRUE(finished.load());
    EXPECT_EQ(queue.queued(), 0u);
  });
  drainer.join();
  EXPECT_TRUE(drained.load());
}

// A producer over the cost bound waits until a running task finishes and gives its cost back.
TEST(WorkQueueTest, CostBoundHoldsTheProducer) {
  WorkQueue queue(Threads(1, /*max_queued_cost=*/10));
  absl::Notification producing;
  std::atomic<bool> submitted{false};
  // The first task holds 6 of the 10 until it returns: while it runs, the producer's Submit
  // cannot have returned nor queued its task, however far the producer got.
  queue.Submit(
      [&] {
        producing.WaitForNotification();
        EXPECT_FALSE(submitted.load());
        EXPECT_EQ(queue.queued(), 0u);
      },
      6);
  std::thread producer([&] {
    producing.Notify();
    queue.Submit([] {}, 6);  // 6 + 6 > 10: waits for the first
    submitted = true;
  });
  producer.join();
  EXPECT_TRUE(submitted.load());
  queue.Drain();
}

TEST(WorkQueueTest, TaskOverTheBoundPassesAlone) {
  WorkQueue queue(Threads(1, /*max_queued_cost=*/4));
  std::atomic<int> done{0};
  queue.Submit([&] { ++done; }, 1000);
  queue.Submit([&] { ++done; }, 1000);
  queue.Drain();
  EXPECT_EQ(done.load(), 2);
}

// What a task captured is released before Drain returns (ScatterWorker gives gRPC's slices back
// this way).
TEST(WorkQueueTest, TaskIsDestroyedBeforeDrainReturns) {
  WorkQueue queue(Threads(1));
  auto held = std::make_shared<int>(7);
  std::weak_ptr<int> watch = held;
  queue.Submit([held = std::move(held)] { EXPECT_EQ(*held, 7); });
  queue.Drain();
  EXPECT_TRUE(watch.expired());
}

}  // namespace
}  // namespace kvt
