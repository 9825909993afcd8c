#include "common/host_buffer.h"

#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvt {

HostBuffer::HostBuffer(void* data, size_t size, Deleter deleter)
    : data_(data), size_(size), deleter_(std::move(deleter)) {}

HostBuffer::~HostBuffer() { Reset(); }

HostBuffer::HostBuffer(HostBuffer&& other) noexcept
    : data_(other.data_), size_(other.size_), deleter_(std::move(other.deleter_)) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.deleter_ = nullptr;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = other.data_;
    size_ = other.size_;
    deleter_ = std::move(other.deleter_);
    other.data_ = nullptr;
    other.size_ = 0;
    other.deleter_ = nullptr;
  }
  return *this;
}

void HostBuffer::Reset() {
  if (data_ != nullptr && deleter_) deleter_(data_);
  data_ = nullptr;
  size_ = 0;
  deleter_ = nullptr;
}

absl::StatusOr<HostBuffer> HostBuffer::Allocate(size_t size, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("alignment ", alignment, " is not a power of two"));
  }
  // aligned_alloc wants a size that is a multiple of the alignment; a zero-byte mapper section
  // still gets a valid pointer so spans over it are well-formed.
  const size_t rounded = size == 0 ? alignment : (size + alignment - 1) / alignment * alignment;
  if (rounded < size) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", size, " bytes"));
  }
  void* data = std::aligned_alloc(alignment, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of host memory allocating ", size, " bytes"));
  }
  return HostBuffer(data, size, [](void* p) { std::free(p); });
}

}  // namespace kvt
