#include "transport/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvt {

// One mapped region. Its in_use count is guarded by the registry's mutex through the leases.
struct SystemMemoryRegistry::Lease::Region {
  std::string name;
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  void* mapping = nullptr;
  size_t mapping_size = 0;
  char* base = nullptr;  // = region offset 0
  absl::Mutex mutex;
  int in_use ABSL_GUARDED_BY(mutex) = 0;
  bool retired ABSL_GUARDED_BY(mutex) = false;

  ~Region() {
    if (mapping != nullptr) munmap(mapping, mapping_size);
  }
};

SystemMemoryRegistry::Lease::Lease(std::shared_ptr<Region> region, char* data, uint64_t size)
    : region_(std::move(region)), data_(data), size_(size) {}

SystemMemoryRegistry::Lease::Lease(Lease&& other) noexcept
    : region_(std::move(other.region_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

SystemMemoryRegistry::Lease& SystemMemoryRegistry::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (region_ != nullptr) {
      absl::MutexLock lock(&region_->mutex);
      --region_->in_use;
    }
    region_ = std::move(other.region_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

SystemMemoryRegistry::Lease::~Lease() {
  if (region_ == nullptr) return;
  absl::MutexLock lock(&region_->mutex);
  --region_->in_use;
}

SystemMemoryRegistry::~SystemMemoryRegistry() = default;

absl::Status SystemMemoryRegistry::Register(const std::string& name, const std::string& key,
                                            uint64_t offset, uint64_t byte_size) {
  if (name.empty()) return absl::InvalidArgumentError("name must not be empty");
  if (key.empty()) return absl::InvalidArgumentError("key must name a POSIX shm object");
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  if (offset > UINT64_MAX - byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset=", offset, " + byte_size=", byte_size, " overflows"));
  }
  {
    absl::MutexLock lock(&mutex_);
    if (regions_.count(name)) {
      return absl::AlreadyExistsError(absl::StrCat("a region named '", name, "' is registered"));
    }
  }
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("key='", key, "': shm_open failed: ",
                                            std::strerror(errno)));
  }
  struct stat info;
  if (fstat(fd, &info) != 0) {
    const int error = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("key='", key, "': fstat: ", std::strerror(error)));
  }
  const uint64_t object_size = static_cast<uint64_t>(info.st_size);
  if (offset + byte_size > object_size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "offset=", offset, " + byte_size=", byte_size, " exceeds the ", object_size,
        " bytes of shm object '", key, "'"));
  }
  // mmap needs a page-aligned file offset: map from the page holding `offset`.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t aligned = offset / page * page;
  auto region = std::make_shared<Lease::Region>();
  region->name = name;
  region->key = key;
  region->offset = offset;
  region->byte_size = byte_size;
  region->mapping_size = static_cast<size_t>(offset - aligned + byte_size);
  region->mapping = mmap(nullptr, region->mapping_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                         static_cast<off_t>(aligned));
  const int map_error = errno;
  close(fd);
  if (region->mapping == MAP_FAILED) {
    region->mapping = nullptr;
    return absl::InternalError(absl::StrCat("key='", key, "': mmap of ", byte_size,
                                            " bytes failed: ", std::strerror(map_error)));
  }
  region->base = static_cast<char*>(region->mapping) + (offset - aligned);
  absl::MutexLock lock(&mutex_);
  if (!regions_.emplace(name, std::move(region)).second) {
    return absl::AlreadyExistsError(absl::StrCat("a region named '", name, "' is registered"));
  }
  return absl::OkStatus();
}

absl::Status SystemMemoryRegistry::Unregister(const std::string& name, absl::Time deadline) {
  std::vector<std::shared_ptr<Lease::Region>> retiring;
  {
    absl::MutexLock lock(&mutex_);
    if (name.empty()) {
      for (auto& [region_name, region] : regions_) retiring.push_back(region);
    } else {
      auto it = regions_.find(name);
      if (it == regions_.end()) {
        return absl::NotFoundError(absl::StrCat("no system memory region named '", name, "'"));
      }
      retiring.push_back(it->second);
    }
    for (const auto& region : retiring) {
      absl::MutexLock region_lock(&region->mutex);
      region->retired = true;  // no new leases from here on
    }
  }
  for (const auto& region : retiring) {
    absl::MutexLock region_lock(&region->mutex);
    auto idle = [&region]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(region->mutex) {
      return region->in_use == 0;
    };
    if (!region->mutex.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "region '", region->name, "' is still used by ", region->in_use,
          " request(s); it accepts no new ones and is unmapped when they finish"));
    }
  }
  absl::MutexLock lock(&mutex_);
  for (const auto& region : retiring) {
    auto it = regions_.find(region->name);
    if (it != regions_.end() && it->second == region) regions_.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SystemMemoryRegistry::RegionInfo>> SystemMemoryRegistry::Status(
    const std::string& name) const {
  std::vector<RegionInfo> infos;
  absl::MutexLock lock(&mutex_);
  for (const auto& [region_name, region] : regions_) {
    if (!name.empty() && region_name != name) continue;
    absl::MutexLock region_lock(&region->mutex);
    infos.push_back({region->name, region->key, region->offset, region->byte_size,
                     region->in_use});
  }
  if (!name.empty() && infos.empty()) {
    return absl::NotFoundError(absl::StrCat("no system memory region named '", name, "'"));
  }
  return infos;
}

absl::StatusOr<SystemMemoryRegistry::Lease> SystemMemoryRegistry::Acquire(
    const std::string& name, uint64_t offset, uint64_t byte_size, const std::string& field) {
  std::shared_ptr<Lease::Region> region;
  {
    absl::MutexLock lock(&mutex_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat(field, ": no system memory region named '", name, "'"));
    }
    region = it->second;
  }
  if (offset > region->byte_size || byte_size > region->byte_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": offset=", offset, " + byte_size=", byte_size, " lies outside region '", name,
        "' of ", region->byte_size, " bytes"));
  }
  absl::MutexLock region_lock(&region->mutex);
  if (region->retired) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": region '", name, "' is being unregistered"));
  }
  ++region->in_use;
  char* data = region->base + offset;
  return Lease(std::move(region), data, byte_size);
}

}  // namespace kvt
