#include "transport/region_registry.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/echo.h"

namespace kvt {

struct RegionRegistry::Lease::Entry {
  Region region;
  Mutex mutex;
  CondVar idle;
  int in_use ABSL_GUARDED_BY(mutex) = 0;
  bool retired ABSL_GUARDED_BY(mutex) = false;
  // An unregister timed out: the last lease to go removes the entry from `owner`.
  bool unregister_pending ABSL_GUARDED_BY(mutex) = false;
  RegionRegistry* owner ABSL_GUARDED_BY(mutex) = nullptr;  // cleared when the registry goes

  ~Entry() {
    if (region.release) region.release();
  }
};

RegionRegistry::Lease::Lease(std::shared_ptr<Entry> entry, char* data, uint64_t size)
    : entry_(std::move(entry)), data_(data), size_(size) {}

void RegionRegistry::Lease::Release() {
  if (entry_ == nullptr) return;
  RegionRegistry* finish = nullptr;
  {
    MutexLock lock(&entry_->mutex);
    if (--entry_->in_use == 0 && entry_->unregister_pending) finish = entry_->owner;
  }
  entry_->idle.SignalAll();
  if (finish != nullptr) finish->Forget(entry_);
  entry_.reset();
}

absl::Status RegionRegistry::Lease::CheckIntact(const std::string& field) const {
  if (entry_ == nullptr || !entry_->region.check_backing) return absl::OkStatus();
  absl::Status backing = entry_->region.check_backing();
  if (backing.ok()) return backing;
  return absl::FailedPreconditionError(absl::StrCat(
      field, ": region '", Echo(entry_->region.name), "' no longer holds the client's bytes: ",
      backing.message()));
}

RegionRegistry::Lease& RegionRegistry::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    entry_ = std::move(other.entry_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

RegionRegistry::Lease::~Lease() { Release(); }

int RegionRegistry::Lease::device_id() const {
  return entry_ == nullptr ? -1 : entry_->region.device_id;
}

RegionRegistry::RegionRegistry(std::string kind) : kind_(std::move(kind)) {}

RegionRegistry::~RegionRegistry() {
  MutexLock lock(&mutex_);
  for (auto& [name, entry] : regions_) {
    MutexLock entry_lock(&entry->mutex);
    entry->owner = nullptr;
  }
}

void RegionRegistry::Forget(const std::shared_ptr<Lease::Entry>& entry) {
  MutexLock lock(&mutex_);
  auto it = regions_.find(entry->region.name);
  if (it != regions_.end() && it->second == entry) regions_.erase(it);
}

bool RegionRegistry::Contains(const std::string& name) const {
  MutexLock lock(&mutex_);
  return regions_.count(name) > 0;
}

absl::Status RegionRegistry::Add(Region region) {
  auto entry = std::make_shared<Lease::Entry>();
  const std::string name = region.name;
  entry->region = std::move(region);
  {
    MutexLock entry_lock(&entry->mutex);
    entry->owner = this;
  }
  MutexLock lock(&mutex_);
  if (!regions_.emplace(name, entry).second) {
    return absl::AlreadyExistsError(
        absl::StrCat("a ", kind_, " region named '", Echo(name), "' is registered"));
  }
  return absl::OkStatus();
}

absl::Status RegionRegistry::Unregister(const std::string& name, absl::Time deadline) {
  std::vector<std::shared_ptr<Lease::Entry>> retiring;
  {
    MutexLock lock(&mutex_);
    if (name.empty()) {
      for (auto& [region_name, entry] : regions_) retiring.push_back(entry);
    } else {
      auto it = regions_.find(name);
      if (it == regions_.end()) {
        return absl::NotFoundError(absl::StrCat("no ", kind_, " region named '", Echo(name), "'"));
      }
      retiring.push_back(it->second);
    }
    for (const auto& entry : retiring) {
      MutexLock entry_lock(&entry->mutex);
      entry->retired = true;  // no new leases from here on
    }
  }
  std::string busy;  // the first region still in use at the deadline
  int busy_requests = 0;
  for (const auto& entry : retiring) {
    MutexLock entry_lock(&entry->mutex);
    if (!entry->idle.AwaitWithDeadline(&entry->mutex, deadline,
                                       [&entry]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(entry->mutex) {
                                         return entry->in_use == 0;
                                       })) {
      busy = entry->region.name;
      busy_requests = entry->in_use;
      break;
    }
  }
  // Regions no request holds go now; a region still in use goes when its last lease is
  // released (Lease::Release), under the same lock that decides it here, so none is missed.
  std::vector<std::shared_ptr<Lease::Entry>> idle;
  for (const auto& entry : retiring) {
    MutexLock entry_lock(&entry->mutex);
    if (entry->in_use == 0) {
      idle.push_back(entry);
    } else {
      entry->unregister_pending = true;
    }
  }
  for (const auto& entry : idle) Forget(entry);
  if (!busy.empty()) {
    return absl::DeadlineExceededError(absl::StrCat(
        kind_, " region '", Echo(busy), "' is still used by ", busy_requests,
        " request(s); it accepts no new ones and is unregistered (its name free again) when "
        "they finish"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RegionRegistry::RegionInfo>> RegionRegistry::Status(
    const std::string& name) const {
  std::vector<RegionInfo> infos;
  MutexLock lock(&mutex_);
  for (const auto& [region_name, entry] : regions_) {
    if (!name.empty() && region_name != name) continue;
    MutexLock entry_lock(&entry->mutex);
    const Region& r = entry->region;
    infos.push_back({r.name, r.key, r.offset, r.byte_size, r.device_id, entry->in_use});
  }
  if (!name.empty() && infos.empty()) {
    return absl::NotFoundError(absl::StrCat("no ", kind_, " region named '", Echo(name), "'"));
  }
  return infos;
}

absl::StatusOr<RegionRegistry::Lease> RegionRegistry::Acquire(const std::string& name,
                                                              uint64_t offset,
                                                              uint64_t byte_size,
                                                              const std::string& field) {
  std::shared_ptr<Lease::Entry> entry;
  {
    MutexLock lock(&mutex_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat(field, ": no ", kind_, " region named '", name,
                                              "'"));
    }
    entry = it->second;
  }
  // Every element kvt reads or writes in a region is 2 or 4 bytes wide and is accessed in place
  // through typed pointers: an offset that is not a multiple of 4 would make those accesses
  // misaligned (undefined behaviour, and slower where it works).
  if (offset % kRegionOffsetAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".offset=", offset,
                                                   " is not a multiple of ",
                                                   kRegionOffsetAlignment, " bytes"));
  }
  const uint64_t region_size = entry->region.byte_size;
  if (offset > region_size || byte_size > region_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": offset=", offset, " + byte_size=", byte_size, " lies outside region '", Echo(name),
        "' of ", region_size, " bytes"));
  }
  {
    MutexLock entry_lock(&entry->mutex);
    if (entry->retired) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, ": region '", Echo(name), "' is being unregistered"));
    }
    ++entry->in_use;
  }
  char* data = entry->region.base + offset;
  Lease lease(std::move(entry), data, byte_size);
  // A region whose object shrank since it was registered is refused before anything reads it.
  if (absl::Status intact = lease.CheckIntact(field); !intact.ok()) return intact;
  return lease;
}

}  // namespace kvt
