#include "mapper_store/store.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "mapper_store/format/manifest.h"

namespace kvt {

using store_internal::Aftermath;
using store_internal::DeviceCopy;
using store_internal::Entry;
using store_internal::Held;
using store_internal::SameLock;
using store_internal::Version;

// --- MapperHandle ---

MapperHandle& MapperHandle::operator=(MapperHandle&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = other.store_;
    version_ = std::move(other.version_);
    mapper_ = std::move(other.mapper_);
    copy_ = std::move(other.copy_);
    other.store_ = nullptr;
  }
  return *this;
}

int64_t MapperHandle::generation() const { return version_ ? version_->generation : 0; }

Backend* MapperHandle::backend() const {
  return copy_ ? store_->devices_.device(copy_->device).backend : nullptr;
}

const PreparedMapper* MapperHandle::prepared() const { return copy_ ? copy_->prepared.get() : nullptr; }

const std::string& MapperHandle::device() const {
  static const std::string* const kNone = new std::string();
  return copy_ ? store_->devices_.device(copy_->device).name : *kNone;
}

absl::Status MapperHandle::WaitLayerReady(int target_layer, absl::Time deadline) const {
  if (!copy_) return absl::OkStatus();
  return store_->devices_.WaitLayer(*copy_, target_layer, deadline);
}

void MapperHandle::Release() {
  if (store_ == nullptr) return;
  store_->Release(*this);
  store_ = nullptr;
  copy_.reset();
  version_.reset();
  mapper_.reset();
}

// --- MapperStore: lifetime and devices ---

absl::StatusOr<std::unique_ptr<MapperStore>> MapperStore::Open(const std::string& root,
                                                               const StoreOptions& options) {
  auto store = std::make_unique<MapperStore>(root, options);
  if (absl::Status s = store->Scan(); !s.ok()) return s;
  return store;
}

MapperStore::MapperStore(std::string root, StoreOptions options)
    : root_(std::move(root)),
      options_(std::move(options)),
      state_(options_.events),
      devices_(&state_, options_.device_budget_key),
      host_(&state_, &devices_, root_, options_),
      poller_([this] { return Scan(); }) {
  devices_.set_host(&host_);
  for (const StoreDevice& spec : options_.devices) AddDevice(spec).IgnoreError();
}

MapperStore::~MapperStore() {
  poller_.Stop();
  // Before the host tier goes: a page-in's last step unpins its host version.
  devices_.StopAll();
}

absl::Status MapperStore::AddDevice(const StoreDevice& device) { return devices_.Add(device); }

absl::Status MapperStore::RemoveDevice(const std::string& name, absl::Time deadline) {
  return devices_.Remove(name, deadline);
}

std::vector<std::string> MapperStore::DeviceNames() const { return devices_.Names(); }

void MapperStore::SetEvents(StoreEvents events) {
  MutexLock lock(&state_.events_mu);
  state_.events = std::move(events);
}

// --- Scanning and hot reload: the source's directories into the host tier ---

absl::Status MapperStore::Scan() {
  MutexLock scan_lock(&scan_mu_);
  absl::StatusOr<std::map<std::string, Fingerprint>> present = ScanMapperDirectories(root_);
  if (!present.ok()) return present.status();
  for (const std::string& id : Reconcile(*present)) {
    if (Relist(id, present->at(id))) host_.ScanLoad(id);
  }
  return absl::OkStatus();
}

std::vector<std::string> MapperStore::Reconcile(
    const std::map<std::string, Fingerprint>& present) {
  std::vector<std::string> to_read;  // new or changed
  Aftermath after;
  {
    MutexLock lock(&state_.mu);
    SameLock host_lock(Held(state_.mu), host_.mu());
    for (auto it = state_.entries.begin(); it != state_.entries.end();) {
      if (present.count(it->first) > 0) {
        ++it;
        continue;
      }
      // Removed: in-flight requests keep their version; the memory goes when they finish.
      if (it->second.current) host_.DetachVersion(it->second.current, after);
      it = state_.entries.erase(it);
    }
    for (const auto& [id, fingerprint] : present) {
      auto it = state_.entries.find(id);
      if (it == state_.entries.end() ||
          (!it->second.loading && it->second.fingerprint != fingerprint)) {
        to_read.push_back(id);
      }
    }
    state_.changed.SignalAll();
  }
  state_.Fire(after);
  return to_read;
}

bool MapperStore::Relist(const std::string& id, const Fingerprint& fingerprint) {
  const std::string dir = JoinPath(root_, id);
  // The manifest, for the listing and pair lookups before the weights are read. Its errors
  // are reported by the loader (which checks SHA256SUMS first) when it runs.
  absl::StatusOr<Manifest> manifest = ReadManifestFile(JoinPath(dir, kManifestFileName));
  bool load = options_.load_on_scan;
  MutexLock lock(&state_.mu);
  Entry& entry = state_.entries[id];
  entry.info.id = id;
  entry.info.path = dir;
  entry.fingerprint = fingerprint;
  entry.info.state = MapperState::kDiscovered;  // retried: no longer FAILED
  entry.info.state_reason.clear();
  if (manifest.ok()) {
    store_internal::FillFromManifest(*manifest, &entry.info);
    entry.expected_bytes = ExpectedWeightBytes(dir, manifest->weights_file, fingerprint);
  } else {
    entry.expected_bytes = fingerprint.TotalSize();
    if (!load) {
      entry.info.state = MapperState::kFailed;
      entry.info.state_reason = absl::StrCat(dir, ": ", manifest.status().message());
    }
  }
  // A changed resident mapper is reloaded whatever the policy: its old version is stale.
  return load || entry.current != nullptr;
}

// --- Acquisition ---

absl::StatusOr<MapperHandle> MapperStore::AcquireLocked(const std::string& mapper_id,
                                                        const AcquireOptions& options,
                                                        Aftermath& after) {
  SameLock host_lock(Held(state_.mu), host_.mu());
  absl::StatusOr<std::shared_ptr<Version>> version =
      host_.AcquireLocked(mapper_id, options.deadline, after);
  if (!version.ok()) return version.status();
  MapperHandle handle;
  handle.store_ = this;
  handle.mapper_ = (*version)->mapper;
  handle.version_ = *std::move(version);
  return handle;
}

absl::StatusOr<MapperHandle> MapperStore::Acquire(const std::string& mapper_id,
                                                  const AcquireOptions& options) {
  // Before anything is loaded for a request that cannot be served.
  if (absl::Status s = devices_.CheckDevice(options.device); !s.ok()) return s;
  Aftermath after;
  UniqueLock lock(&state_.mu);
  absl::StatusOr<MapperHandle> handle = AcquireLocked(mapper_id, options, after);
  lock.Unlock();
  state_.Fire(after);
  if (handle.ok() && !options.device.empty()) {
    if (absl::Status s = PinOnDevice(&*handle, options); !s.ok()) return s;
  }
  return handle;
}

absl::StatusOr<MapperHandle> MapperStore::AcquirePair(const std::string& source_model,
                                                      const std::string& target_model,
                                                      const AcquireOptions& options) {
  if (absl::Status s = devices_.CheckDevice(options.device); !s.ok()) return s;
  Aftermath after;
  UniqueLock lock(&state_.mu);
  std::vector<const Entry*> serving;
  std::vector<const Entry*> failed;
  for (const auto& [id, entry] : state_.entries) {
    if (entry.info.source_model != source_model || entry.info.target_model != target_model) {
      continue;
    }
    (entry.info.state == MapperState::kFailed ? failed : serving).push_back(&entry);
  }
  if (serving.empty()) {
    std::string message = absl::StrCat("no mapper for ", source_model, " -> ", target_model);
    for (const Entry* entry : failed) {
      absl::StrAppend(&message, "; mapper '", entry->info.id, "' for this pair FAILED: ",
                      entry->info.state_reason);
    }
    return absl::NotFoundError(message);
  }
  if (serving.size() > 1) {
    std::vector<std::string> ids;
    for (const Entry* entry : serving) ids.push_back(entry->info.id);
    return absl::FailedPreconditionError(absl::StrCat(
        "ambiguous: ", serving.size(), " mappers serve ", source_model, " -> ", target_model,
        " (", absl::StrJoin(ids, ", "), "); request one by mapper id or remove the others"));
  }
  const std::string id = serving[0]->info.id;
  absl::StatusOr<MapperHandle> handle = AcquireLocked(id, options, after);
  lock.Unlock();
  state_.Fire(after);
  if (handle.ok() && !options.device.empty()) {
    if (absl::Status s = PinOnDevice(&*handle, options); !s.ok()) return s;
  }
  return handle;
}

absl::Status MapperStore::PinOnDevice(MapperHandle* handle, const AcquireOptions& options) {
  if (handle == nullptr || !*handle) {
    return absl::InvalidArgumentError("PinOnDevice needs a handle from Acquire");
  }
  if (handle->copy_) return absl::OkStatus();
  if (DeviceNames().empty()) {
    return absl::FailedPreconditionError("this mapper store has no devices to page onto");
  }
  absl::StatusOr<std::shared_ptr<DeviceCopy>> copy =
      devices_.Pin(handle->version_, options.device, options.deadline);
  if (!copy.ok()) return copy.status();
  handle->copy_ = *std::move(copy);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const LoadedMapper>> MapperStore::Get(const std::string& mapper_id) {
  absl::StatusOr<MapperHandle> handle = Acquire(mapper_id);
  if (!handle.ok()) return handle.status();
  auto holder = std::make_shared<MapperHandle>(std::move(*handle));
  return std::shared_ptr<const LoadedMapper>(holder, &holder->mapper());
}

absl::StatusOr<std::shared_ptr<const LoadedMapper>> MapperStore::Find(
    const std::string& source_model, const std::string& target_model) {
  absl::StatusOr<MapperHandle> handle = AcquirePair(source_model, target_model);
  if (!handle.ok()) return handle.status();
  auto holder = std::make_shared<MapperHandle>(std::move(*handle));
  return std::shared_ptr<const LoadedMapper>(holder, &holder->mapper());
}

void MapperStore::Release(MapperHandle& handle) {
  Aftermath after;
  {
    MutexLock lock(&state_.mu);
    SameLock host_lock(Held(state_.mu), host_.mu());
    SameLock devices_lock(Held(state_.mu), devices_.mu());
    if (handle.copy_) devices_.Unpin(*handle.copy_, after);
    host_.Release(*handle.version_, after);
    state_.changed.SignalAll();
  }
  // The handle's own references go before the aftermath, so it really frees.
  handle.copy_.reset();
  handle.version_.reset();
  handle.mapper_.reset();
  state_.Fire(after);
}

// --- Reporting and model control ---

std::vector<MapperInfo> MapperStore::List() const {
  MutexLock lock(&state_.mu);
  SameLock host_lock(Held(state_.mu), host_.mu());
  std::vector<MapperInfo> infos;
  infos.reserve(state_.entries.size());
  for (const auto& [id, entry] : state_.entries) infos.push_back(host_.InfoLocked(entry));
  return infos;
}

absl::StatusOr<MapperInfo> MapperStore::Info(const std::string& mapper_id) const {
  MutexLock lock(&state_.mu);
  SameLock host_lock(Held(state_.mu), host_.mu());
  auto it = state_.entries.find(mapper_id);
  if (it == state_.entries.end()) return host_.UnknownMapper(mapper_id);
  return host_.InfoLocked(it->second);
}

std::vector<TierUsage> MapperStore::Usage() const {
  MutexLock lock(&state_.mu);
  SameLock host_lock(Held(state_.mu), host_.mu());
  SameLock devices_lock(Held(state_.mu), devices_.mu());
  std::vector<TierUsage> usage = {host_.Usage()};
  devices_.AppendUsage(&usage);
  return usage;
}

absl::StatusOr<MapperInfo> MapperStore::Load(const std::string& mapper_id,
                                             const std::string& device, absl::Time deadline) {
  AcquireOptions options;
  options.deadline = deadline;
  options.device = device == "host" ? "" : device;
  absl::StatusOr<MapperHandle> handle = Acquire(mapper_id, options);
  if (!handle.ok()) return handle.status();
  if (!options.device.empty()) {  // resident means every layer has arrived
    if (absl::Status s = handle->WaitLayerReady(handle->mapper().view().target.num_layers - 1,
                                                deadline);
        !s.ok()) {
      return s;
    }
  }
  handle->Release();
  return Info(mapper_id);
}

absl::StatusOr<MapperInfo> MapperStore::Unload(const std::string& mapper_id,
                                               const std::string& device, absl::Time deadline) {
  Aftermath after;
  UniqueLock lock(&state_.mu);
  std::shared_ptr<Version> version;
  std::shared_ptr<DeviceCopy> copy;
  std::string place = "host";
  int still = 0;
  absl::StatusOr<MapperInfo> info = absl::NotFoundError(
      absl::StrCat("mapper '", mapper_id, "' was removed from ", root_, " meanwhile"));
  {
    SameLock host_lock(Held(state_.mu), host_.mu());
    SameLock devices_lock(Held(state_.mu), devices_.mu());
    auto it = state_.entries.find(mapper_id);
    if (it == state_.entries.end()) return host_.UnknownMapper(mapper_id);
    Entry& entry = it->second;
    if (device.empty() || device == "host") {
      version = entry.current;
      host_.DropCurrent(entry, after);
    } else {
      const int index = devices_.Find(device);
      if (index < 0) {
        const std::vector<std::string> names = DeviceNames();
        return absl::InvalidArgumentError(
            absl::StrCat("device='", device, "' is not a device of this server (devices: host",
                         names.empty() ? "" : ", ", absl::StrJoin(names, ", "), ")"));
      }
      place = device;
      if (entry.current) {
        auto found = entry.current->copies.find(index);
        if (found != entry.current->copies.end()) {
          copy = found->second;
          devices_.DetachCopy(*entry.current, index, after);
        }
      }
    }
    state_.changed.SignalAll();
    const auto pins = [&] { return (version ? version->pins : 0) + (copy ? copy->pins : 0); };
    state_.changed.AwaitWithDeadline(&state_.mu, deadline, [&] { return pins() == 0; });
    still = pins();
    if (auto now = state_.entries.find(mapper_id); now != state_.entries.end()) {
      info = host_.InfoLocked(now->second);
    }
  }
  lock.Unlock();
  state_.Fire(after);
  if (still > 0) {
    return absl::DeadlineExceededError(absl::StrCat(
        "mapper '", mapper_id, "' is unloaded from ", place, " (no new request gets that copy), "
        "but ", still, " in-flight request(s) still hold it; its memory is freed when they "
        "finish"));
  }
  return info;
}

}  // namespace kvt
