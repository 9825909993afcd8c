// Reuse of large host buffers (whole KV layers) across requests: a fresh multi-MB allocation is
// paid for in page faults and kernel page zeroing on first touch, which on a VM costs more than
// the copies the buffer is for. Buffers of 4 MiB and more are 2 MiB aligned and advised for
// transparent huge pages.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace kvt {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  // A buffer of at least `size` bytes; returned to its pool (if the pool still exists and has
  // room) when the last reference goes. Thread-safe: gRPC threads may drop the last reference.
  class Buffer {
   public:
    ~Buffer();
    char* data() const { return data_; }
    int64_t size() const { return size_; }

   private:
    friend class BufferPool;
    Buffer(char* data, int64_t size, std::weak_ptr<BufferPool> pool)
        : data_(data), size_(size), pool_(std::move(pool)) {}
    char* data_;
    int64_t size_;
    std::weak_ptr<BufferPool> pool_;
  };

  // `max_idle_bytes`: most bytes kept for reuse; buffers beyond it are freed.
  static std::shared_ptr<BufferPool> Create(int64_t max_idle_bytes);
  ~BufferPool();

  // Uninitialised memory (old contents when reused).
  std::shared_ptr<Buffer> Get(int64_t size) ABSL_LOCKS_EXCLUDED(mutex_);
  int64_t idle_bytes() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  explicit BufferPool(int64_t max_idle_bytes) : max_idle_bytes_(max_idle_bytes) {}
  void Return(char* data, int64_t size) ABSL_LOCKS_EXCLUDED(mutex_);

  const int64_t max_idle_bytes_;
  mutable Mutex mutex_;
  std::multimap<int64_t, char*> idle_ ABSL_GUARDED_BY(mutex_);  // by exact size
  int64_t idle_bytes_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace kvt
