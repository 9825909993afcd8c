#include "quality/input_shift_cache.h"

#include <iterator>
#include <optional>

#include "common/logging.h"

namespace kvt {

std::shared_ptr<const InputShiftStats> InputShiftCache::Get(
    const std::shared_ptr<const LoadedMapper>& mapper) {
  MutexLock lock(&mutex_);
  auto it = stats_.find(mapper.get());
  if (it != stats_.end() && it->second.first.lock() == mapper) return it->second.second;
  for (auto old = stats_.begin(); old != stats_.end();) {
    old = old->second.first.expired() ? stats_.erase(old) : std::next(old);
  }
  std::shared_ptr<const InputShiftStats> stats;
  absl::StatusOr<std::optional<InputShiftStats>> built = InputShiftStats::FromMapper(*mapper);
  if (!built.ok()) {
    KVT_LOG(kWarning, "mapper statistics unusable: no input-shift score")
        .With("mapper", mapper->id())
        .With("error", built.status().message());
  } else if (built->has_value()) {
    stats = std::make_shared<const InputShiftStats>(std::move(**built));
  }
  stats_[mapper.get()] = {mapper, stats};
  return stats;
}

}  // namespace kvt
