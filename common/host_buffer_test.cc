#include "common/host_buffer.h"

#include <cstdint>
#include <utility>

#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(HostBufferTest, AllocateIsAlignedAndWritable) {
  absl::StatusOr<HostBuffer> buffer = HostBuffer::Allocate(1000, 256);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), 1000u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 256, 0u);
  buffer->data()[999] = 7;
  EXPECT_EQ(buffer->data()[999], 7);
}

TEST(HostBufferTest, ZeroBytesStillHasAPointer) {
  absl::StatusOr<HostBuffer> buffer = HostBuffer::Allocate(0);
  ASSERT_TRUE(buffer.ok());
  EXPECT_NE(buffer->data(), nullptr);
  EXPECT_EQ(buffer->size(), 0u);
}

TEST(HostBufferTest, RejectsBadAlignment) {
  EXPECT_FALSE(HostBuffer::Allocate(16, 48).ok());
}

TEST(HostBufferTest, CustomDeleterRunsOnceAfterMoves) {
  int deletes = 0;
  static char storage[16];
  {
    HostBuffer a(storage, sizeof(storage), [&deletes](void*) { ++deletes; });
    HostBuffer b(std::move(a));
    HostBuffer c;
    c = std::move(b);
    EXPECT_EQ(c.data(), reinterpret_cast<uint8_t*>(storage));
    EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_EQ(deletes, 0);
  }
  EXPECT_EQ(deletes, 1);
}

}  // namespace
}  // namespace kvt
