#include "mapper_store/pinned_memory.h"

#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace kvt {
namespace {

// With a GPU: real pinned memory that holds what is written. Without (CI): a clear refusal,
// never a crash, and the store keeps its default allocator (server/mapper_store_setup.cc).
TEST(PinnedMemoryTest, AllocatesWhereCudaIsUsableAndRefusesClearlyElsewhere) {
  absl::StatusOr<HostBuffer> buffer = AllocatePinnedHostBuffer(1 << 20);
  if (PinnedMemoryAvailable()) {
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    ASSERT_EQ(buffer->size(), 1u << 20);
    std::memset(buffer->data(), 0x5a, buffer->size());
    EXPECT_EQ(buffer->data()[buffer->size() - 1], 0x5a);
    absl::StatusOr<double> seconds = PinnedHostToDeviceSeconds(1 << 20, 2);
    ASSERT_TRUE(seconds.ok()) << seconds.status();
    EXPECT_GT(*seconds, 0);
  } else {
    ASSERT_FALSE(buffer.ok());
    EXPECT_TRUE(buffer.status().code() == absl::StatusCode::kFailedPrecondition ||
                buffer.status().code() == absl::StatusCode::kResourceExhausted)
        << buffer.status();
    EXPECT_FALSE(buffer.status().message().empty());
    EXPECT_FALSE(PinnedHostToDeviceSeconds(1 << 20, 1).ok());
  }
}

}  // namespace
}  // namespace kvt
