// Client shared-memory regions (Triton's shape): a POSIX shm object, an offset and a size,
// registered by name, mapped read-write into kvtd, and reference-counted so that unregistering
// a region a request is using waits for that request. Every offset and size from the wire is
// overflow-checked against the region.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/region_registry.h"

namespace kvt {

// Unregister, Status, Contains and Acquire are RegionRegistry's (see there); only the
// registration, which maps the object, is this class's own.
class SystemMemoryRegistry : private RegionRegistry {
 public:
  using RegionRegistry::Lease;
  using RegionRegistry::RegionInfo;

  SystemMemoryRegistry() : RegionRegistry("system memory") {}

  // Maps [offset, offset + byte_size) of the shm object `key`. Errors: ALREADY_EXISTS (name
  // taken), NOT_FOUND (no such object), INVALID_ARGUMENT (empty name or key, zero size, range
  // overflowing or beyond the object's size).
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);

  using RegionRegistry::Acquire;
  using RegionRegistry::Contains;
  using RegionRegistry::Status;
  using RegionRegistry::Unregister;
};

}  // namespace kvt
