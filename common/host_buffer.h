// Owned, aligned host memory holding a mapper's weights or a cached prefix's KV entries: the one
// place where a pinned (cudaHostAlloc) allocator plugs in, without the readers knowing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"

namespace kvt {

class HostBuffer {
 public:
  // Frees `data`; called once, from the destructor.
  using Deleter = std::function<void(void* data)>;

  HostBuffer() = default;
  HostBuffer(void* data, size_t size, Deleter deleter);
  ~HostBuffer();

  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  // Plain pageable memory aligned to `alignment` (a power of two). 64 bytes covers AVX-512 loads
  // and cache lines; GPU copies from pageable memory do not need more. RESOURCE_EXHAUSTED if the
  // allocation fails (a multi-GB mapper on a small host must not crash the daemon).
  static absl::StatusOr<HostBuffer> Allocate(size_t size, size_t alignment = 64);

  uint8_t* data() { return static_cast<uint8_t*>(data_); }
  const uint8_t* data() const { return static_cast<const uint8_t*>(data_); }
  size_t size() const { return size_; }

 private:
  void Reset();

  void* data_ = nullptr;
  size_t size_ = 0;
  Deleter deleter_;
};

// Returns a buffer of at least `size` bytes. The default is HostBuffer::Allocate; a CUDA build
// passes one that returns pinned memory so device page-ins can run asynchronously.
using HostAllocator = std::function<absl::StatusOr<HostBuffer>(size_t size)>;

}  // namespace kvt
