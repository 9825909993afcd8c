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

class SystemMemoryRegistry {
 public:
  using RegionInfo = RegionRegistry::RegionInfo;
  using Lease = RegionRegistry::Lease;

  SystemMemoryRegistry() = default;

  // Maps [offset, offset + byte_size) of the shm object `key`. Errors: ALREADY_EXISTS (name
  // taken), NOT_FOUND (no such object), INVALID_ARGUMENT (empty name or key, zero size, range
  // overflowing or beyond the object's size).
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);

  // Removes `name` ("" = every region): new requests can no longer use it at once; waits until
  // the requests holding it finish (DEADLINE_EXCEEDED, region kept unusable, if they outlast
  // `deadline`), then unmaps. NOT_FOUND for an unknown name.
  absl::Status Unregister(const std::string& name, absl::Time deadline) {
    return regions_.Unregister(name, deadline);
  }

  // Regions by name ("" = all); NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<RegionInfo>> Status(const std::string& name) const {
    return regions_.Status(name);
  }

  bool Contains(const std::string& name) const { return regions_.Contains(name); }

  // [offset, offset + byte_size) of region `name`, overflow- and bounds-checked; `field` names
  // the request field in errors (e.g. "header.input.region").
  absl::StatusOr<Lease> Acquire(const std::string& name, uint64_t offset, uint64_t byte_size,
                                const std::string& field) {
    return regions_.Acquire(name, offset, byte_size, field);
  }

 private:
  RegionRegistry regions_{"system memory"};
};

}  // namespace kvt
