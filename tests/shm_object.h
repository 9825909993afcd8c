// A POSIX shared-memory object created, mapped and zeroed by a client process (tests and the
// transport benchmark), unlinked when it goes away: the client side of RegisterSystemMemory.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvt {
namespace test {

class ShmObject {
 public:
  explicit ShmObject(size_t size)
      : key_(absl::StrCat("/kvt-shm-", getpid(), "-", std::random_device{}())), size_(size) {
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(size)) != 0) std::abort();
    void* data = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (data == MAP_FAILED) std::abort();
    data_ = static_cast<char*>(data);
    std::memset(data_, 0, size);  // pages faulted in now, not inside a measurement
  }
  ~ShmObject() {
    munmap(data_, size_);
    shm_unlink(key_.c_str());
  }
  ShmObject(const ShmObject&) = delete;
  ShmObject& operator=(const ShmObject&) = delete;

  const std::string& key() const { return key_; }
  char* data() { return data_; }
  size_t size() const { return size_; }

 private:
  std::string key_;
  size_t size_;
  char* data_ = nullptr;
};

}  // namespace test
}  // namespace kvt
