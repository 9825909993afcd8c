// The mapper store: every mapper directory under one root, paged through two tiers with byte
// budgets (host memory, and per device the backend's prepared copy), LRU over unpinned mappers,
// RAII handles that pin what a request uses, hot reload and model control (load / unload).
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"
#include "mapper_store/mapper.h"

namespace kvt {

// Mirrors kvt.v1.MapperState.
enum class MapperState {
  kDiscovered,      // listed (manifest read), weights not in memory: loads on first use
  kLoading,         // first load from disk in progress
  kHostResident,    // weights in host memory
  kDeviceResident,  // and a prepared copy on at least one device
  kFailed,          // failed validation; never serves (state_reason says why)
};
const char* MapperStateName(MapperState state);  // "HOST_RESIDENT", "FAILED", ...

// One place a mapper occupies memory: "host" (the store's copy) or a device ("cpu" for the CPU
// backend's fp32 copy, "cuda:0", ...).
struct Placement {
  std::string device;
  uint64_t bytes = 0;  // what the tier's budget accounts for it
  int pins = 0;        // requests holding it now
  bool ready = true;   // false while a device copy is still paging in
};

// What ListMappers reports for one directory (mirrors kvt.v1.MapperInfo).
struct MapperInfo {
  std::string id;    // directory name
  std::string path;  // directory path
  MapperState state = MapperState::kDiscovered;
  std::string state_reason;  // why FAILED; empty otherwise
  // From the manifest. For a FAILED mapper these are filled when its manifest still parses,
  // else left empty / zero.
  std::string source_model;
  std::string target_model;
  std::string kind;  // "ridge"
  int k = 0;
  bool synthetic = false;
  DType weight_dtype = DType::kBF16;
  ModelSpec source;  // shapes and RoPE of both models
  ModelSpec target;
  // Host bytes of the weights: held when resident, else what a load will take (the weights
  // file); 0 for a FAILED mapper.
  uint64_t weight_bytes = 0;
  int64_t num_params = 0;
  std::vector<std::string> devices;  // where resident: "host", then devices with a ready copy
  std::vector<Placement> placements;  // the same with bytes and pins (host first)
  // Usage: acquisitions (requests served), and when the last one happened.
  uint64_t hits = 0;
  int64_t last_used_unix_ms = 0;  // 0 = never
  uint64_t page_ins = 0;          // copies onto a device
  uint64_t loads = 0;             // reads from disk into host memory (first load, reloads)
  uint64_t evictions = 0;         // copies dropped to make room (host or device)
  int64_t generation = 0;         // versions loaded so far; a hot reload adds one
};

// One device the store pages prepared copies onto.
struct StoreDevice {
  Backend* backend = nullptr;  // named by backend->device(); must outlive the store
  uint64_t budget_bytes = 0;   // 0 = no limit
};

// Hooks for telemetry, called without the store's lock held. `place` is "host" or a device.
struct StoreEvents {
  std::function<void(const LoadedMapper& mapper, const std::string& place, double seconds)>
      page_in;
  std::function<void(const LoadedMapper& mapper, const std::string& place)> eviction;
  // Every acquisition: hit = the copy was already resident (or paging in for someone else).
  std::function<void(const LoadedMapper& mapper, const std::string& place, bool hit)> access;
};

struct StoreOptions {
  LoadOptions load;
  uint64_t host_budget_bytes = 0;  // 0 = no limit
  std::vector<StoreDevice> devices;
  // Scan() loads new and changed mappers that fit the host budget without evicting anything
  // (so broken ones show FAILED at once); the rest load on first use. False: all load lazily.
  bool load_on_scan = true;
  StoreEvents events;
  // How messages name the budgets (kvtd's config keys).
  std::string host_budget_key = "mapper_store.host_budget_bytes";
  std::string device_budget_key = "mapper_store.device_budget_bytes";
};

struct AcquireOptions {
  // How long to wait for a load in progress or for room held by pinned mappers; then
  // DEADLINE_EXCEEDED (load) or RESOURCE_EXHAUSTED (room).
  absl::Time deadline = absl::InfiniteFuture();
  // "": host memory only. "any": a device with room and the least load. Else a device name.
  std::string device;
};

// Per tier: what is accounted against its budget.
struct TierUsage {
  std::string place;          // "host", "cpu", "cuda:0"
  uint64_t budget_bytes = 0;  // 0 = no limit
  uint64_t used_bytes = 0;    // resident copies, pinned or not, including retired versions
  uint64_t reserved_bytes = 0;  // loads / page-ins in flight
  uint64_t pinned_bytes = 0;
  int pins = 0;
};

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
  struct Version;
  struct DeviceCopy;

  MapperStore* store_ = nullptr;
  std::shared_ptr<Version> version_;
  std::shared_ptr<const LoadedMapper> mapper_;
  std::shared_ptr<DeviceCopy> copy_;
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
  absl::Status Scan() ABSL_LOCKS_EXCLUDED(scan_mu_, mu_);
  // Calls Scan() every `interval` on a background thread until the store is destroyed (hot
  // reload). A second call changes the interval.
  void StartPolling(absl::Duration interval) ABSL_LOCKS_EXCLUDED(poll_mu_);
  // The error of the last polled Scan() (OK when it succeeded or none ran).
  absl::Status last_poll_status() const ABSL_LOCKS_EXCLUDED(poll_mu_);

  // Every mapper, sorted by id, FAILED ones included.
  std::vector<MapperInfo> List() const ABSL_LOCKS_EXCLUDED(mu_);
  // One mapper's info; NOT_FOUND if unknown.
  absl::StatusOr<MapperInfo> Info(const std::string& mapper_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Budgets and usage, host first, then the devices in StoreOptions order.
  std::vector<TierUsage> Usage() const ABSL_LOCKS_EXCLUDED(mu_);
  // Device names in StoreOptions / AddDevice order.
  std::vector<std::string> DeviceNames() const;
  // Adds a device after construction (a server whose store was opened without one).
  // ALREADY_EXISTS if one of that name is there; at most kMaxDevices.
  static constexpr int kMaxDevices = 64;
  absl::Status AddDevice(const StoreDevice& device) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every copy on device `name` and stops using it (its backend may then be destroyed),
  // after waiting until `deadline` for requests and page-ins still using it.
  absl::Status RemoveDevice(const std::string& name, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Replaces StoreOptions::events (e.g. once the metrics exist); {} stops reporting.
  void SetEvents(StoreEvents events) ABSL_LOCKS_EXCLUDED(events_mu_);

  // Pins mapper `mapper_id` in host memory, loading it first if needed (evicting unpinned
  // least-recently-used mappers to make room). NOT_FOUND "no mapper with id 'x'";
  // FAILED_PRECONDITION for a FAILED mapper (with its reason) or one larger than the host
  // budget (naming the budget key); RESOURCE_EXHAUSTED when pinned mappers hold the budget
  // past the deadline. With options.device set, also PinOnDevice. Counts a hit.
  absl::StatusOr<MapperHandle> Acquire(const std::string& mapper_id,
                                       const AcquireOptions& options = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same for the one servable mapper of a directed pair. NOT_FOUND "no mapper for A -> B"
  // (mentioning a FAILED mapper for the pair, if any); FAILED_PRECONDITION if several serve
  // the pair (ask by id).
  absl::StatusOr<MapperHandle> AcquirePair(const std::string& source_model,
                                           const std::string& target_model,
                                           const AcquireOptions& options = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // Adds a device pin to `handle`: its version's prepared copy on `options.device` ("any" or
  // "" = the device that already holds one, else the one with room and the least load), paged
  // in if absent. A page-in in progress is shared: the handle returns once the copy exists and
  // WaitLayerReady() tells when each layer has arrived. INVALID_ARGUMENT for an unknown device
  // (naming `device`), FAILED_PRECONDITION when the copy is larger than every device budget
  // (naming the budget key), RESOURCE_EXHAUSTED when pinned copies hold the budget past the
  // deadline, FAILED_PRECONDITION without devices.
  absl::Status PinOnDevice(MapperHandle* handle, const AcquireOptions& options)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Compatibility with callers that need only the host weights: the returned pointer pins the
  // mapper in host memory while it (or a copy of it) lives. Same errors as Acquire.
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> Get(const std::string& mapper_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> Find(const std::string& source_model,
                                                           const std::string& target_model)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Model control. Load: into host memory ("" or "host") or onto a named device (or "any"),
  // then unpinned (resident until evicted). Unload: "" or "host" drops every copy of the
  // mapper (it becomes DISCOVERED and loads again on the next request); a device name drops
  // only that copy. Unload detaches at once (no new request gets the dropped copy) and then
  // waits, until `deadline`, for the requests still holding it; DEADLINE_EXCEEDED if some still
  // do (their copy is freed when they finish). Both return the mapper's info afterwards.
  absl::StatusOr<MapperInfo> Load(const std::string& mapper_id, const std::string& device,
                                  absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<MapperInfo> Unload(const std::string& mapper_id, const std::string& device,
                                    absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class MapperHandle;
  using Version = MapperHandle::Version;
  using DeviceCopy = MapperHandle::DeviceCopy;
  struct Entry;
  struct Device;
  struct Fingerprint;
  // Memory to free and events to report once the lock is released.
  struct Aftermath;

  // The host part of Acquire for a known id (mu_ held on entry, released on return).
  absl::StatusOr<MapperHandle> AcquireLocked(std::unique_lock<std::mutex>& lock,
                                             const std::string& mapper_id,
                                             const AcquireOptions& options, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserves `bytes` in the host budget, evicting unpinned LRU versions if `evict`, waiting
  // for room until `deadline`. `who` names the mapper in messages.
  absl::Status ReserveHost(std::unique_lock<std::mutex>& lock, uint64_t bytes,
                           const std::string& who, bool evict, absl::Time deadline,
                           Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Loads directory `id` from disk, no lock held.
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> LoadFromDisk(const std::string& id) const;
  // Installs or fails a finished load (mu_ held).
  void FinishLoad(const std::string& id, uint64_t reserved, const Fingerprint& fingerprint,
                  absl::StatusOr<std::shared_ptr<const LoadedMapper>> loaded, double seconds,
                  Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Scan's load of one new or changed directory.
  void ScanLoad(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);

  // Stops `version` serving; frees it now if unpinned, else when its last handle goes.
  void DetachVersion(const std::shared_ptr<Version>& version, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DetachCopy(Version& version, int device, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeVersion(Version& version, Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeCopy(DeviceCopy& copy, Aftermath& after) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Picks a device for a new copy of `bytes` (index), or an error.
  absl::StatusOr<int> ChooseDevice(const std::vector<int>& candidates, uint64_t bytes,
                                   const std::string& who, bool* must_wait) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t EvictableDeviceBytes(int device) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictOnDevice(int device, uint64_t bytes, Aftermath& after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The page-in of one copy after BeginPrepare: every layer, on the device's worker.
  void StreamLayers(std::shared_ptr<Version> version, std::shared_ptr<DeviceCopy> copy,
                    absl::Time started) ABSL_LOCKS_EXCLUDED(mu_);

  void Release(MapperHandle& handle) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status WaitLayer(const DeviceCopy& copy, int layer, absl::Time deadline) const
      ABSL_LOCKS_EXCLUDED(mu_);
  MapperInfo InfoLocked(const Entry& entry) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INVALID_ARGUMENT naming `device` unless it is "", "any" or one of the devices.
  absl::Status CheckDevice(const std::string& device) const;
  void Fire(Aftermath& after) ABSL_LOCKS_EXCLUDED(mu_);
  void PollLoop();

  const std::string root_;
  const StoreOptions options_;
  // std mutexes rather than absl::Mutex: the system's absl is not built with ThreadSanitizer, so
  // TSan cannot see absl::Mutex handoffs and reports false races (same choice as
  // kernels/thread_pool.h). The annotations still document which lock guards what.
  // Serialises scans, so two concurrent Scan() calls never load one directory twice.
  std::mutex scan_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // Everything below; one lock for both tiers keeps the accounting consistent and the lock
  // order trivial. Held only for bookkeeping, never across a disk read or a page-in.
  mutable std::mutex mu_;
  // Signalled on every change a waiter could be waiting for (load done, unpin, layer ready).
  mutable std::condition_variable changed_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // Slots [0, num_devices_) are set and never change again, so handles read them without the
  // lock; a Device's accounting fields are guarded by mu_.
  std::array<std::unique_ptr<Device>, kMaxDevices> devices_;
  std::atomic<int> num_devices_{0};
  int num_devices() const { return num_devices_.load(std::memory_order_acquire); }
  mutable std::mutex events_mu_;
  StoreEvents events_ ABSL_GUARDED_BY(events_mu_);
  uint64_t host_used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t host_reserved_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;  // LRU clock

  mutable std::mutex poll_mu_;
  std::condition_variable poll_cv_;
  bool stopping_ ABSL_GUARDED_BY(poll_mu_) = false;
  absl::Duration poll_interval_ ABSL_GUARDED_BY(poll_mu_) = absl::ZeroDuration();
  absl::Status last_poll_status_ ABSL_GUARDED_BY(poll_mu_);
  std::thread poller_;  // started by the first StartPolling, under poll_mu_
};

}  // namespace kvt
