// Client CUDA memory regions (Triton's RegisterCudaMemory shape): a device allocation another
// process exported as a cudaIpcMemHandle, opened in kvtd with its size checked against the
// real allocation, registered by name and leased by requests like system-memory regions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/region_registry.h"

namespace kvt {

class CudaMemoryRegistry {
 public:
  using RegionInfo = RegionRegistry::RegionInfo;
  using Lease = RegionRegistry::Lease;

  // Opens `raw_handle` on `device_id`. INVALID_ARGUMENT: empty name, handle not 64 bytes, zero
  // size, byte_size beyond the allocation, a handle the driver refuses; ALREADY_EXISTS: name
  // taken; FAILED_PRECONDITION: built without CUDA; UNAVAILABLE: no CUDA device.
  absl::Status Register(const std::string& name, const std::string& raw_handle, int device_id,
                        uint64_t byte_size);
  absl::Status Unregister(const std::string& name, absl::Time deadline) {
    return regions_.Unregister(name, deadline);
  }
  absl::StatusOr<std::vector<RegionInfo>> Status(const std::string& name) const {
    return regions_.Status(name);
  }
  bool Contains(const std::string& name) const { return regions_.Contains(name); }
  // A lease's data() is a device pointer on lease.device_id().
  absl::StatusOr<Lease> Acquire(const std::string& name, uint64_t offset, uint64_t byte_size,
                                const std::string& field) {
    return regions_.Acquire(name, offset, byte_size, field);
  }

 private:
  RegionRegistry regions_{"CUDA memory"};
};

}  // namespace kvt
