// The mapper store: every mapper directory under one root, paged through two tiers with byte
// budgets (host memory, and per device the backend's prepared copy), LRU over unpinned mappers,
// RAII handles that pin what a request uses, hot reload and model control (load / unload).
// A facade over its components: the source (source.h: directory scan, fingerprints, polling),
// the host tier (host_tier.h: host budget, loads, acquire / release, versions) and the device
// tier (device_tier.h: placement, eviction, device pins, streamed page-ins).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "mapper_store/device_tier.h"
#include "mapper_store/host_tier.h"
#include "mapper_store/mapper.h"
#include "mapper_store/source.h"
#include "mapper_store/store_state.h"
#include "mapper_store/store_types.h"

namespace kvt {

class MapperStore;

// Pins one version of one mapper in host memory (and, after MapperStore::PinOnDevice, its
// prepared copy on one device) until destroyed: neither eviction nor hot reload nor unload can
// free what a handle holds, so a request finishes on the version it started with.
// Must not outlive its store. Movable, not copyable.
class MapperHandle {
 public:
  MapperHandle() = default;
  ~MapperHandle() { Release(); }
  MapperHandle(MapperHandle&& other) noexcept { *this = std::move(other); }
  MapperHandle& operator=(MapperHandle&& other) noexcept;
  MapperHandle(const MapperHandle&) = delete;
  MapperHandle& operator=(const MapperHandle&) = delete;

  explicit operator bool() const { return store_ != nullptr; }
  const LoadedMapper& mapper() const { return *mapper_; }
  const std::shared_ptr<const LoadedMapper>& shared_mapper() const { return mapper_; }
  int64_t generation() const;

  // Set once PinOnDevice succeeded, else null / "".
  Backend* backend() const;
  const PreparedMapper* prepared() const;
  const std::string& device() const;
  // Blocks until target layer `target_layer` of the device copy has paged in (streamed page-in)
  // or `deadline` passes (DEADLINE_EXCEEDED). OK at once without a device copy.
  absl::Status WaitLayerReady(int target_layer, absl::Time deadline) const;

  // Unpins now (the destructor does it otherwise).
  void Release();

 private:
  friend class MapperStore;

  MapperStore* store_ = nullptr;
  std::shared_ptr<store_internal::Version> version_;
  std::shared_ptr<const LoadedMapper> mapper_;
  std::shared_ptr<store_internal::DeviceCopy> copy_;
};

// Thread-safe. Disk reads and device page-ins happen outside the lock; a mapper is loaded at
// most once at a time (concurrent requests for a cold mapper wait for the one load).
class MapperStore {
 public:
  // A store over `root` after a first Scan(). NOT_FOUND if `root` is not a directory; mappers
  // that fail to load do not fail Open (they are listed as FAILED).
  static absl::StatusOr<std::unique_ptr<MapperStore>> Open(const std::string& root,
                                                           const StoreOptions& options = {});

  // An empty store; call Scan() to fill it.
  explicit MapperStore(std::string root, StoreOptions options = {});
  // Stops polling and the page-in workers. Every handle must be gone by then.
  ~MapperStore();
  MapperStore(const MapperStore&) = delete;
  MapperStore& operator=(const MapperStore&) = delete;

  const std::string& root() const { return root_; }

  // Reads the root directory. Every subdirectory holding a manifest.yaml is a mapper (names
  // starting with '.' are skipped: WriteMapperDir's temporaries). A directory is "changed" when
  // the size, mtime or inode of its manifest, weights or SHA256SUMS changed since it was last
  // read. New ones are listed (and loaded, see StoreOptions::load_on_scan); changed ones are
  // loaded and validated beside the version in use and swapped in atomically (a changed one
  // that fails validation turns FAILED and stops serving; a FAILED one is retried only when it
  // changes); removed ones are dropped. Requests holding a handle finish on their version,
  // whose memory is freed when the last of them ends. Errors only if the root cannot be
  // listed; per-mapper failures become FAILED entries with the loader's message as reason.
  absl::Status Scan() ABSL_LOCKS_EXCLUDED(scan_mu_, state_.mu);
  // Calls Scan() every `interval` on a background thread until the store is destroyed (hot
  // reload). A second call changes the interval.
  void StartPolling(absl::Duration interval) { poller_.Start(interval); }
  // The error of the last polled Scan() (OK when it succeeded or none ran).
  absl::Status last_poll_status() const { return poller_.last_status(); }

  // Every mapper, sorted by id, FAILED ones included.
  std::vector<MapperInfo> List() const ABSL_LOCKS_EXCLUDED(state_.mu);
  // One mapper's info; NOT_FOUND if unknown.
  absl::StatusOr<MapperInfo> Info(const std::string& mapper_id) const ABSL_LOCKS_EXCLUDED(state_.mu);
  // Budgets and usage, host first, then the devices in StoreOptions order.
  std::vector<TierUsage> Usage() const ABSL_LOCKS_EXCLUDED(state_.mu);
  // Device names in StoreOptions / AddDevice order.
  std::vector<std::string> DeviceNames() const;
  // Adds a device after construction (a server whose store was opened without one).
  // ALREADY_EXISTS if one of that name is there; at most kMaxDevices.
  static constexpr int kMaxDevices = store_internal::DeviceTier::kMaxDevices;
  absl::Status AddDevice(const StoreDevice& device) ABSL_LOCKS_EXCLUDED(state_.mu);
  // Drops every copy on device `name` and stops using it (its backend may then be destroyed),
  // after waiting until `deadline` for requests and page-ins still using it.
  absl::Status RemoveDevice(const std::string& name, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(state_.mu);
  // Replaces StoreOptions::events (e.g. once the metrics exist); {} stops reporting.
  void SetEvents(StoreEvents events) ABSL_LOCKS_EXCLUDED(state_.events_mu);

  // Pins mapper `mapper_id` in host memory, loading it first if needed (evicting unpinned
  // least-recently-used mappers to make room). NOT_FOUND "no mapper with id 'x'";
  // FAILED_PRECONDITION for a FAILED mapper (with its reason) or one larger than the host
  // budget (naming the budget key); RESOURCE_EXHAUSTED when pinned mappers hold the budget
  // past the deadline. With options.device set, also PinOnDevice. Counts a hit.
  absl::StatusOr<MapperHandle> Acquire(const std::string& mapper_id,
                                       const AcquireOptions& options = {})
      ABSL_LOCKS_EXCLUDED(state_.mu);
  // The same for the one servable mapper of a directed pair. NOT_FOUND "no mapper for A -> B"
  // (mentioning a FAILED mapper for the pair, if any); FAILED_PRECONDITION if several serve
  // the pair (ask by id).
  absl::StatusOr<MapperHandle> AcquirePair(const std::string& source_model,
                                           const std::string& target_model,
                                           const AcquireOptions& options = {})
      ABSL_LOCKS_EXCLUDED(state_.mu);
  // Adds a device pin to `handle`: its version's prepared copy on `options.device` ("any" or
  // "" = the device that already holds one, else the one with room and the least load), paged
  // in if absent. A page-in in progress is shared: the handle returns once the copy exists and
  // WaitLayerReady() tells when each layer has arrived. INVALID_ARGUMENT for an unknown device
  // (naming `device`), FAILED_PRECONDITION when the copy is larger than every device budget
  // (naming the budget key), RESOURCE_EXHAUSTED when pinned copies hold the budget past the
  // deadline, FAILED_PRECONDITION without devices.
  absl::Status PinOnDevice(MapperHandle* handle, const AcquireOptions& options)
      ABSL_LOCKS_EXCLUDED(state_.mu);

  // Compatibility with callers that need only the host weights: the returned pointer pins the
  // mapper in host memory while it (or a copy of it) lives. Same errors as Acquire.
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> Get(const std::string& mapper_id)
      ABSL_LOCKS_EXCLUDED(state_.mu);
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> Find(const std::string& source_model,
                                                           const std::string& target_model)
      ABSL_LOCKS_EXCLUDED(state_.mu);

  // Model control. Load: into host memory ("" or "host") or onto a named device (or "any"),
  // then unpinned (resident until evicted). Unload: "" or "host" drops every copy of the
  // mapper (it becomes DISCOVERED and loads again on the next request); a device name drops
  // only that copy. Unload detaches at once (no new request gets the dropped copy) and then
  // waits, until `deadline`, for the requests still holding it; DEADLINE_EXCEEDED if some still
  // do (their copy is freed when they finish). Both return the mapper's info afterwards.
  absl::StatusOr<MapperInfo> Load(const std::string& mapper_id, const std::string& device,
                                  absl::Time deadline) ABSL_LOCKS_EXCLUDED(state_.mu);
  absl::StatusOr<MapperInfo> Unload(const std::string& mapper_id, const std::string& device,
                                    absl::Time deadline) ABSL_LOCKS_EXCLUDED(state_.mu);

 private:
  friend class MapperHandle;

  // Pins the version Acquire / AcquirePair chose, then (with options.device) a device copy.
  // state_.mu is held on entry and on return (let go while a load reads the disk).
  absl::StatusOr<MapperHandle> AcquireLocked(const std::string& mapper_id,
                                             const AcquireOptions& options,
                                             store_internal::Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu);
  // Drops what a gone source directory held and lists the new or changed ones (to read).
  std::vector<std::string> Reconcile(const std::map<std::string, Fingerprint>& present)
      ABSL_LOCKS_EXCLUDED(state_.mu);
  // Lists directory `id` from its manifest; true if Scan should load it now.
  bool Relist(const std::string& id, const Fingerprint& fingerprint)
      ABSL_LOCKS_EXCLUDED(state_.mu);
  void Release(MapperHandle& handle) ABSL_LOCKS_EXCLUDED(state_.mu);

  const std::string root_;
  const StoreOptions options_;
  // Serialises scans, so two concurrent Scan() calls never load one directory twice.
  Mutex scan_mu_ ABSL_ACQUIRED_BEFORE(state_.mu);
  store_internal::StoreState state_;
  store_internal::DeviceTier devices_;
  store_internal::HostTier host_;
  Poller poller_;
};

}  // namespace kvt
