// The mapper store's device tier: per device a byte budget for prepared copies of mapper
// versions, the choice of a device for a new copy (room, then load), LRU eviction of unpinned
// copies, device pins, and a worker per device that streams each page-in layer by layer.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/work_queue.h"
#include "kernels/backend.h"
#include "mapper_store/store_state.h"
#include "mapper_store/store_types.h"

namespace kvt {
namespace store_internal {

// One device the store pages onto. backend, name and budget never change after Add; the
// accounting fields are guarded by StoreState::mu.
struct Device {
  Backend* backend = nullptr;
  std::string name;
  uint64_t budget = 0;
  uint64_t used = 0;
  uint64_t reserved = 0;
  int pins = 0;  // the load a device choice balances
  std::atomic<bool> removed{false};  // Remove: skipped everywhere, slot kept
  // The page-in worker: one thread streaming page-ins' layers in order. reset() (Remove,
  // StopAll) runs what is queued, then joins; nothing is submitted after (a page-in holds a
  // device pin from before its Submit until it ends, and Remove waits for the pins).
  std::optional<WorkQueue> worker{std::in_place, WorkQueue::Options{}};
};

// What the device tier needs of the host tier: a page-in pins the host version it reads from,
// and unpinning may free that version.
class VersionUnpinner {
 public:
  virtual void UnpinVersion(Version& version, Aftermath& after) = 0;

 protected:
  ~VersionUnpinner() = default;
};

class DeviceTier {
 public:
  static constexpr int kMaxDevices = 64;

  // `budget_key` names the device budget in messages (kvtd's config key).
  DeviceTier(StoreState* state, std::string budget_key)
      : state_(state), budget_key_(std::move(budget_key)) {}
  // Stops the workers (StopAll).
  ~DeviceTier() { StopAll(); }
  DeviceTier(const DeviceTier&) = delete;
  DeviceTier& operator=(const DeviceTier&) = delete;

  // Must be set before the first Pin.
  void set_host(VersionUnpinner* host) { host_ = host; }
  // Lets every page-in worker finish and joins it; the host tier must still exist.
  void StopAll();

  // ALREADY_EXISTS for a second device of one name; at most kMaxDevices.
  absl::Status Add(const StoreDevice& spec) ABSL_LOCKS_EXCLUDED(state_->mu);
  // Waits until `deadline` for requests and page-ins still using device `name`, drops its
  // copies and stops its worker.
  absl::Status Remove(const std::string& name, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(state_->mu);
  // Live devices in Add order.
  std::vector<std::string> Names() const;
  // Index of the live device `name`, or -1.
  int Find(const std::string& name) const;
  // INVALID_ARGUMENT naming `device` unless it is "", "any" or a live device.
  absl::Status CheckDevice(const std::string& device) const;
  // Slots [0, num_devices()) are set and never change again, so they are read without the lock.
  const Device& device(int index) const { return *devices_[index]; }

  // A device pin on a prepared copy of `version` (pinned by the caller) on `device` ("" or
  // "any": the device that already holds one, else the one with room and the least load), paged
  // in if absent. Errors as MapperStore::PinOnDevice.
  absl::StatusOr<std::shared_ptr<DeviceCopy>> Pin(const std::shared_ptr<Version>& version,
                                                  const std::string& device,
                                                  absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(state_->mu);
  // Drops one device pin; frees the copy if it was detached and this was the last.
  void Unpin(DeviceCopy& copy, Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Blocks until `layer` of `copy` is ready, its page-in failed, or `deadline` passes.
  absl::Status WaitLayer(const DeviceCopy& copy, int layer, absl::Time deadline) const
      ABSL_LOCKS_EXCLUDED(state_->mu);

  // Stops `version`'s copy on `device` serving; frees it now if unpinned.
  void DetachCopy(Version& version, int device, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // The only place a device budget goes down, by exactly what was added.
  void FreeCopy(DeviceCopy& copy, Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);

  // `version`'s started copies as placements; names the devices with a ready copy.
  void AddPlacements(const Version& version, MapperInfo* info) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // One TierUsage per live device.
  void AppendUsage(std::vector<TierUsage>* usage) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);

  // The store's lock as this tier's annotations name it (for SameLock, store_state.h).
  const Mutex& mu() const ABSL_LOCK_RETURNED(state_->mu) { return state_->mu; }

 private:
  int num_devices() const { return num_devices_.load(std::memory_order_acquire); }
  // The devices a pin on `device` may use; INVALID_ARGUMENT for an unknown name.
  absl::StatusOr<std::vector<int>> Candidates(const std::string& device) const;
  // Waits for an existing (or paging) copy and pins it; OK with a null copy when there is none.
  // The lock is held on return (the caller lets it go and fires `after`).
  absl::StatusOr<std::shared_ptr<DeviceCopy>> ShareCopy(Version& version,
                                                        const std::vector<int>& candidates,
                                                        absl::Time deadline, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Picks a device for a new copy of `bytes` (index), or an error.
  absl::StatusOr<int> Choose(const std::vector<int>& candidates, uint64_t bytes,
                             const std::string& who, bool* must_wait) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // A new copy on `device`: reserves and prepares (the lock let go meanwhile, held again on
  // return). On success the caller lets the lock go, fires `after` and submits
  // StreamLayers(version, copy, *started) to the device's worker.
  absl::StatusOr<std::shared_ptr<DeviceCopy>> StartCopy(const std::shared_ptr<Version>& version,
                                                        int device, Aftermath& after,
                                                        absl::Time* started)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  uint64_t EvictableBytes(int device) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Detaches unpinned LRU copies on `device` until `bytes` more fit its budget (or none is left).
  void EvictFor(int device, uint64_t bytes, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // The page-in of one copy after BeginPrepare: every layer, on the device's worker.
  void StreamLayers(std::shared_ptr<Version> version, std::shared_ptr<DeviceCopy> copy,
                    absl::Time started) ABSL_LOCKS_EXCLUDED(state_->mu);

  StoreState* const state_;
  const std::string budget_key_;
  VersionUnpinner* host_ = nullptr;
  std::array<std::unique_ptr<Device>, kMaxDevices> devices_;
  std::atomic<int> num_devices_{0};
};

}  // namespace store_internal
}  // namespace kvt
