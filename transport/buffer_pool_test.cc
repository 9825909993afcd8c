#include "transport/buffer_pool.h"

#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvt {
namespace {

TEST(BufferPool, ReusesReturnedBuffersOfTheSameSize) {
  std::shared_ptr<BufferPool> pool = BufferPool::Create(64 << 20);
  std::shared_ptr<BufferPool::Buffer> a = pool->Get(5 << 20);
  char* const first = a->data();
  std::memset(first, 7, 5 << 20);  // writable over its whole size
  EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % (2 << 20), 0u);
  a.reset();
  EXPECT_EQ(pool->idle_bytes(), 5 << 20);
  std::shared_ptr<BufferPool::Buffer> b = pool->Get(5 << 20);
  EXPECT_EQ(b->data(), first);
  EXPECT_EQ(pool->idle_bytes(), 0);
  std::shared_ptr<BufferPool::Buffer> c = pool->Get(3 << 20);  // another size: fresh
  EXPECT_NE(c->data(), first);
}

TEST(BufferPool, KeepsAtMostItsIdleLimit) {
  std::shared_ptr<BufferPool> pool = BufferPool::Create(10 << 20);
  std::vector<std::shared_ptr<BufferPool::Buffer>> buffers;
  for (int i = 0; i < 4; ++i) buffers.push_back(pool->Get(4 << 20));
  buffers.clear();
  EXPECT_EQ(pool->idle_bytes(), 8 << 20);  // the third and fourth were freed
}

// Buffers may outlive their pool (gRPC may release a slice late) and come back from any thread.
TEST(BufferPool, BuffersOutliveThePoolAndReturnFromOtherThreads) {
  std::shared_ptr<BufferPool> pool = BufferPool::Create(1 << 30);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([pool] {
      for (int i = 0; i < 200; ++i) {
        std::shared_ptr<BufferPool::Buffer> buffer = pool->Get((1 + i % 3) << 16);
        buffer->data()[buffer->size() - 1] = 1;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::shared_ptr<BufferPool::Buffer> survivor = pool->Get(1 << 20);
  std::shared_ptr<BufferPool::Buffer> mapped_survivor = pool->Get(9 << 20);  // its own mapping
  pool.reset();
  survivor->data()[0] = 1;  // still valid; freed when dropped (ASan checks both)
  mapped_survivor->data()[(9 << 20) - 1] = 1;
  survivor.reset();
  mapped_survivor.reset();
}

}  // namespace
}  // namespace kvt
