#include "server/compute_executor.h"

#include <memory>
#include <utility>

namespace kvt {
namespace {

WorkQueue::Options Threads(int num_threads) {
  WorkQueue::Options options;
  options.num_threads = num_threads;
  return options;
}

}  // namespace

ComputeExecutor::ComputeExecutor(int num_threads) : queue_(Threads(num_threads)) {}

std::future<absl::Status> ComputeExecutor::Submit(std::function<absl::Status()> task) {
  // std::function needs a copyable callable; the packaged_task is move-only.
  auto packaged = std::make_shared<std::packaged_task<absl::Status()>>(std::move(task));
  std::future<absl::Status> result = packaged->get_future();
  queue_.Submit([packaged = std::move(packaged)] { (*packaged)(); });
  return result;
}

}  // namespace kvt
