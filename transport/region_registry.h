// Named client memory regions that requests lease, shared by system shared memory and CUDA IPC:
// registration by name, bounds- and overflow-checked leases, and reference counting so that
// unregistering a region in use makes it unusable at once and waits for the requests holding
// it before its memory is released.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace kvt {

// Leases start at offsets that are multiples of this (see RegionRegistry::Acquire).
inline constexpr uint64_t kRegionOffsetAlignment = 4;

class RegionRegistry {
 public:
  // What a registration mapped.
  struct Region {
    std::string name;
    std::string key;         // POSIX shm object; empty for CUDA memory
    uint64_t offset = 0;     // of the region inside the object
    uint64_t byte_size = 0;
    int device_id = -1;      // CUDA device holding the bytes; -1: host memory
    char* base = nullptr;    // region byte 0 (a device pointer when device_id >= 0)
    std::function<void()> release;  // unmaps / closes; runs once no lease is left
    // Whether the bytes are still the client's (a shm object can be truncated under kvtd):
    // asked at every lease and when a request is done with its lease; the error says why not.
    // Empty: always.
    std::function<absl::Status()> check_backing;
  };
  struct RegionInfo {
    std::string name;
    std::string key;
    uint64_t offset = 0;
    uint64_t byte_size = 0;
    int device_id = -1;
    int in_use = 0;  // leases held by requests
  };

  // A byte range of a region held by one request; the region stays mapped while it lives.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept = default;
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();
    char* data() const { return data_; }
    uint64_t size() const { return size_; }
    int device_id() const;  // -1: host memory
    // The region's backing still intact (Region::check_backing), checked when the lease is
    // taken and again once the request is done with it; FAILED_PRECONDITION naming `field`
    // otherwise: what was read or written is not the client's data.
    absl::Status CheckIntact(const std::string& field) const;

   private:
    friend class RegionRegistry;
    struct Entry;
    Lease(std::shared_ptr<Entry> entry, char* data, uint64_t size);
    void Release();
    std::shared_ptr<Entry> entry_;
    char* data_ = nullptr;
    uint64_t size_ = 0;
  };

  // `kind` names the regions in messages: "system memory", "CUDA memory".
  explicit RegionRegistry(std::string kind);
  ~RegionRegistry();

  bool Contains(const std::string& name) const ABSL_LOCKS_EXCLUDED(mutex_);
  // ALREADY_EXISTS when the name is taken (then `region.release` runs at once).
  absl::Status Add(Region region) ABSL_LOCKS_EXCLUDED(mutex_);
  // Removes `name` ("" = every region): no new leases at once; waits until the requests
  // holding it finish, then releases the memory. If they outlast `deadline`: DEADLINE_EXCEEDED,
  // and the unregister stays pending: the region is listed (refusing leases) until its last
  // lease is released, which removes it and frees the name. NOT_FOUND for an unknown name.
  absl::Status Unregister(const std::string& name, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mutex_);
  // Regions by name ("" = all); NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<RegionInfo>> Status(const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mutex_);
  // [offset, offset + byte_size) of region `name`, overflow- and bounds-checked; `field` names
  // the request field in errors (e.g. "header.input.region").
  absl::StatusOr<Lease> Acquire(const std::string& name, uint64_t offset, uint64_t byte_size,
                                const std::string& field) ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  // A pending unregister's last step, run by the last lease: drops `entry` if still listed.
  void Forget(const std::shared_ptr<Lease::Entry>& entry) ABSL_LOCKS_EXCLUDED(mutex_);

  const std::string kind_;
  mutable Mutex mutex_;  // kvt::Mutex: TSan sees it, unlike Debian's absl::Mutex
  std::map<std::string, std::shared_ptr<Lease::Entry>> regions_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvt
