#include "mapper_store/device_tier.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace kvt {
namespace store_internal {

// --- Devices ---

void DeviceTier::StopAll() {
  for (int d = 0; d < num_devices(); ++d) {
    if (!devices_[d]->removed) devices_[d]->worker.reset();
  }
}

absl::Status DeviceTier::Add(const StoreDevice& spec) {
  MutexLock lock(&state_->mu);
  const int n = num_devices();
  const std::string name = spec.backend->device();
  if (Find(name) >= 0) {
    return absl::AlreadyExistsError(absl::StrCat("device '", name, "' is already in the store"));
  }
  if (n == kMaxDevices) {
    return absl::ResourceExhaustedError(absl::StrCat("at most ", kMaxDevices, " devices"));
  }
  auto device = std::make_unique<Device>();
  device->backend = spec.backend;
  device->name = name;
  device->budget = spec.budget_bytes;
  devices_[n] = std::move(device);
  num_devices_.store(n + 1, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status DeviceTier::Remove(const std::string& name, absl::Time deadline) {
  Aftermath after;
  Device* removed = nullptr;
  {
    MutexLock lock(&state_->mu);
    const int index = Find(name);
    if (index < 0) return absl::NotFoundError(absl::StrCat("no device '", name, "'"));
    Device& dev = *devices_[index];
    // Requests and page-ins still using it (a page-in's worker holds a pin until it ends).
    if (!state_->changed.AwaitWithDeadline(&state_->mu, deadline, [&] { return dev.pins == 0; })) {
      return absl::DeadlineExceededError(absl::StrCat(
          "device '", name, "' is still used by ", dev.pins, " request(s) or page-ins"));
    }
    for (auto& [id, entry] : state_->entries) {
      if (entry.current) DetachCopy(*entry.current, index, after);
    }
    dev.removed = true;
    removed = &dev;
    state_->changed.SignalAll();
  }
  state_->Fire(after);
  removed->worker.reset();
  return absl::OkStatus();
}

std::vector<std::string> DeviceTier::Names() const {
  std::vector<std::string> names;
  for (int d = 0; d < num_devices(); ++d) {
    if (!devices_[d]->removed) names.push_back(devices_[d]->name);
  }
  return names;
}

int DeviceTier::Find(const std::string& name) const {
  for (int d = 0; d < num_devices(); ++d) {
    if (!devices_[d]->removed && devices_[d]->name == name) return d;
  }
  return -1;
}

absl::Status DeviceTier::CheckDevice(const std::string& device) const {
  if (device.empty() || device == "any" || Find(device) >= 0) return absl::OkStatus();
  const std::vector<std::string> names = Names();
  return absl::InvalidArgumentError(
      absl::StrCat("device='", device, "' is not a device of this server (devices: ",
                   names.empty() ? "none" : absl::StrJoin(names, ", "), ")"));
}

absl::StatusOr<std::vector<int>> DeviceTier::Candidates(const std::string& device) const {
  std::vector<int> candidates;
  for (int d = 0; d < num_devices(); ++d) {
    if (devices_[d]->removed) continue;
    if (device.empty() || device == "any" || devices_[d]->name == device) candidates.push_back(d);
  }
  if (candidates.empty()) return CheckDevice(device);
  return candidates;
}

// --- Freeing: the only places device budgets go down. ---

void DeviceTier::FreeCopy(DeviceCopy& copy, Aftermath& after) {
  if (copy.freed) return;
  copy.freed = true;
  devices_[copy.device]->used -= copy.bytes;
  if (copy.prepared) after.prepared.push_back(std::move(copy.prepared));
}

void DeviceTier::DetachCopy(Version& version, int device, Aftermath& after) {
  auto it = version.copies.find(device);
  if (it == version.copies.end()) return;
  std::shared_ptr<DeviceCopy> copy = it->second;
  version.copies.erase(it);
  copy->detached = true;
  if (copy->pins == 0) FreeCopy(*copy, after);
}

void DeviceTier::Unpin(DeviceCopy& copy, Aftermath& after) {
  --copy.pins;
  --devices_[copy.device]->pins;
  copy.last_use = ++state_->tick;
  if (copy.detached && copy.pins == 0) FreeCopy(copy, after);
}

// --- Placement and eviction ---

uint64_t DeviceTier::EvictableBytes(int device) const {
  uint64_t bytes = 0;
  for (const auto& [id, entry] : state_->entries) {
    if (!entry.current) continue;
    auto it = entry.current->copies.find(device);
    if (it != entry.current->copies.end() && it->second->pins == 0) bytes += it->second->bytes;
  }
  return bytes;
}

void DeviceTier::EvictFor(int device, uint64_t bytes, Aftermath& after) {
  Device& dev = *devices_[device];
  while (dev.budget > 0 && dev.used + dev.reserved + bytes > dev.budget) {
    Entry* victim = nullptr;
    for (auto& [id, entry] : state_->entries) {
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

absl::StatusOr<int> DeviceTier::Choose(const std::vector<int>& candidates, uint64_t bytes,
                                       const std::string& who, bool* must_wait) const {
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
    const int rank = bytes <= free ? 0 : bytes <= free + EvictableBytes(d) ? 1 : 2;
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
        "mapper '", who, "' needs ", Bytes(bytes), " on a device but ", budget_key_,
        " is smaller (", absl::StrJoin(too_small, ", "), "): raise the budget to serve it"));
  }
  *must_wait = best_rank == 2;
  return best;
}

// --- Pinning and page-in ---

absl::StatusOr<std::shared_ptr<DeviceCopy>> DeviceTier::Pin(
    const std::shared_ptr<Version>& version, const std::string& device, absl::Time deadline) {
  absl::StatusOr<std::vector<int>> candidates = Candidates(device);
  if (!candidates.ok()) return candidates.status();
  Aftermath after;
  UniqueLock lock(&state_->mu);
  const std::string& who = version->id;
  while (true) {
    // A copy that exists, or is paging in for another request: share it.
    absl::StatusOr<std::shared_ptr<DeviceCopy>> shared =
        ShareCopy(*version, *candidates, deadline, after);
    if (!shared.ok() || *shared != nullptr) {
      lock.Unlock();
      state_->Fire(after);
      return shared;
    }
    // A new copy: on the device with room and the least load.
    const MapperView& view = version->mapper->view();
    bool must_wait = false;
    uint64_t estimate = 0;
    for (int d : *candidates) {
      estimate = std::max(estimate, devices_[d]->backend->PreparedBytesEstimate(view));
    }
    absl::StatusOr<int> chosen = Choose(*candidates, estimate, who, &must_wait);
    if (!chosen.ok()) return chosen.status();
    if (!must_wait) {
      absl::Time started;
      absl::StatusOr<std::shared_ptr<DeviceCopy>> copy =
          StartCopy(version, *chosen, after, &started);
      lock.Unlock();
      state_->Fire(after);
      if (copy.ok()) {
        devices_[*chosen]->worker->Submit(
            [this, version, copy = *copy, started] { StreamLayers(version, copy, started); });
      }
      return copy;
    }
    if (absl::Now() >= deadline) {
      const Device& dev = *devices_[*chosen];
      return absl::ResourceExhaustedError(absl::StrCat(
          "device memory for mappers is full: ", budget_key_, " is ", Bytes(dev.budget), " on ",
          dev.name, ", ", Bytes(dev.used + dev.reserved),
          " held by mappers in use (pinned by in-flight requests) or paging in; mapper '", who,
          "' needs ", Bytes(estimate), "; retry later or raise ", budget_key_));
    }
    WaitOnce(state_->changed, &state_->mu, deadline);
  }
}

absl::StatusOr<std::shared_ptr<DeviceCopy>> DeviceTier::ShareCopy(
    Version& version, const std::vector<int>& candidates, absl::Time deadline, Aftermath& after) {
  std::shared_ptr<DeviceCopy> copy;
  for (int d : candidates) {
    auto it = version.copies.find(d);
    if (it == version.copies.end()) continue;
    if (!copy || devices_[d]->pins < devices_[copy->device]->pins) copy = it->second;
  }
  if (!copy) return copy;
  ++copy->pins;
  ++devices_[copy->device]->pins;
  copy->last_use = ++state_->tick;
  const bool done = state_->changed.AwaitWithDeadline(
      &state_->mu, deadline, [&] { return copy->started || !copy->error.ok(); });
  if (!done || !copy->error.ok()) {
    --copy->pins;
    --devices_[copy->device]->pins;
    if (copy->detached && copy->pins == 0) FreeCopy(*copy, after);
    absl::Status error =
        done ? copy->error
             : absl::DeadlineExceededError(absl::StrCat("deadline passed while mapper '",
                                                        version.id, "' was paging in onto ",
                                                        devices_[copy->device]->name));
    state_->changed.SignalAll();
    return error;
  }
  after.accesses.push_back({version.mapper, devices_[copy->device]->name, 0, true});
  return copy;
}

absl::StatusOr<std::shared_ptr<DeviceCopy>> DeviceTier::StartCopy(
    const std::shared_ptr<Version>& version, int device, Aftermath& after, absl::Time* started) {
  Device& dev = *devices_[device];
  const std::string& who = version->id;
  const uint64_t need = dev.backend->PreparedBytesEstimate(version->mapper->view());
  EvictFor(device, need, after);
  auto copy = std::make_shared<DeviceCopy>();
  copy->device = device;
  copy->reserved = need;
  copy->num_layers = version->mapper->view().target.num_layers;
  copy->pins = 2;  // the caller's and the page-in worker's
  copy->last_use = ++state_->tick;
  dev.pins += 2;
  dev.reserved += need;
  version->copies[device] = copy;
  ++version->pins;  // the worker's
  // The caller's lock, let go while the backend prepares and taken again.
  state_->mu.Unlock();
  state_->Fire(after);

  *started = absl::Now();
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared =
      dev.backend->BeginPrepare(version->mapper->view());

  state_->mu.Lock();
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
    host_->UnpinVersion(*version, after);
    state_->changed.SignalAll();
    return copy->error;
  }
  copy->prepared = *prepared;
  copy->bytes = copy->prepared->bytes();
  dev.used += copy->bytes;
  copy->started = true;
  if (auto it = state_->entries.find(who);
      it != state_->entries.end() && it->second.current == version) {
    ++it->second.info.page_ins;
  }
  after.accesses.push_back({version->mapper, dev.name, 0, false});
  state_->changed.SignalAll();
  return copy;
}

void DeviceTier::StreamLayers(std::shared_ptr<Version> version, std::shared_ptr<DeviceCopy> copy,
                              absl::Time started) {
  Device& dev = *devices_[copy->device];
  absl::Status status;
  for (int layer = 0; layer < copy->num_layers; ++layer) {
    status = dev.backend->PrepareLayer(*copy->prepared, layer);
    if (!status.ok()) break;
    MutexLock lock(&state_->mu);
    copy->layers_ready = layer + 1;
    state_->changed.SignalAll();
  }
  Aftermath after;
  {
    MutexLock lock(&state_->mu);
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
    // Not Unpin: the worker's pin is no use, so it must not refresh the copy's LRU position.
    --copy->pins;
    --dev.pins;
    if (copy->detached && copy->pins == 0) FreeCopy(*copy, after);
    host_->UnpinVersion(*version, after);
    state_->changed.SignalAll();
  }
  // The worker's references go before the aftermath, so it really frees.
  copy.reset();
  version.reset();
  state_->Fire(after);
}

absl::Status DeviceTier::WaitLayer(const DeviceCopy& copy, int layer, absl::Time deadline) const {
  MutexLock lock(&state_->mu);
  const bool done = state_->changed.AwaitWithDeadline(
      &state_->mu, deadline, [&] { return copy.layers_ready > layer || !copy.error.ok(); });
  if (!copy.error.ok()) return copy.error;
  if (!done) {
    return absl::DeadlineExceededError(absl::StrCat("deadline passed while target layer ", layer,
                                                    " was paging in onto ",
                                                    devices_[copy.device]->name));
  }
  return absl::OkStatus();
}

// --- Reporting ---

void DeviceTier::AddPlacements(const Version& version, MapperInfo* info) const {
  for (const auto& [device, copy] : version.copies) {
    if (!copy->started) continue;
    const bool ready = copy->layers_ready == copy->num_layers && copy->error.ok();
    info->placements.push_back({devices_[device]->name, copy->bytes, copy->pins, ready});
    if (ready) {
      info->devices.push_back(devices_[device]->name);
      info->state = MapperState::kDeviceResident;
    }
  }
}

void DeviceTier::AppendUsage(std::vector<TierUsage>* usage) const {
  for (int d = 0; d < num_devices(); ++d) {
    const Device& dev = *devices_[d];
    if (dev.removed) continue;
    TierUsage tier;
    tier.place = dev.name;
    tier.budget_bytes = dev.budget;
    tier.used_bytes = dev.used;
    tier.reserved_bytes = dev.reserved;
    tier.pinned_bytes = dev.used - EvictableBytes(d);
    tier.pins = dev.pins;
    usage->push_back(tier);
  }
}

}  // namespace store_internal
}  // namespace kvt
