#include "kernels/thread_pool.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvt {
namespace {

// Every index is visited exactly once, in at most num_threads ranges of at least min_grain.
TEST(ThreadPoolTest, CoversEveryIndexOnce) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 2, 5, 17, 1000}) {
      for (int64_t grain : {1, 4, 100}) {
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int> ranges{0};
        pool.ParallelFor(n, grain, [&](int64_t begin, int64_t end) {
          ++ranges;
          EXPECT_LT(begin, end);
          if (end - begin < grain) {
            EXPECT_EQ(end - begin, n);  // only when n itself is short
          }
          for (int64_t i = begin; i < end; ++i) ++hits[i];
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << i;
        EXPECT_LE(ranges, threads);
      }
    }
  }
}

TEST(ThreadPoolTest, RunsOnSeveralThreads) {
  ThreadPool pool(2);
  std::atomic<int> inside{0}, overlapped{0};
  pool.ParallelFor(2, 1, [&](int64_t, int64_t) {
    // Each range waits briefly for the other: only true parallelism sees both inside.
    ++inside;
    for (int spin = 0; spin < 1000000 && inside < 2; ++spin) std::this_thread::yield();
    if (inside == 2) ++overlapped;
  });
  EXPECT_EQ(overlapped, 2);
}

TEST(ThreadPoolTest, ConcurrentCallersAreSerialisedCorrectly) {
  ThreadPool pool(2);
  std::atomic<int64_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int round = 0; round < 50; ++round) {
        pool.ParallelFor(100, 1, [&](int64_t begin, int64_t end) { total += end - begin; });
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(total, 4 * 50 * 100);
}

// 0 means std::thread::hardware_concurrency() (thread_pool.h), at least 1: the pool has exactly
// that many threads, and a job of that many parts runs on that many distinct threads.
TEST(ThreadPoolTest, ZeroMeansEveryCore) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int expected = cores > 0 ? cores : 1;
  ThreadPool pool(0);
  EXPECT_EQ(pool.num_threads(), expected);
  std::mutex mu;
  std::set<std::thread::id> threads;
  std::atomic<int> ranges{0};
  std::atomic<int> inside{0};
  pool.ParallelFor(expected, 1, [&](int64_t begin, int64_t end) {
    ++ranges;
    EXPECT_EQ(end - begin, 1);
    {
      std::lock_guard<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
    }
    // Each range waits for the others to start, so no thread can run two of them: the pool
    // must have `expected` threads that run at once.
    ++inside;
    for (int spin = 0; spin < 10000000 && inside < expected; ++spin) std::this_thread::yield();
  });
  EXPECT_EQ(ranges, expected);
  EXPECT_EQ(static_cast<int>(threads.size()), expected);
}

}  // namespace
}  // namespace kvt
