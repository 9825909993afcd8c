#include "common/allocator.h"

#include <malloc.h>

namespace kvt {

void TuneAllocatorForCacheTraffic() {
  mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThresholdBytes));
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimThresholdBytes));
  mallopt(M_ARENA_MAX, kMaxArenas);
}

}  // namespace kvt
