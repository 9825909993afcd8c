// Input-shift statistics per loaded mapper version, built once from the mapper's tensors and
// shared by every RPC that scores inputs (TranslateKV's trailer, LookupPrefix's gate).
#pragma once

#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "mapper_store/mapper.h"
#include "quality/input_shift.h"

namespace kvt {

class InputShiftCache {
 public:
  // The statistics of `mapper`; null when it carries none, or when they are malformed (logged
  // once per mapper version: malformed statistics cost the mapper its score, not its
  // translations). Weak keys: the cache never keeps a mapper the store has evicted alive.
  std::shared_ptr<const InputShiftStats> Get(const std::shared_ptr<const LoadedMapper>& mapper)
      ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  Mutex mutex_;  // kvt::Mutex: TSan sees it, unlike Debian's absl::Mutex
  std::map<const LoadedMapper*,
           std::pair<std::weak_ptr<const LoadedMapper>, std::shared_ptr<const InputShiftStats>>>
      stats_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvt
