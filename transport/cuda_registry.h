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

// Unregister, Status, Contains and Acquire are RegionRegistry's (a lease's data() is a device
// pointer on lease.device_id()); only the registration, which opens the handle, is this class's.
class CudaMemoryRegistry : private RegionRegistry {
 public:
  using RegionRegistry::Lease;
  using RegionRegistry::RegionInfo;

  CudaMemoryRegistry() : RegionRegistry("CUDA memory") {}

  // Opens `raw_handle` on `device_id`. INVALID_ARGUMENT: empty name, handle not 64 bytes, zero
  // size, byte_size beyond the allocation, a handle the driver refuses; ALREADY_EXISTS: name
  // taken; FAILED_PRECONDITION: built without CUDA; UNAVAILABLE: no CUDA device.
  absl::Status Register(const std::string& name, const std::string& raw_handle, int device_id,
                        uint64_t byte_size);

  using RegionRegistry::Acquire;
  using RegionRegistry::Contains;
  using RegionRegistry::Status;
  using RegionRegistry::Unregister;
};

}  // namespace kvt
