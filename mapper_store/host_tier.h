// The mapper store's host tier, its manager: the host byte budget over loaded versions, loads
// from disk (one at a time per mapper), LRU eviction of unpinned versions, pins (acquire and
// release), and the atomic version swap of a hot reload.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mapper_store/device_tier.h"
#include "mapper_store/mapper.h"
#include "mapper_store/source.h"
#include "mapper_store/store_state.h"
#include "mapper_store/store_types.h"

namespace kvt {
namespace store_internal {

class HostTier : public VersionUnpinner {
 public:
  // Loads directories under `root` with options.load, within options.host_budget_bytes.
  // `devices` frees the device copies of the versions this tier frees.
  HostTier(StoreState* state, DeviceTier* devices, std::string root, const StoreOptions& options);
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // Pins the current version of `mapper_id`, loading it first if needed (evicting unpinned
  // least-recently-used versions to make room) and counting a hit. state->mu is held on entry
  // and on return; it is let go during a disk read. Errors as MapperStore::Acquire.
  absl::StatusOr<std::shared_ptr<Version>> AcquireLocked(const std::string& mapper_id,
                                                         absl::Time deadline, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Scan's load of a new or changed directory. Never waits: a new mapper that does not fit
  // stays DISCOVERED; a changed one may evict others to load beside its old version, and if
  // even that is not possible its stale version stops serving.
  void ScanLoad(const std::string& id) ABSL_LOCKS_EXCLUDED(state_->mu);

  // A handle's unpin: refreshes the version's LRU position, frees it if detached and unpinned.
  void Release(Version& version, Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // A page-in worker's unpin (no LRU refresh).
  void UnpinVersion(Version& version, Aftermath& after) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Stops `entry`'s current version serving (if any); it is freed now if unpinned, else when
  // its last handle goes.
  void DropCurrent(Entry& entry, Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  void DetachVersion(const std::shared_ptr<Version>& version, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);

  // The entry's info with its residency (state, bytes, placements) filled in.
  MapperInfo InfoLocked(const Entry& entry) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  TierUsage Usage() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // NOT_FOUND "no mapper with id 'x' in ROOT".
  absl::Status UnknownMapper(const std::string& mapper_id) const;

  // The store's lock as this tier's annotations name it (for SameLock, store_state.h).
  const Mutex& mu() const ABSL_LOCK_RETURNED(state_->mu) { return state_->mu; }

 private:
  // Reserves `bytes` in the host budget, evicting unpinned LRU versions if `evict`, waiting for
  // room until `deadline`. `who` names the mapper in messages.
  absl::Status Reserve(uint64_t bytes, const std::string& who, bool evict, absl::Time deadline,
                       Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Drops the least recently used unpinned version (and its copies); false if there is none.
  bool EvictLru(Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Loads entry `id`, whose `reserved` bytes are held, from disk with the lock let go (and
  // taken again), then installs or fails the result.
  void LoadReserved(const std::string& id, uint64_t reserved, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  void FinishLoad(const std::string& id, uint64_t reserved, const Fingerprint& fingerprint,
                  absl::StatusOr<std::shared_ptr<const LoadedMapper>> loaded, double seconds,
                  Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // The only place the host budget goes down, by exactly what was added.
  void FreeVersion(Version& version, Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);

  StoreState* const state_;
  DeviceTier* const devices_;
  const std::string root_;
  const LoadOptions load_;
  const uint64_t budget_;  // 0 = no limit
  const std::string budget_key_;
  uint64_t used_ ABSL_GUARDED_BY(state_->mu) = 0;  // loaded versions, retired ones included
  uint64_t reserved_ ABSL_GUARDED_BY(state_->mu) = 0;  // loads in flight
};

}  // namespace store_internal
}  // namespace kvt
