#include "mapper_store/host_tier.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/echo.h"
#include "common/file_util.h"

namespace kvt {
namespace store_internal {

HostTier::HostTier(StoreState* state, DeviceTier* devices, std::string root,
                   const StoreOptions& options)
    : state_(state),
      devices_(devices),
      root_(std::move(root)),
      load_(options.load),
      budget_(options.host_budget_bytes),
      budget_key_(options.host_budget_key) {}

absl::Status HostTier::UnknownMapper(const std::string& mapper_id) const {
  return absl::NotFoundError(absl::StrCat("no mapper with id '", Echo(mapper_id), "' in ", root_));
}

// --- Pins ---

absl::StatusOr<std::shared_ptr<Version>> HostTier::AcquireLocked(const std::string& mapper_id,
                                                                 absl::Time deadline,
                                                                 Aftermath& after) {
  bool missed = false;
  while (true) {
    auto it = state_->entries.find(mapper_id);
    if (it == state_->entries.end()) return UnknownMapper(mapper_id);
    Entry& entry = it->second;
    if (entry.info.state == MapperState::kFailed) {
      return absl::FailedPreconditionError(absl::StrCat("mapper '", mapper_id,
                                                        "' failed to load and cannot serve: ",
                                                        entry.info.state_reason));
    }
    if (entry.current) {
      Version& version = *entry.current;
      ++version.pins;
      version.last_use = ++state_->tick;
      ++entry.info.hits;
      entry.info.last_used_unix_ms = absl::ToUnixMillis(absl::Now());
      after.accesses.push_back({version.mapper, "host", 0, !missed});
      return entry.current;
    }
    if (entry.loading) {  // single flight: wait for the load in progress
      const bool done = state_->changed.AwaitWithDeadline(
          &state_->mu, deadline, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
            auto found = state_->entries.find(mapper_id);
            return found == state_->entries.end() || !found->second.loading;
          });
      if (!done) {
        return absl::DeadlineExceededError(
            absl::StrCat("deadline passed while mapper '", mapper_id, "' was loading"));
      }
      continue;
    }
    missed = true;
    const uint64_t need = entry.expected_bytes;
    if (absl::Status room = Reserve(need, mapper_id, /*evict=*/true, deadline, after); !room.ok()) {
      return room;
    }
    // Reserve may have waited: look again.
    it = state_->entries.find(mapper_id);
    if (it == state_->entries.end() || it->second.current || it->second.loading ||
        it->second.info.state == MapperState::kFailed) {
      reserved_ -= need;
      state_->changed.SignalAll();
      continue;
    }
    LoadReserved(mapper_id, need, after);
  }
}

void HostTier::Release(Version& version, Aftermath& after) {
  --version.pins;
  version.last_use = ++state_->tick;
  if (version.detached && version.pins == 0) FreeVersion(version, after);
}

void HostTier::UnpinVersion(Version& version, Aftermath& after) {
  --version.pins;
  if (version.detached && version.pins == 0) FreeVersion(version, after);
}

// --- Loads ---

void HostTier::ScanLoad(const std::string& id) {
  Aftermath after;
  UniqueLock lock(&state_->mu);
  auto it = state_->entries.find(id);
  if (it == state_->entries.end() || it->second.loading ||
      it->second.info.state == MapperState::kFailed) {
    return;
  }
  const bool replacing = it->second.current != nullptr;
  const uint64_t need = it->second.expected_bytes;
  // No waiting here: a scan must not stall on requests.
  absl::Status room = Reserve(need, id, /*evict=*/replacing, absl::Now(), after);
  it = state_->entries.find(id);  // (scans alone erase entries, and this is the scan)
  if (!room.ok()) {
    DropCurrent(it->second, after);
    state_->changed.SignalAll();
    lock.Unlock();
    state_->Fire(after);
    return;
  }
  LoadReserved(id, need, after);
  lock.Unlock();
  state_->Fire(after);
}

void HostTier::LoadReserved(const std::string& id, uint64_t reserved, Aftermath& after) {
  Entry& entry = state_->entries.find(id)->second;
  entry.loading = true;
  const Fingerprint fingerprint = entry.fingerprint;
  // The caller's lock, let go for the disk read and taken again before returning.
  state_->mu.Unlock();
  state_->Fire(after);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<LoadedMapper>> read = LoadMapperDir(JoinPath(root_, id), load_);
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> loaded =
      read.ok() ? absl::StatusOr<std::shared_ptr<const LoadedMapper>>(std::move(*read))
                : read.status();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  state_->mu.Lock();
  FinishLoad(id, reserved, fingerprint, std::move(loaded), seconds, after);
}

void HostTier::FinishLoad(const std::string& id, uint64_t reserved,
                          const Fingerprint& fingerprint,
                          absl::StatusOr<std::shared_ptr<const LoadedMapper>> loaded,
                          double seconds, Aftermath& after) {
  reserved_ -= reserved;
  state_->changed.SignalAll();
  auto it = state_->entries.find(id);
  if (it == state_->entries.end()) {  // removed while loading
    if (loaded.ok()) after.mappers.push_back(std::move(*loaded));
    return;
  }
  Entry& entry = it->second;
  entry.loading = false;
  if (!loaded.ok()) {
    // Never serves, not even the previous version: it no longer matches the directory.
    entry.info.state = MapperState::kFailed;
    entry.info.state_reason = std::string(loaded.status().message());
    DropCurrent(entry, after);
    return;
  }
  auto version = std::make_shared<Version>();
  version->id = id;
  version->generation = ++entry.info.generation;
  version->mapper = std::move(*loaded);
  version->bytes = version->mapper->weight_bytes();
  version->last_use = ++state_->tick;
  used_ += version->bytes;
  if (entry.current) DetachVersion(entry.current, after);  // the atomic swap
  entry.current = version;
  entry.fingerprint = fingerprint;
  FillFromManifest(version->mapper->manifest(), &entry.info);
  entry.info.state = MapperState::kHostResident;
  entry.info.state_reason.clear();
  ++entry.info.loads;
  after.page_ins.push_back({version->mapper, "host", seconds, false});
}

// --- Budget and eviction ---

absl::Status HostTier::Reserve(uint64_t bytes, const std::string& who, bool evict,
                               absl::Time deadline, Aftermath& after) {
  if (budget_ == 0) {
    reserved_ += bytes;
    return absl::OkStatus();
  }
  if (bytes > budget_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "mapper '", who, "' needs ", Bytes(bytes), " of host memory but ", budget_key_, " is ",
        Bytes(budget_), ": raise the budget to serve it"));
  }
  while (true) {
    if (used_ + reserved_ + bytes <= budget_) {
      reserved_ += bytes;
      return absl::OkStatus();
    }
    if (evict && EvictLru(after)) continue;
    if (absl::Now() >= deadline) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "host memory for mappers is full: ", budget_key_, " is ", Bytes(budget_), ", ",
          Bytes(used_), " held by mappers in use (pinned by in-flight requests)",
          reserved_ > 0 ? absl::StrCat(" and ", Bytes(reserved_), " being loaded") : "",
          "; mapper '", who, "' needs ", Bytes(bytes), "; retry later or raise ", budget_key_));
    }
    WaitOnce(state_->changed, &state_->mu, deadline);  // then re-evaluate from the top
  }
}

bool HostTier::EvictLru(Aftermath& after) {
  Entry* victim = nullptr;
  for (auto& [id, entry] : state_->entries) {
    if (entry.current == nullptr || entry.current->pins > 0) continue;
    if (victim == nullptr || entry.current->last_use < victim->current->last_use) {
      victim = &entry;
    }
  }
  if (victim == nullptr) return false;
  Version& version = *victim->current;
  for (const auto& [device, copy] : version.copies) {
    after.evictions.push_back({version.mapper, devices_->device(device).name, 0, false});
    ++victim->info.evictions;
  }
  after.evictions.push_back({version.mapper, "host", 0, false});
  ++victim->info.evictions;
  DropCurrent(*victim, after);
  state_->changed.SignalAll();
  return true;
}

// --- Freeing ---

void HostTier::FreeVersion(Version& version, Aftermath& after) {
  if (version.freed) return;
  version.freed = true;
  used_ -= version.bytes;
  SameLock devices_lock(Held(state_->mu), devices_->mu());
  for (auto& [device, copy] : version.copies) devices_->FreeCopy(*copy, after);
  version.copies.clear();
  if (version.mapper) after.mappers.push_back(std::move(version.mapper));
}

void HostTier::DetachVersion(const std::shared_ptr<Version>& version, Aftermath& after) {
  version->detached = true;
  if (version->pins == 0) FreeVersion(*version, after);
}

void HostTier::DropCurrent(Entry& entry, Aftermath& after) {
  if (!entry.current) return;
  DetachVersion(entry.current, after);
  entry.current = nullptr;
}

// --- Reporting ---

MapperInfo HostTier::InfoLocked(const Entry& entry) const {
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
  SameLock devices_lock(Held(state_->mu), devices_->mu());
  devices_->AddPlacements(version, &info);
  return info;
}

TierUsage HostTier::Usage() const {
  TierUsage host;
  host.place = "host";
  host.budget_bytes = budget_;
  host.used_bytes = used_;
  host.reserved_bytes = reserved_;
  uint64_t unpinned = 0;
  for (const auto& [id, entry] : state_->entries) {
    if (!entry.current) continue;
    if (entry.current->pins == 0) unpinned += entry.current->bytes;
    host.pins += entry.current->pins;
  }
  host.pinned_bytes = used_ - unpinned;  // retired versions still held are pinned too
  return host;
}

}  // namespace store_internal
}  // namespace kvt
