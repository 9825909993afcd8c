#include "transport/buffer_pool.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <new>

namespace kvt {
namespace {

constexpr int64_t kHugePage = 2 << 20;
// Below this, plain malloc: a huge page would make a small buffer cost 2 MiB of resident memory.
constexpr int64_t kHugePageMinBytes = 4 << 20;

size_t MappingBytes(int64_t size) {
  return static_cast<size_t>((size + kHugePage - 1) / kHugePage * kHugePage);
}

// Large buffers get their own mapping rather than malloc's: whatever malloc's thresholds, they
// never sit in (and fragment) the heap arenas, and a freed one goes straight back to the OS.
char* Allocate(int64_t size) {
  if (size < kHugePageMinBytes) {
    void* data = std::malloc(static_cast<size_t>(size == 0 ? 1 : size));
    if (data == nullptr) throw std::bad_alloc();
    return static_cast<char*>(data);
  }
  // Over-map by a huge page so the buffer can start on a 2 MiB boundary.
  const size_t mapped = MappingBytes(size) + kHugePage;
  void* mapping = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t start = reinterpret_cast<uintptr_t>(mapping);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(mapping, aligned - start);
  const uintptr_t end = start + mapped, aligned_end = aligned + MappingBytes(size);
  if (end > aligned_end) munmap(reinterpret_cast<void*>(aligned_end), end - aligned_end);
  // Fewer, larger faults on first touch; advisory, so a failure changes nothing.
  madvise(reinterpret_cast<void*>(aligned), MappingBytes(size), MADV_HUGEPAGE);
  return reinterpret_cast<char*>(aligned);
}

void Release(char* data, int64_t size) {
  if (size < kHugePageMinBytes) {
    std::free(data);
  } else {
    munmap(data, MappingBytes(size));
  }
}

}  // namespace

BufferPool::Buffer::~Buffer() {
  if (std::shared_ptr<BufferPool> pool = pool_.lock()) {
    pool->Return(data_, size_);
  } else {
    Release(data_, size_);
  }
}

std::shared_ptr<BufferPool> BufferPool::Create(int64_t max_idle_bytes) {
  return std::shared_ptr<BufferPool>(new BufferPool(max_idle_bytes));
}

BufferPool::~BufferPool() {
  for (auto& [size, data] : idle_) Release(data, size);
}

std::shared_ptr<BufferPool::Buffer> BufferPool::Get(int64_t size) {
  char* data = nullptr;
  {
    MutexLock lock(&mutex_);
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
    MutexLock lock(&mutex_);
    if (idle_bytes_ + size <= max_idle_bytes_) {
      idle_.emplace(size, data);
      idle_bytes_ += size;
      return;
    }
  }
  Release(data, size);
}

int64_t BufferPool::idle_bytes() const {
  MutexLock lock(&mutex_);
  return idle_bytes_;
}

}  // namespace kvt
