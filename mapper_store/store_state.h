// The bookkeeping the mapper store's tiers share under one lock: an entry per mapper directory,
// its loaded versions and their device copies, and what to free and report once the lock is
// released. Internal to mapper_store (host_tier, device_tier, store); callers use store.h.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "kernels/backend.h"
#include "mapper_store/format/manifest.h"
#include "mapper_store/mapper.h"
#include "mapper_store/source.h"
#include "mapper_store/store_types.h"

namespace kvt {
namespace store_internal {

// One device's prepared copy of one version (every field guarded by StoreState::mu).
struct DeviceCopy {
  int device = 0;
  std::shared_ptr<PreparedMapper> prepared;  // set once BeginPrepare returned
  uint64_t reserved = 0;  // the estimate held in the device's budget while BeginPrepare runs
  uint64_t bytes = 0;     // accounted in the device's budget once started
  int num_layers = 0;
  int layers_ready = 0;
  bool started = false;  // BeginPrepare returned OK
  bool paging = true;    // until every layer is ready or the page-in failed
  absl::Status error;    // the page-in failed: never used
  int pins = 0;          // handles, plus the page-in worker while paging
  uint64_t last_use = 0;
  bool detached = false;  // evicted / unloaded / replaced: freed when unpinned
  bool freed = false;
};

// One loaded version of one mapper directory (every field guarded by StoreState::mu).
struct Version {
  std::string id;
  int64_t generation = 0;
  std::shared_ptr<const LoadedMapper> mapper;
  uint64_t bytes = 0;  // accounted in the host budget
  int pins = 0;        // handles, plus page-in workers
  uint64_t last_use = 0;
  bool detached = false;  // no longer the entry's current version: freed when unpinned
  bool freed = false;
  std::map<int, std::shared_ptr<DeviceCopy>> copies;  // by device index
};

// One mapper directory (guarded by StoreState::mu).
struct Entry {
  // Manifest fields, FAILED state and reason, usage counters. The residency fields are
  // computed by HostTier::InfoLocked.
  MapperInfo info;
  Fingerprint fingerprint;            // of the files last read
  std::shared_ptr<Version> current;   // null unless host resident
  bool loading = false;               // a load (first, or a reload beside current) in flight
  uint64_t expected_bytes = 0;        // what a load reserves: the weights file's data
};

// Memory to free and events to report once the lock is released.
struct Aftermath {
  struct Event {
    std::shared_ptr<const LoadedMapper> mapper;
    std::string place;
    double seconds = 0;
    bool hit = false;
  };
  std::vector<Event> page_ins, evictions, accesses;
  // Dropped last, outside the lock: freeing gigabytes takes a while.
  std::vector<std::shared_ptr<const LoadedMapper>> mappers;
  std::vector<std::shared_ptr<PreparedMapper>> prepared;
};

// What both tiers share. One lock for both keeps the accounting consistent and the lock order
// trivial; it is held only for bookkeeping, never across a disk read or a page-in.
struct StoreState {
  explicit StoreState(StoreEvents initial_events) : events(std::move(initial_events)) {}

  // kvt::Mutex (common/mutex.h): TSan sees it, and clang's analysis (--config=tsa) checks
  // the annotations. The fields of Entry, Version and DeviceCopy are guarded by it too, which
  // the analysis cannot see (they are reached through the maps and shared_ptrs below).
  mutable Mutex mu;
  // Signalled on every change a waiter could be waiting for (load done, unpin, layer ready).
  mutable CondVar changed;
  std::map<std::string, Entry> entries ABSL_GUARDED_BY(mu);
  uint64_t tick ABSL_GUARDED_BY(mu) = 0;  // LRU clock

  mutable Mutex events_mu;
  StoreEvents events ABSL_GUARDED_BY(events_mu);

  // Reports `after`'s events and frees its memory; call without `mu` held.
  void Fire(Aftermath& after) ABSL_LOCKS_EXCLUDED(mu, events_mu);
};

// The store's one lock under the name another component's annotations give it, for a scope.
// The analysis compares lock expressions, so it cannot tell that the facade's state_.mu and a
// tier's state_->mu (HostTier::mu(), DeviceTier::mu()) are one mutex. SameLock says so after
// checking it at run time (one address); `held` must be held (Held() checks that statically):
//   SameLock host_lock(Held(state_.mu), host_.mu());
class ABSL_SCOPED_LOCKABLE SameLock {
 public:
  SameLock(const Mutex& held, const Mutex& alias) ABSL_EXCLUSIVE_LOCK_FUNCTION(alias);
  ~SameLock() ABSL_UNLOCK_FUNCTION() {}
  SameLock(const SameLock&) = delete;
  SameLock& operator=(const SameLock&) = delete;
};
// `mu`, which the caller must hold (not an annotation on SameLock's constructor: clang reads
// that as "adopts the lock" and would drop `held` at the scope's end).
inline const Mutex& Held(const Mutex& mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return mu; }

// One wait for a change (an unpin, a finished load), at most until `deadline`; callers loop.
void WaitOnce(CondVar& changed, Mutex* mu, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

// The manifest's fields of a MapperInfo.
void FillFromManifest(const Manifest& manifest, MapperInfo* info);

// "1048576 bytes (1.0 MiB)", for budget messages.
std::string Bytes(uint64_t bytes);

}  // namespace store_internal
}  // namespace kvt
