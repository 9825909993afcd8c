// Client shared-memory regions (Triton's shape): a POSIX shm object, an offset and a size,
// registered by name, mapped read-write into kvtd, and reference-counted so that unregistering
// a region a request is using waits for that request. Every offset and size from the wire is
// overflow-checked against the region.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvt {

class SystemMemoryRegistry {
 public:
  struct RegionInfo {
    std::string name;
    std::string key;
    uint64_t offset = 0;
    uint64_t byte_size = 0;
    int in_use = 0;  // leases held by requests
  };

  // A byte range of a region held by one request; the region stays mapped while it lives.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();
    char* data() const { return data_; }
    uint64_t size() const { return size_; }

   private:
    friend class SystemMemoryRegistry;
    struct Region;
    Lease(std::shared_ptr<Region> region, char* data, uint64_t size);
    std::shared_ptr<Region> region_;
    char* data_ = nullptr;
    uint64_t size_ = 0;
  };

  SystemMemoryRegistry() = default;
  ~SystemMemoryRegistry();

  // Maps [offset, offset + byte_size) of the shm object `key`. Errors: ALREADY_EXISTS (name
  // taken), NOT_FOUND (no such object), INVALID_ARGUMENT (empty name or key, zero size, range
  // overflowing or beyond the object's size).
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);

  // Removes `name` ("" = every region): new requests can no longer use it at once; waits until
  // the requests holding it finish (DEADLINE_EXCEEDED, region kept unusable, if they outlast
  // `deadline`), then unmaps. NOT_FOUND for an unknown name.
  absl::Status Unregister(const std::string& name, absl::Time deadline);

  // Regions by name ("" = all); NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<RegionInfo>> Status(const std::string& name) const;

  // [offset, offset + byte_size) of region `name`, overflow- and bounds-checked; `field` names
  // the request field in errors (e.g. "header.input.region").
  absl::StatusOr<Lease> Acquire(const std::string& name, uint64_t offset, uint64_t byte_size,
                                const std::string& field);

 private:
  mutable absl::Mutex mutex_;
  std::map<std::string, std::shared_ptr<Lease::Region>> regions_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvt
