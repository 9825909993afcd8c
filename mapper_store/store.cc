#include "mapper_store/store.h"

#include <dirent.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

#include <algorithm>
#include <chrono>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "mapper_store/file_util.h"

namespace kvt {

// --- Internal state (every field guarded by MapperStore::mu_). ---

// One device's prepared copy of one version.
struct MapperHandle::DeviceCopy {
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

// One loaded version of one mapper directory.
struct MapperHandle::Version {
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

// Size, mtime and inode of every regular file in a mapper directory: any rewrite (even one
// that keeps sizes, or an atomic rename of a new directory) changes it.
struct MapperStore::Fingerprint {
  std::vector<std::tuple<std::string, uint64_t, int64_t, uint64_t>> files;
  bool operator==(const Fingerprint& other) const { return files == other.files; }
  bool operator!=(const Fingerprint& other) const { return !(*this == other); }
  uint64_t FileSize(const std::string& name) const {
    for (const auto& file : files) {
      if (std::get<0>(file) == name) return std::get<1>(file);
    }
    return 0;
  }
  uint64_t TotalSize() const {
    uint64_t total = 0;
    for (const auto& file : files) total += std::get<1>(file);
    return total;
  }
};

struct MapperStore::Entry {
  // Manifest fields, FAILED state and reason, usage counters. The residency fields are
  // computed by InfoLocked.
  MapperInfo info;
  Fingerprint fingerprint;  // of the files last read
  std::shared_ptr<Version> current;  // null unless host resident
  bool loading = false;               // a load (first, or a reload beside current) in flight
  uint64_t expected_bytes = 0;        // what a load reserves: the weights file
};

struct MapperStore::Device {
  Backend* backend = nullptr;
  std::string name;
  uint64_t budget = 0;
  uint64_t used = 0;      // guarded by the store's mu_
  uint64_t reserved = 0;  // guarded by the store's mu_
  int pins = 0;           // guarded by the store's mu_: the load a device choice balances
  std::atomic<bool> removed{false};  // RemoveDevice: skipped everywhere, slot kept

  // The page-in worker: streams layers so the requester can compute meanwhile.
  std::mutex queue_mu;
  std::condition_variable queue_cv;
  std::deque<std::function<void()>> queue ABSL_GUARDED_BY(queue_mu);
  bool stop ABSL_GUARDED_BY(queue_mu) = false;
  std::thread worker;

  void Run() {
    std::unique_lock<std::mutex> lock(queue_mu);
    while (true) {
      queue_cv.wait(lock, [this] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop, and nothing left
      std::function<void()> job = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }
  void Post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(queue_mu);
      queue.push_back(std::move(job));
    }
    queue_cv.notify_one();
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(queue_mu);
      stop = true;
    }
    queue_cv.notify_one();
    if (worker.joinable()) worker.join();
  }
};

struct MapperStore::Aftermath {
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

namespace {

void FillFromManifest(const Manifest& m, MapperInfo* info) {
  info->source_model = m.source.name;
  info->target_model = m.target.name;
  info->kind = MapperKindName(m.kind);
  info->k = m.k;
  info->synthetic = m.synthetic;
  info->weight_dtype = m.weights_dtype;
  info->source = m.source;
  info->target = m.target;
  info->num_params = MapperNumParams(m);
}

// Where a mapper directory is recognised; the one place to teach other layouts.
bool IsMapperDirectory(const std::string& dir) {
  return PathExists(JoinPath(dir, kManifestFileName));
}

template <typename Predicate>
bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
               absl::Time deadline, Predicate done) {
  if (deadline == absl::InfiniteFuture()) {
    cv.wait(lock, done);
    return true;
  }
  return cv.wait_until(lock, absl::ToChronoTime(deadline), done);
}

// One wait for a change (an unpin, a finished load), at most until `deadline`; callers loop.
void WaitOnce(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
              absl::Time deadline) {
  // Bounded even without a deadline, so a missed wake-up costs a second, not a hang.
  cv.wait_until(lock, absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(1))));
}

// Regular files directly in `dir` (names), for the change fingerprint.
absl::StatusOr<std::vector<std::string>> ListFiles(const std::string& dir) {
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) return ErrnoStatus(errno, "cannot list", dir);
  std::vector<std::string> names;
  while (const struct dirent* entry = ::readdir(handle)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(handle);
  std::sort(names.begin(), names.end());
  return names;
}

// The data section of a safetensors file (what LoadedMapper::weight_bytes() will be): the file
// less its 8-byte length prefix and JSON header. `file_size` when the prefix cannot be read
// (the loader then reports what is wrong).
uint64_t SafetensorsDataSize(const std::string& path, uint64_t file_size) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return file_size;
  unsigned char prefix[8];
  const bool read = std::fread(prefix, 1, 8, file) == 8;
  std::fclose(file);
  if (!read) return file_size;
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | prefix[i];  // little-endian
  return file_size >= 8 && header <= file_size - 8 ? file_size - 8 - header : file_size;
}

std::string Bytes(uint64_t bytes) {
  return absl::StrCat(bytes, " bytes (", absl::StrFormat("%.1f", bytes / 1048576.0), " MiB)");
}

}  // namespace

const char* MapperStateName(MapperState state) {
  switch (state) {
    case MapperState::kDiscovered:
      return "DISCOVERED";
    case MapperState::kLoading:
      return "LOADING";
    case MapperState::kHostResident:
      return "HOST_RESIDENT";
    case MapperState::kDeviceResident:
      return "DEVICE_RESIDENT";
    case MapperState::kFailed:
      return "FAILED";
  }
  return "?";
}

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
  return copy_ ? store_->devices_[copy_->device]->backend : nullptr;
}

const PreparedMapper* MapperHandle::prepared() const { return copy_ ? copy_->prepared.get() : nullptr; }

const std::string& MapperHandle::device() const {
  static const std::string* const kNone = new std::string();
  return copy_ ? store_->devices_[copy_->device]->name : *kNone;
}

absl::Status MapperHandle::WaitLayerReady(int target_layer, absl::Time deadline) const {
  if (!copy_) return absl::OkStatus();
  return store_->WaitLayer(*copy_, target_layer, deadline);
}

void MapperHandle::Release() {
  if (store_ == nullptr) return;
  store_->Release(*this);
  store_ = nullptr;
  copy_.reset();
  version_.reset();
  mapper_.reset();
}

// --- MapperStore ---

absl::StatusOr<std::unique_ptr<MapperStore>> MapperStore::Open(const std::string& root,
                                                               const StoreOptions& options) {
  auto store = std::make_unique<MapperStore>(root, options);
  if (absl::Status s = store->Scan(); !s.ok()) return s;
  return store;
}

MapperStore::MapperStore(std::string root, StoreOptions options)
    : root_(std::move(root)), options_(std::move(options)), events_(options_.events) {
  for (const StoreDevice& spec : options_.devices) AddDevice(spec).IgnoreError();
}

absl::Status MapperStore::AddDevice(const StoreDevice& spec) {
  std::lock_guard<std::mutex> lock(mu_);
  const int n = num_devices();
  const std::string name = spec.backend->device();
  for (int d = 0; d < n; ++d) {
    if (!devices_[d]->removed && devices_[d]->name == name) {
      return absl::AlreadyExistsError(absl::StrCat("device '", name, "' is already in the store"));
    }
  }
  if (n == kMaxDevices) {
    return absl::ResourceExhaustedError(absl::StrCat("at most ", kMaxDevices, " devices"));
  }
  auto device = std::make_unique<Device>();
  device->backend = spec.backend;
  device->name = name;
  device->budget = spec.budget_bytes;
  Device* raw = device.get();
  device->worker = std::thread([raw] { raw->Run(); });
  devices_[n] = std::move(device);
  num_devices_.store(n + 1, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status MapperStore::RemoveDevice(const std::string& name, absl::Time deadline) {
  Aftermath after;
  Device* removed = nullptr;
  {
    std::unique_lock<std::mutex> lock(mu_);
    int index = -1;
    for (int d = 0; d < num_devices(); ++d) {
      if (!devices_[d]->removed && devices_[d]->name == name) index = d;
    }
    if (index < 0) return absl::NotFoundError(absl::StrCat("no device '", name, "'"));
    Device& dev = *devices_[index];
    // Requests and page-ins still using it (a page-in's worker holds a pin until it ends).
    if (!WaitUntil(changed_, lock, deadline, [&] { return dev.pins == 0; })) {
      return absl::DeadlineExceededError(absl::StrCat(
          "device '", name, "' is still used by ", dev.pins, " request(s) or page-ins"));
    }
    for (auto& [id, entry] : entries_) {
      if (entry.current) DetachCopy(*entry.current, index, after);
    }
    dev.removed = true;
    removed = &dev;
    changed_.notify_all();
  }
  Fire(after);
  removed->Stop();
  return absl::OkStatus();
}

void MapperStore::SetEvents(StoreEvents events) {
  std::lock_guard<std::mutex> lock(events_mu_);
  events_ = std::move(events);
}

MapperStore::~MapperStore() {
  {
    std::lock_guard<std::mutex> lock(poll_mu_);
    stopping_ = true;
  }
  poll_cv_.notify_all();
  if (poller_.joinable()) poller_.join();
  for (int d = 0; d < num_devices(); ++d) {
    if (!devices_[d]->removed) devices_[d]->Stop();
  }
}

std::vector<std::string> MapperStore::DeviceNames() const {
  std::vector<std::string> names;
  for (int d = 0; d < num_devices(); ++d) {
    if (!devices_[d]->removed) names.push_back(devices_[d]->name);
  }
  return names;
}

void MapperStore::Fire(Aftermath& after) {
  {
    std::lock_guard<std::mutex> lock(events_mu_);
    const StoreEvents& events = events_;
    if (events.page_in) {
      for (const auto& e : after.page_ins) events.page_in(*e.mapper, e.place, e.seconds);
    }
    if (events.eviction) {
      for (const auto& e : after.evictions) events.eviction(*e.mapper, e.place);
    }
    if (events.access) {
      for (const auto& e : after.accesses) events.access(*e.mapper, e.place, e.hit);
    }
  }
  after = Aftermath();
}

absl::StatusOr<std::shared_ptr<const LoadedMapper>> MapperStore::LoadFromDisk(
    const std::string& id) const {
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded =
      LoadMapperDir(JoinPath(root_, id), options_.load);
  if (!loaded.ok()) return loaded.status();
  return std::shared_ptr<const LoadedMapper>(std::move(*loaded));
}

// --- Freeing: the only places budgets go down, by exactly what was added. ---

void MapperStore::FreeCopy(DeviceCopy& copy, Aftermath& after) {
  if (copy.freed) return;
  copy.freed = true;
  devices_[copy.device]->used -= copy.bytes;
  if (copy.prepared) after.prepared.push_back(std::move(copy.prepared));
}

void MapperStore::FreeVersion(Version& version, Aftermath& after) {
  if (version.freed) return;
  version.freed = true;
  host_used_ -= version.bytes;
  for (auto& [device, copy] : version.copies) FreeCopy(*copy, after);
  version.copies.clear();
  if (version.mapper) after.mappers.push_back(std::move(version.mapper));
}

void MapperStore::DetachVersion(const std::shared_ptr<Version>& version, Aftermath& after) {
  version->detached = true;
  if (version->pins == 0) FreeVersion(*version, after);
}

void MapperStore::DetachCopy(Version& version, int device, Aftermath& after) {
  auto it = version.copies.find(device);
  if (it == version.copies.end()) return;
  std::shared_ptr<DeviceCopy> copy = it->second;
  version.copies.erase(it);
  copy->detached = true;
  if (copy->pins == 0) FreeCopy(*copy, after);
}

// --- Scanning and hot reload ---

absl::Status MapperStore::Scan() {
  std::lock_guard<std::mutex> scan_lock(scan_mu_);
  if (!IsDirectory(root_)) {
    return absl::NotFoundError(
        absl::StrCat("mapper store directory ", root_, " does not exist or is not a directory"));
  }
  absl::StatusOr<std::vector<std::string>> names = ListSubdirectories(root_);
  if (!names.ok()) return names.status();
  std::map<std::string, Fingerprint> present;
  for (const std::string& name : *names) {
    if (name.empty() || name[0] == '.') continue;
    const std::string dir = JoinPath(root_, name);
    if (!IsMapperDirectory(dir)) continue;
    Fingerprint& fingerprint = present[name];
    absl::StatusOr<std::vector<std::string>> files = ListFiles(dir);
    if (!files.ok()) continue;  // raced with a removal: the next scan sees it
    for (const std::string& file : *files) {
      struct stat st;
      if (::stat(JoinPath(dir, file).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      fingerprint.files.emplace_back(
          file, static_cast<uint64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
          static_cast<uint64_t>(st.st_ino));
    }
  }

  std::vector<std::string> to_read;  // new or changed
  {
    Aftermath after;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = entries_.begin(); it != entries_.end();) {
        if (present.count(it->first) > 0) {
          ++it;
          continue;
        }
        // Removed: in-flight requests keep their version; the memory goes when they finish.
        if (it->second.current) DetachVersion(it->second.current, after);
        it = entries_.erase(it);
      }
      for (const auto& [id, fingerprint] : present) {
        auto it = entries_.find(id);
        if (it == entries_.end() ||
            (!it->second.loading && it->second.fingerprint != fingerprint)) {
          to_read.push_back(id);
        }
      }
      changed_.notify_all();
    }
    Fire(after);
  }

  for (const std::string& id : to_read) {
    const std::string dir = JoinPath(root_, id);
    // The manifest, for the listing and pair lookups before the weights are read. Its errors
    // are reported by the loader (which checks SHA256SUMS first) when it runs.
    absl::StatusOr<Manifest> manifest = ReadManifestFile(JoinPath(dir, kManifestFileName));
    bool load = options_.load_on_scan;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Entry& entry = entries_[id];
      entry.info.id = id;
      entry.info.path = dir;
      entry.fingerprint = present[id];
      entry.info.state = MapperState::kDiscovered;  // retried: no longer FAILED
      entry.info.state_reason.clear();
      if (manifest.ok()) {
        FillFromManifest(*manifest, &entry.info);
        entry.expected_bytes =
            SafetensorsDataSize(JoinPath(dir, manifest->weights_file),
                                entry.fingerprint.FileSize(manifest->weights_file));
      } else {
        entry.expected_bytes = entry.fingerprint.TotalSize();
        if (!load) {
          entry.info.state = MapperState::kFailed;
          entry.info.state_reason = absl::StrCat(dir, ": ", manifest.status().message());
        }
      }
      // A changed resident mapper is reloaded whatever the policy: its old version is stale.
      if (entry.current) load = true;
    }
    if (load) ScanLoad(id);
  }
  return absl::OkStatus();
}

void MapperStore::ScanLoad(const std::string& id) {
  Aftermath after;
  std::unique_lock<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.loading ||
      it->second.info.state == MapperState::kFailed) {
    return;
  }
  const bool replacing = it->second.current != nullptr;
  const uint64_t need = it->second.expected_bytes;
  // No waiting here: a scan must not stall on requests. A new mapper that does not fit stays
  // DISCOVERED (loads on first use); a changed one may evict others to load beside its old
  // version, and if even that is not possible, the stale version stops serving now.
  absl::Status room = ReserveHost(lock, need, id, /*evict=*/replacing, absl::Now(), after);
  it = entries_.find(id);  // (scans alone erase entries, and this is the scan)
  Entry& entry = it->second;
  if (!room.ok()) {
    if (entry.current) {
      DetachVersion(entry.current, after);
      entry.current = nullptr;
    }
    changed_.notify_all();
    lock.unlock();
    Fire(after);
    return;
  }
  entry.loading = true;
  const Fingerprint fingerprint = entry.fingerprint;
  lock.unlock();
  Fire(after);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> loaded = LoadFromDisk(id);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  lock.lock();
  FinishLoad(id, need, fingerprint, std::move(loaded), seconds, after);
  lock.unlock();
  Fire(after);
}

void MapperStore::FinishLoad(const std::string& id, uint64_t reserved,
                             const Fingerprint& fingerprint,
                             absl::StatusOr<std::shared_ptr<const LoadedMapper>> loaded,
                             double seconds, Aftermath& after) {
  host_reserved_ -= reserved;
  changed_.notify_all();
  auto it = entries_.find(id);
  if (it == entries_.end()) {  // removed while loading
    if (loaded.ok()) after.mappers.push_back(std::move(*loaded));
    return;
  }
  Entry& entry = it->second;
  entry.loading = false;
  if (!loaded.ok()) {
    // Never serves, not even the previous version: it no longer matches the directory.
    entry.info.state = MapperState::kFailed;
    entry.info.state_reason = std::string(loaded.status().message());
    if (entry.current) {
      DetachVersion(entry.current, after);
      entry.current = nullptr;
    }
    return;
  }
  auto version = std::make_shared<Version>();
  version->id = id;
  version->generation = ++entry.info.generation;
  version->mapper = std::move(*loaded);
  version->bytes = version->mapper->weight_bytes();
  version->last_use = ++tick_;
  host_used_ += version->bytes;
  if (entry.current) DetachVersion(entry.current, after);  // the atomic swap
  entry.current = version;
  entry.fingerprint = fingerprint;
  FillFromManifest(version->mapper->manifest(), &entry.info);
  entry.info.state = MapperState::kHostResident;
  entry.info.state_reason.clear();
  ++entry.info.loads;
  after.page_ins.push_back({version->mapper, "host", seconds, false});
}

void MapperStore::StartPolling(absl::Duration interval) {
  std::lock_guard<std::mutex> lock(poll_mu_);
  poll_interval_ = interval;
  if (!poller_.joinable()) poller_ = std::thread([this] { PollLoop(); });
  poll_cv_.notify_all();
}

absl::Status MapperStore::last_poll_status() const {
  std::lock_guard<std::mutex> lock(poll_mu_);
  return last_poll_status_;
}

void MapperStore::PollLoop() {
  std::unique_lock<std::mutex> lock(poll_mu_);
  while (!stopping_) {
    const auto until = std::chrono::steady_clock::now() +
                       absl::ToChronoNanoseconds(std::max(poll_interval_, absl::Milliseconds(1)));
    if (poll_cv_.wait_until(lock, until, [this] { return stopping_; })) break;
    lock.unlock();
    absl::Status status = Scan();
    lock.lock();
    last_poll_status_ = status;
  }
}

// --- Host tier ---

absl::Status MapperStore::ReserveHost(std::unique_lock<std::mutex>& lock, uint64_t bytes,
                                      const std::string& who, bool evict, absl::Time deadline,
                                      Aftermath& after) {
  const uint64_t budget = options_.host_budget_bytes;
  if (budget == 0) {
    host_reserved_ += bytes;
    return absl::OkStatus();
  }
  if (bytes > budget) {
    return absl::FailedPreconditionError(absl::StrCat(
        "mapper '", who, "' needs ", Bytes(bytes), " of host memory but ",
        options_.host_budget_key, " is ", Bytes(budget), ": raise the budget to serve it"));
  }
  while (true) {
    if (host_used_ + host_reserved_ + bytes <= budget) {
      host_reserved_ += bytes;
      return absl::OkStatus();
    }
    if (evict) {
      Entry* victim = nullptr;
      for (auto& [id, entry] : entries_) {
        if (entry.current == nullptr || entry.current->pins > 0) continue;
        if (victim == nullptr || entry.current->last_use < victim->current->last_use) {
          victim = &entry;
        }
      }
      if (victim != nullptr) {
        Version& version = *victim->current;
        for (const auto& [device, copy] : version.copies) {
          after.evictions.push_back({version.mapper, devices_[device]->name, 0, false});
          ++victim->info.evictions;
        }
        after.evictions.push_back({version.mapper, "host", 0, false});
        ++victim->info.evictions;
        DetachVersion(victim->current, after);
        victim->current = nullptr;
        changed_.notify_all();
        continue;
      }
    }
    if (absl::Now() >= deadline) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "host memory for mappers is full: ", options_.host_budget_key, " is ", Bytes(budget),
          ", ", Bytes(host_used_), " held by mappers in use (pinned by in-flight requests)",
          host_reserved_ > 0 ? absl::StrCat(" and ", Bytes(host_reserved_), " being loaded")
                             : "",
          "; mapper '", who, "' needs ", Bytes(bytes), "; retry later or raise ",
          options_.host_budget_key));
    }
    WaitOnce(changed_, lock, deadline);  // then re-evaluate from the top
  }
}

absl::StatusOr<MapperHandle> MapperStore::AcquireLocked(std::unique_lock<std::mutex>& lock,
                                                        const std::string& mapper_id,
                                                        const AcquireOptions& options,
                                                        Aftermath& after) {
  bool missed = false;
  while (true) {
    auto it = entries_.find(mapper_id);
    if (it == entries_.end()) {
      return absl::NotFoundError(absl::StrCat("no mapper with id '", mapper_id, "' in ", root_));
    }
    Entry& entry = it->second;
    if (entry.info.state == MapperState::kFailed) {
      return absl::FailedPreconditionError(absl::StrCat("mapper '", mapper_id,
                                                        "' failed to load and cannot serve: ",
                                                        entry.info.state_reason));
    }
    if (entry.current) {
      Version& version = *entry.current;
      ++version.pins;
      version.last_use = ++tick_;
      ++entry.info.hits;
      entry.info.last_used_unix_ms = absl::ToUnixMillis(absl::Now());
      MapperHandle handle;
      handle.store_ = this;
      handle.version_ = entry.current;
      handle.mapper_ = version.mapper;
      after.accesses.push_back({version.mapper, "host", 0, !missed});
      return handle;
    }
    if (entry.loading) {  // single flight: wait for the load in progress
      const bool done = WaitUntil(changed_, lock, options.deadline, [&] {
        auto found = entries_.find(mapper_id);
        return found == entries_.end() || !found->second.loading;
      });
      if (!done) {
        return absl::DeadlineExceededError(
            absl::StrCat("deadline passed while mapper '", mapper_id, "' was loading"));
      }
      continue;
    }
    missed = true;
    const uint64_t need = entry.expected_bytes;
    if (absl::Status room = ReserveHost(lock, need, mapper_id, /*evict=*/true, options.deadline,
                                        after);
        !room.ok()) {
      return room;
    }
    // ReserveHost may have waited: look again.
    it = entries_.find(mapper_id);
    if (it == entries_.end() || it->second.current || it->second.loading ||
        it->second.info.state == MapperState::kFailed) {
      host_reserved_ -= need;
      changed_.notify_all();
      continue;
    }
    it->second.loading = true;
    const Fingerprint fingerprint = it->second.fingerprint;
    lock.unlock();
    Fire(after);
    const absl::Time start = absl::Now();
    absl::StatusOr<std::shared_ptr<const LoadedMapper>> loaded = LoadFromDisk(mapper_id);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    lock.lock();
    FinishLoad(mapper_id, need, fingerprint, std::move(loaded), seconds, after);
  }
}

absl::Status MapperStore::CheckDevice(const std::string& device) const {
  if (device.empty() || device == "any") return absl::OkStatus();
  for (int d = 0; d < num_devices(); ++d) {
    if (!devices_[d]->removed && devices_[d]->name == device) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device='", device, "' is not a device of this server (devices: ",
                   DeviceNames().empty() ? "none" : absl::StrJoin(DeviceNames(), ", "), ")"));
}

absl::StatusOr<MapperHandle> MapperStore::Acquire(const std::string& mapper_id,
                                                  const AcquireOptions& options) {
  // Before anything is loaded for a request that cannot be served.
  if (absl::Status s = CheckDevice(options.device); !s.ok()) return s;
  Aftermath after;
  std::unique_lock<std::mutex> lock(mu_);
  absl::StatusOr<MapperHandle> handle = AcquireLocked(lock, mapper_id, options, after);
  lock.unlock();
  Fire(after);
  if (handle.ok() && !options.device.empty()) {
    if (absl::Status s = PinOnDevice(&*handle, options); !s.ok()) return s;
  }
  return handle;
}

absl::StatusOr<MapperHandle> MapperStore::AcquirePair(const std::string& source_model,
                                                      const std::string& target_model,
                                                      const AcquireOptions& options) {
  if (absl::Status s = CheckDevice(options.device); !s.ok()) return s;
  Aftermath after;
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<const Entry*> serving;
  std::vector<const Entry*> failed;
  for (const auto& [id, entry] : entries_) {
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
  absl::StatusOr<MapperHandle> handle = AcquireLocked(lock, id, options, after);
  lock.unlock();
  Fire(after);
  if (handle.ok() && !options.device.empty()) {
    if (absl::Status s = PinOnDevice(&*handle, options); !s.ok()) return s;
  }
  return handle;
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
    std::lock_guard<std::mutex> lock(mu_);
    if (handle.copy_) {
      DeviceCopy& copy = *handle.copy_;
      --copy.pins;
      --devices_[copy.device]->pins;
      copy.last_use = ++tick_;
      if (copy.detached && copy.pins == 0) FreeCopy(copy, after);
    }
    Version& version = *handle.version_;
    --version.pins;
    version.last_use = ++tick_;
    if (version.detached && version.pins == 0) FreeVersion(version, after);
    changed_.notify_all();
  }
  // The handle's own references go before the aftermath, so it really frees.
  handle.copy_.reset();
  handle.version_.reset();
  handle.mapper_.reset();
  Fire(after);
}

// --- Device tier ---

uint64_t MapperStore::EvictableDeviceBytes(int device) const {
  uint64_t bytes = 0;
  for (const auto& [id, entry] : entries_) {
    if (!entry.current) continue;
    auto it = entry.current->copies.find(device);
    if (it != entry.current->copies.end() && it->second->pins == 0) bytes += it->second->bytes;
  }
  return bytes;
}

void MapperStore::EvictOnDevice(int device, uint64_t bytes, Aftermath& after) {
  Device& dev = *devices_[device];
  while (dev.budget > 0 && dev.used + dev.reserved + bytes > dev.budget) {
    Entry* victim = nullptr;
    for (auto& [id, entry] : entries_) {
      if (!entry.current) continue;
      auto it = entry.current->copies.find(device);
      if (it == entry.current->copies.end() || it->second->pins > 0) continue;
      if (victim == nullptr ||
          it->second->last_use < victim->current->copies.at(device)->last_use) {
        victim = &entry;
      }
    }
    if (victim == nullptr) return;
    after.evictions.push_back({victim->current->mapper, dev.name, 0, false});
    ++victim->info.evictions;
    DetachCopy(*victim->current, device, after);
  }
}

absl::StatusOr<int> MapperStore::ChooseDevice(const std::vector<int>& candidates,
                                              uint64_t bytes, const std::string& who,
                                              bool* must_wait) const {
  *must_wait = false;
  int best = -1;
  int best_rank = 3;  // 0: fits now, 1: fits after evicting, 2: must wait
  uint64_t best_free = 0;
  std::vector<std::string> too_small;
  for (int d : candidates) {
    const Device& dev = *devices_[d];
    if (dev.budget > 0 && bytes > dev.budget) {
      too_small.push_back(absl::StrCat(dev.name, ": ", Bytes(dev.budget)));
      continue;
    }
    const uint64_t held = dev.used + dev.reserved;
    const uint64_t free = dev.budget == 0 ? std::numeric_limits<uint64_t>::max()
                                          : (held >= dev.budget ? 0 : dev.budget - held);
    const int rank = bytes <= free ? 0 : bytes <= free + EvictableDeviceBytes(d) ? 1 : 2;
    // Room first, then the least load (pinned requests), then the most free memory.
    if (best < 0 || rank < best_rank ||
        (rank == best_rank && (dev.pins < devices_[best]->pins ||
                               (dev.pins == devices_[best]->pins && free > best_free)))) {
      best = d;
      best_rank = rank;
      best_free = free;
    }
  }
  if (best < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "mapper '", who, "' needs ", Bytes(bytes), " on a device but ",
        options_.device_budget_key, " is smaller (", absl::StrJoin(too_small, ", "),
        "): raise the budget to serve it"));
  }
  *must_wait = best_rank == 2;
  return best;
}

absl::Status MapperStore::PinOnDevice(MapperHandle* handle, const AcquireOptions& options) {
  if (handle == nullptr || !*handle) {
    return absl::InvalidArgumentError("PinOnDevice needs a handle from Acquire");
  }
  if (handle->copy_) return absl::OkStatus();
  if (DeviceNames().empty()) {
    return absl::FailedPreconditionError("this mapper store has no devices to page onto");
  }
  std::vector<int> candidates;
  if (options.device.empty() || options.device == "any") {
    for (int d = 0; d < num_devices(); ++d) {
      if (!devices_[d]->removed) candidates.push_back(d);
    }
  } else {
    for (int d = 0; d < num_devices(); ++d) {
      if (!devices_[d]->removed && devices_[d]->name == options.device) candidates.push_back(d);
    }
    if (candidates.empty()) return CheckDevice(options.device);
  }
  Aftermath after;
  std::unique_lock<std::mutex> lock(mu_);
  std::shared_ptr<Version> version = handle->version_;
  const std::string& who = version->id;
  std::shared_ptr<DeviceCopy> copy;
  int device = -1;
  uint64_t need = 0;
  while (true) {
    // A copy that exists, or is paging in for another request: share it.
    for (int d : candidates) {
      auto it = version->copies.find(d);
      if (it == version->copies.end()) continue;
      if (!copy || devices_[d]->pins < devices_[copy->device]->pins) copy = it->second;
    }
    if (copy) {
      ++copy->pins;
      ++devices_[copy->device]->pins;
      copy->last_use = ++tick_;
      const bool done = WaitUntil(changed_, lock, options.deadline,
                                  [&] { return copy->started || !copy->error.ok(); });
      if (!done || !copy->error.ok()) {
        --copy->pins;
        --devices_[copy->device]->pins;
        if (copy->detached && copy->pins == 0) FreeCopy(*copy, after);
        absl::Status error =
            done ? copy->error
                 : absl::DeadlineExceededError(absl::StrCat(
                       "deadline passed while mapper '", who, "' was paging in onto ",
                       devices_[copy->device]->name));
        changed_.notify_all();
        lock.unlock();
        Fire(after);
        return error;
      }
      after.accesses.push_back({version->mapper, devices_[copy->device]->name, 0, true});
      handle->copy_ = copy;
      lock.unlock();
      Fire(after);
      return absl::OkStatus();
    }
    // A new copy: on the device with room and the least load.
    const MapperView& view = version->mapper->view();
    bool must_wait = false;
    uint64_t estimate = 0;
    for (int d : candidates) {
      estimate = std::max(estimate, devices_[d]->backend->PreparedBytesEstimate(view));
    }
    absl::StatusOr<int> chosen = ChooseDevice(candidates, estimate, who, &must_wait);
    if (!chosen.ok()) return chosen.status();
    if (!must_wait) {
      device = *chosen;
      need = devices_[device]->backend->PreparedBytesEstimate(view);
      break;
    }
    if (absl::Now() >= options.deadline) {
      const Device& dev = *devices_[*chosen];
      return absl::ResourceExhaustedError(absl::StrCat(
          "device memory for mappers is full: ", options_.device_budget_key, " is ",
          Bytes(dev.budget), " on ", dev.name, ", ", Bytes(dev.used + dev.reserved),
          " held by mappers in use (pinned by in-flight requests) or paging in; mapper '", who,
          "' needs ", Bytes(estimate), "; retry later or raise ", options_.device_budget_key));
    }
    WaitOnce(changed_, lock, options.deadline);
  }
  Device& dev = *devices_[device];
  EvictOnDevice(device, need, after);
  copy = std::make_shared<DeviceCopy>();
  copy->device = device;
  copy->reserved = need;
  copy->num_layers = version->mapper->view().target.num_layers;
  copy->pins = 2;  // this handle and the page-in worker
  copy->last_use = ++tick_;
  dev.pins += 2;
  dev.reserved += need;
  version->copies[device] = copy;
  ++version->pins;  // the worker's
  lock.unlock();
  Fire(after);

  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared =
      dev.backend->BeginPrepare(handle->mapper_->view());

  lock.lock();
  dev.reserved -= need;
  if (!prepared.ok()) {
    copy->error = absl::Status(prepared.status().code(),
                               absl::StrCat("paging mapper '", who, "' onto ", dev.name, ": ",
                                            prepared.status().message()));
    copy->paging = false;
    copy->pins -= 2;
    dev.pins -= 2;
    auto it = version->copies.find(device);
    if (it != version->copies.end() && it->second == copy) version->copies.erase(it);
    copy->detached = true;
    FreeCopy(*copy, after);
    --version->pins;
    if (version->detached && version->pins == 0) FreeVersion(*version, after);
    changed_.notify_all();
    absl::Status error = copy->error;
    lock.unlock();
    Fire(after);
    return error;
  }
  copy->prepared = *prepared;
  copy->bytes = copy->prepared->bytes();
  dev.used += copy->bytes;
  copy->started = true;
  if (auto it = entries_.find(who); it != entries_.end() && it->second.current == version) {
    ++it->second.info.page_ins;
  }
  after.accesses.push_back({version->mapper, dev.name, 0, false});
  handle->copy_ = copy;
  changed_.notify_all();
  lock.unlock();
  Fire(after);
  dev.Post([this, version, copy, start] { StreamLayers(version, copy, start); });
  return absl::OkStatus();
}

void MapperStore::StreamLayers(std::shared_ptr<Version> version, std::shared_ptr<DeviceCopy> copy,
                               absl::Time started) {
  Device& dev = *devices_[copy->device];
  absl::Status status;
  for (int layer = 0; layer < copy->num_layers; ++layer) {
    status = dev.backend->PrepareLayer(*copy->prepared, layer);
    if (!status.ok()) break;
    std::lock_guard<std::mutex> lock(mu_);
    copy->layers_ready = layer + 1;
    changed_.notify_all();
  }
  Aftermath after;
  {
    std::lock_guard<std::mutex> lock(mu_);
    copy->paging = false;
    if (!status.ok()) {
      copy->error = absl::Status(status.code(),
                                 absl::StrCat("paging mapper '", version->id, "' onto ", dev.name,
                                              ": ", status.message()));
      auto it = version->copies.find(copy->device);
      if (it != version->copies.end() && it->second == copy) version->copies.erase(it);
      copy->detached = true;
    } else {
      after.page_ins.push_back(
          {version->mapper, dev.name, absl::ToDoubleSeconds(absl::Now() - started), false});
    }
    --copy->pins;
    --dev.pins;
    if (copy->detached && copy->pins == 0) FreeCopy(*copy, after);
    --version->pins;
    if (version->detached && version->pins == 0) FreeVersion(*version, after);
    changed_.notify_all();
  }
  // The worker's references go before the aftermath, so it really frees.
  copy.reset();
  version.reset();
  Fire(after);
}

absl::Status MapperStore::WaitLayer(const DeviceCopy& copy, int layer, absl::Time deadline) const {
  std::unique_lock<std::mutex> lock(mu_);
  const bool done = WaitUntil(changed_, lock, deadline,
                              [&] { return copy.layers_ready > layer || !copy.error.ok(); });
  if (!copy.error.ok()) return copy.error;
  if (!done) {
    return absl::DeadlineExceededError(absl::StrCat("deadline passed while target layer ", layer,
                                                    " was paging in onto ",
                                                    devices_[copy.device]->name));
  }
  return absl::OkStatus();
}

// --- Reporting and model control ---

MapperInfo MapperStore::InfoLocked(const Entry& entry) const {
  MapperInfo info = entry.info;
  info.devices.clear();
  info.placements.clear();
  if (info.state == MapperState::kFailed) {
    info.weight_bytes = 0;
    return info;
  }
  if (!entry.current) {
    info.state = entry.loading ? MapperState::kLoading : MapperState::kDiscovered;
    info.weight_bytes = entry.expected_bytes;
    return info;
  }
  const Version& version = *entry.current;
  info.state = MapperState::kHostResident;
  info.weight_bytes = version.bytes;
  info.devices.push_back("host");
  info.placements.push_back({"host", version.bytes, version.pins, true});
  for (const auto& [device, copy] : version.copies) {
    if (!copy->started) continue;
    const bool ready = copy->layers_ready == copy->num_layers && copy->error.ok();
    info.placements.push_back({devices_[device]->name, copy->bytes, copy->pins, ready});
    if (ready) {
      info.devices.push_back(devices_[device]->name);
      info.state = MapperState::kDeviceResident;
    }
  }
  return info;
}

std::vector<MapperInfo> MapperStore::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<MapperInfo> infos;
  infos.reserve(entries_.size());
  for (const auto& [id, entry] : entries_) infos.push_back(InfoLocked(entry));
  return infos;
}

absl::StatusOr<MapperInfo> MapperStore::Info(const std::string& mapper_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(mapper_id);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("no mapper with id '", mapper_id, "' in ", root_));
  }
  return InfoLocked(it->second);
}

std::vector<TierUsage> MapperStore::Usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TierUsage> usage;
  TierUsage host;
  host.place = "host";
  host.budget_bytes = options_.host_budget_bytes;
  host.used_bytes = host_used_;
  host.reserved_bytes = host_reserved_;
  uint64_t unpinned = 0;
  for (const auto& [id, entry] : entries_) {
    if (!entry.current) continue;
    if (entry.current->pins == 0) unpinned += entry.current->bytes;
    host.pins += entry.current->pins;
  }
  host.pinned_bytes = host_used_ - unpinned;  // retired versions still held are pinned too
  usage.push_back(host);
  for (int d = 0; d < num_devices(); ++d) {
    const Device& dev = *devices_[d];
    if (dev.removed) continue;
    TierUsage tier;
    tier.place = dev.name;
    tier.budget_bytes = dev.budget;
    tier.used_bytes = dev.used;
    tier.reserved_bytes = dev.reserved;
    tier.pinned_bytes = dev.used - EvictableDeviceBytes(d);
    tier.pins = dev.pins;
    usage.push_back(tier);
  }
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
  std::unique_lock<std::mutex> lock(mu_);
  auto it = entries_.find(mapper_id);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("no mapper with id '", mapper_id, "' in ", root_));
  }
  Entry& entry = it->second;
  std::shared_ptr<Version> version;
  std::shared_ptr<DeviceCopy> copy;
  std::string place = "host";
  if (device.empty() || device == "host") {
    version = entry.current;
    if (version) {
      DetachVersion(version, after);
      entry.current = nullptr;
    }
  } else {
    int index = -1;
    for (int d = 0; d < num_devices(); ++d) {
      if (!devices_[d]->removed && devices_[d]->name == device) index = d;
    }
    if (index < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("device='", device, "' is not a device of this server (devices: host",
                       DeviceNames().empty() ? "" : ", ", absl::StrJoin(DeviceNames(), ", "),
                       ")"));
    }
    place = device;
    if (entry.current) {
      auto found = entry.current->copies.find(index);
      if (found != entry.current->copies.end()) {
        copy = found->second;
        DetachCopy(*entry.current, index, after);
      }
    }
  }
  changed_.notify_all();
  const auto pins = [&] { return (version ? version->pins : 0) + (copy ? copy->pins : 0); };
  WaitUntil(changed_, lock, deadline, [&] { return pins() == 0; });
  const int still = pins();
  absl::StatusOr<MapperInfo> info = absl::NotFoundError(
      absl::StrCat("mapper '", mapper_id, "' was removed from ", root_, " meanwhile"));
  if (auto now = entries_.find(mapper_id); now != entries_.end()) info = InfoLocked(now->second);
  lock.unlock();
  Fire(after);
  if (still > 0) {
    return absl::DeadlineExceededError(absl::StrCat(
        "mapper '", mapper_id, "' is unloaded from ", place, " (no new request gets that copy), "
        "but ", still, " in-flight request(s) still hold it; its memory is freed when they "
        "finish"));
  }
  return info;
}

}  // namespace kvt
