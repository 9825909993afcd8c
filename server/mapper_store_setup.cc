#include "server/mapper_store_setup.h"

#include <algorithm>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "mapper_store/pinned_memory.h"

namespace kvt {

uint64_t HostBudgetBytes(const KvtdConfig& config) {
  if (config.mapper_store.host_budget_bytes > 0) {
    return static_cast<uint64_t>(config.mapper_store.host_budget_bytes);
  }
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;  // unknown: no limit
  // The rest is for request buffers, the kernel and everything else on the machine.
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size) / 10 * 8;
}

uint64_t AutomaticDeviceBudget(uint64_t memory, uint64_t reserved) {
  const uint64_t usable = memory / 10 * 9;
  // Never below a tenth of the device: a budget of 0 would mean "no limit" to the store.
  return std::max(memory / 10, usable > reserved ? usable - reserved : 0);
}

uint64_t DeviceBudgetBytes(const KvtdConfig& config, const Backend& backend) {
  if (config.mapper_store.device_budget_bytes > 0) {
    return static_cast<uint64_t>(config.mapper_store.device_budget_bytes);
  }
  // A GPU also needs room for request caches and the backend's bounded call workspaces.
  if (const uint64_t memory = backend.DeviceMemoryBytes(); memory > 0) {
    return AutomaticDeviceBudget(memory, backend.ReservedDeviceBytes());
  }
  return HostBudgetBytes(config);
}

StoreOptions MakeStoreOptions(const KvtdConfig& config, const std::vector<Backend*>& devices) {
  StoreOptions options;
  options.host_budget_bytes = HostBudgetBytes(config);
  options.load_on_scan = config.mapper_store.load_on_scan;
  for (Backend* backend : devices) {
    options.devices.push_back({backend, DeviceBudgetBytes(config, *backend)});
  }
  // Page-ins onto a GPU copy from page-locked memory at full bus speed (and asynchronously).
  if (!devices.empty() && devices[0]->name() == "cuda" && PinnedMemoryAvailable()) {
    options.load.allocator = AllocatePinnedHostBuffer;
  }
  return options;
}

StoreOptions MakeStoreOptions(const KvtdConfig& config, Backend* backend) {
  return MakeStoreOptions(config,
                          backend == nullptr ? std::vector<Backend*>() : std::vector<Backend*>{backend});
}

std::vector<std::unique_ptr<Backend>> MoreGpuBackends(const Backend& first,
                                                      std::vector<SelfCheckReport>* self_checks) {
  std::vector<std::unique_ptr<Backend>> gpus;
  if (first.name() != "cuda") return gpus;
  const absl::StatusOr<int> count = cuda::DeviceCount();
  for (int device = 1; count.ok() && device < *count; ++device) {
    CudaBackendOptions options;
    options.device = device;
    absl::StatusOr<std::unique_ptr<Backend>> gpu = NewCudaBackend(options);
    if (!gpu.ok()) {
      KVT_LOG(kWarning, "GPU not used for mappers")
          .With("device", device)
          .With("error", gpu.status().message());
      continue;
    }
    // The same start-up self-check as GPU 0's, against the float64 reference.
    SelfCheckReport report = RunBackendSelfCheck(**gpu, nullptr);
    LogSelfCheck(report);
    const bool passed = report.passed();
    if (self_checks != nullptr) self_checks->push_back(report);
    if (!passed) {
      KVT_LOG(kWarning, "GPU not used for mappers")
          .With("device", device)
          .With("error", report.Summary());
      continue;
    }
    gpus.push_back(*std::move(gpu));
  }
  return gpus;
}

absl::Status PreloadMappers(MapperStore* store, const std::vector<std::string>& ids,
                            absl::Time deadline) {
  for (const std::string& id : ids) {
    const bool has_device = !store->DeviceNames().empty();
    absl::StatusOr<MapperInfo> info = store->Load(id, has_device ? "any" : "host", deadline);
    if (!info.ok()) {
      return absl::Status(info.status().code(),
                          absl::StrCat("mapper_store.preload: '", id, "': ",
                                       info.status().message()));
    }
  }
  return absl::OkStatus();
}

StoreEvents MetricsEvents(Metrics* metrics) {
  StoreEvents events;
  events.page_in = [metrics](const LoadedMapper& mapper, const std::string& place,
                             double seconds) {
    metrics->RecordPageIn(PairLabels::Of(mapper.view()), place, seconds);
  };
  events.eviction = [metrics](const LoadedMapper& mapper, const std::string& place) {
    metrics->RecordEviction(PairLabels::Of(mapper.view()), place);
  };
  events.access = [metrics](const LoadedMapper& mapper, const std::string& place, bool hit) {
    metrics->RecordMapperAccess(PairLabels::Of(mapper.view()), place, hit);
  };
  return events;
}

}  // namespace kvt
