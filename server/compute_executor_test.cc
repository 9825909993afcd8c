#include "server/compute_executor.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(ComputeExecutorTest, RunsTasksInOrderAndReturnsTheirStatus) {
  ComputeExecutor executor(1);
  std::vector<int> order;
  std::vector<std::future<absl::Status>> results;
  for (int i = 0; i < 20; ++i) {
    results.push_back(executor.Submit([i, &order] {
      order.push_back(i);  // single worker: no race
      return i == 7 ? absl::InternalError("seven") : absl::OkStatus();
    }));
  }
  for (int i = 0; i < 20; ++i) {
    absl::Status status = results[i].get();
    EXPECT_EQ(status.ok(), i != 7) << i;
  }
  for (int i = 0; i < 20; ++i) EXPECT_EQ(order[i], i);
}

TEST(ComputeExecutorTest, DestructorFinishesQueuedWork) {
  std::atomic<int> done{0};
  {
    ComputeExecutor executor(2);
    for (int i = 0; i < 50; ++i) {
      executor.Submit([&done] {
        done.fetch_add(1);
        return absl::OkStatus();
      });
    }
  }
  EXPECT_EQ(done.load(), 50);
}

}  // namespace
}  // namespace kvt
