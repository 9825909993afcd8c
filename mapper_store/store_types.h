// The mapper store's public value types: mapper states and infos, tier usage, and the options
// of the store and of an acquisition. Shared by the store's components and its callers.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kernels/backend.h"
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
  int window = 1;  // tokens each output token reads (manifest `window`)
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

}  // namespace kvt
