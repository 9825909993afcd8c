#include "transport/shm_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "transport/fault_trap.h"
#include "common/echo.h"

namespace kvt {

absl::Status SystemMemoryRegistry::Register(const std::string& name, const std::string& key,
                                            uint64_t offset, uint64_t byte_size) {
  if (name.empty()) return absl::InvalidArgumentError("name must not be empty");
  if (key.empty()) return absl::InvalidArgumentError("key must name a POSIX shm object");
  if (byte_size == 0) return absl::InvalidArgumentError("byte_size must be > 0");
  if (offset > UINT64_MAX - byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset=", offset, " + byte_size=", byte_size, " overflows"));
  }
  // The region's base is what every lease offset (a multiple of 4, RegionRegistry::Acquire) is
  // added to: an odd base would make the typed in-place accesses misaligned all the same.
  if (offset % kRegionOffsetAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("offset=", offset, " is not a multiple of ",
                                                   kRegionOffsetAlignment, " bytes"));
  }
  if (Contains(name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("a system memory region named '", Echo(name), "' is registered"));
  }
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("key='", Echo(key), "': shm_open failed: ",
                                            std::strerror(errno)));
  }
  struct stat info;
  if (fstat(fd, &info) != 0) {
    const int error = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("key='", Echo(key), "': fstat: ", std::strerror(error)));
  }
  const uint64_t object_size = static_cast<uint64_t>(info.st_size);
  if (offset + byte_size > object_size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "offset=", offset, " + byte_size=", byte_size, " exceeds the ", object_size,
        " bytes of shm object '", Echo(key), "'"));
  }
  // mmap needs a page-aligned file offset: map from the page holding `offset`.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t aligned = offset / page * page;
  const size_t mapping_size = static_cast<size_t>(offset - aligned + byte_size);
  // MAP_POPULATE: the page tables are filled here, once, not by a fault on each page a request
  // first reads or writes (a vLLM engine's whole KV cache is registered and every load writes
  // blocks kvtd has not touched before: 2-3 ms of faults per 2K-token load of kvt-tiny-L,
  // docs/VLLM.md). It costs about 80 ms per GiB of existing pages at registration (measured on
  // the dev machine).
  void* mapping = mmap(nullptr, mapping_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                       fd, static_cast<off_t>(aligned));
  const int map_error = errno;
  if (mapping == MAP_FAILED) {
    close(fd);
    return absl::InternalError(absl::StrCat("key='", Echo(key), "': mmap of ", byte_size,
                                            " bytes failed: ", std::strerror(map_error)));
  }
  // The client keeps its object and may shrink it: the fd stays open so every lease re-checks
  // the object's size, and the fault trap turns a shrink during a request into a flag that
  // request's lease check reports (docs/RELIABILITY.md, "Regions that change under kvtd").
  const int trap = ArmFaultTrap(static_cast<char*>(mapping), mapping_size);
  const uint64_t needed = offset + byte_size;
  RegionRegistry::Region region;
  region.name = name;
  region.key = key;
  region.offset = offset;
  region.byte_size = byte_size;
  region.base = static_cast<char*>(mapping) + (offset - aligned);
  region.release = [mapping, mapping_size, fd, trap] {
    DisarmFaultTrap(trap);
    munmap(mapping, mapping_size);
    close(fd);
  };
  region.check_backing = [fd, trap, needed, key]() -> absl::Status {
    if (FaultTrapFired(trap)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shm object '", Echo(key), "' shrank while kvtd used it; its bytes are lost to this "
          "registration: unregister the region and register it again"));
    }
    struct stat now;
    if (fstat(fd, &now) != 0 || static_cast<uint64_t>(now.st_size) < needed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shm object '", Echo(key), "' is ", fstat(fd, &now) == 0 ? now.st_size : 0,
          " bytes, shorter than the registered offset + byte_size = ", needed,
          ": it was truncated after registration"));
    }
    return absl::OkStatus();
  };
  return Add(std::move(region));
}

}  // namespace kvt
