// How kvtd builds its mapper store from the config: the budgets and their automatic defaults,
// the compute devices, hot-reload polling, the preload list, and the telemetry hooks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "mapper_store/store.h"
#include "server/backend_self_check.h"
#include "server/config.h"
#include "server/metrics.h"

namespace kvt {

// mapper_store.host_budget_bytes, or 80% of physical memory when it is 0.
uint64_t HostBudgetBytes(const KvtdConfig& config);
// mapper_store.device_budget_bytes, or when 0: 90% of the backend's device memory if it reports
// it (Backend::DeviceMemoryBytes) less its reserved call workspaces (ReservedDeviceBytes), else
// the host budget (the CPU backend's copies live there).
uint64_t DeviceBudgetBytes(const KvtdConfig& config, const Backend& backend);
// The automatic part: 90% of `memory` less the backend's reserved bytes (call workspaces), at
// least 10% of `memory`.
uint64_t AutomaticDeviceBudget(uint64_t memory, uint64_t reserved);

// Store options for kvtd: budgets, `backend` as the one device, load_on_scan, and pinned host
// memory for the weights when `backend` is CUDA.
StoreOptions MakeStoreOptions(const KvtdConfig& config, Backend* backend);
// The same with several devices (the first one decides pinned memory).
StoreOptions MakeStoreOptions(const KvtdConfig& config, const std::vector<Backend*>& devices);

// With a CUDA `first` backend on GPU 0: a CUDA backend for each further visible GPU (each a
// device of the store). Empty otherwise. A GPU whose backend cannot start or fails its start-up
// self-check (against the float64 reference; appended to `self_checks` when given) is left out,
// with a warning.
std::vector<std::unique_ptr<Backend>> MoreGpuBackends(
    const Backend& first, std::vector<SelfCheckReport>* self_checks = nullptr);

// Loads every id of mapper_store.preload into host memory and onto a device, in order. Errors
// name the key and the id (unknown, FAILED, or too large for a budget).
absl::Status PreloadMappers(MapperStore* store, const std::vector<std::string>& ids,
                            absl::Time deadline);

// Store events -> kvt_mapper_page_ins_total, kvt_mapper_page_in_duration_seconds,
// kvt_mapper_evictions_total, kvt_mapper_acquisitions_total. `metrics` must outlive the hooks
// (reset them with MapperStore::SetEvents({}) first).
StoreEvents MetricsEvents(Metrics* metrics);

}  // namespace kvt
