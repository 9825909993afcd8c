#include "transport/buffer_pool.h"

#include <sys/mman.h>

#include <cstdlib>
#include <new>

namespace kvt {
namespace {

constexpr int64_t kHugePage = 2 << 20;
// Below this, plain malloc: a huge page would make a small buffer cost 2 MiB of resident memory.
constexpr int64_t kHugePageMinBytes = 4 << 20;

char* Allocate(int64_t size) {
  if (size < kHugePageMinBytes) {
    void* data = std::malloc(static_cast<size_t>(size == 0 ? 1 : size));
    if (data == nullptr) throw std::bad_alloc();
    return static_cast<char*>(data);
  }
  const size_t rounded = static_cast<size_t>((size + kHugePage - 1) / kHugePage * kHugePage);
  void* data = std::aligned_alloc(kHugePage, rounded == 0 ? kHugePage : rounded);
  if (data == nullptr) throw std::bad_alloc();
  // Fewer, larger faults on first touch; advisory, so a failure changes nothing.
  madvise(data, rounded, MADV_HUGEPAGE);
  return static_cast<char*>(data);
}

}  // namespace

BufferPool::Buffer::~Buffer() {
  if (std::shared_ptr<BufferPool> pool = pool_.lock()) {
    pool->Return(data_, size_);
  } else {
    std::free(data_);
  }
}

std::shared_ptr<BufferPool> BufferPool::Create(int64_t max_idle_bytes) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_idle_bytes));
}

BufferPool::~BufferPool() {
  for (auto& [size, data] : idle_) std::free(data);
}

std::shared_ptr<BufferPool::Buffer> BufferPool::Get(int64_t size) {
  char* data = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = idle_.find(size);
    if (it != idle_.end()) {
      data = it->second;
      idle_bytes_ -= size;
      idle_.erase(it);
    }
  }
  if (data == nullptr) data = Allocate(size);
  return std::shared_ptr<Buffer>(new Buffer(data, size, weak_from_this()));
}

void BufferPool::Return(char* data, int64_t size) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (idle_bytes_ + size <= max_idle_bytes_) {
      idle_.emplace(size, data);
      idle_bytes_ += size;
      return;
    }
  }
  std::free(data);
}

int64_t BufferPool::idle_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_bytes_;
}

}  // namespace kvt
