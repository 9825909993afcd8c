#include "transport/scatter_worker.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "transport/chunk_wire.h"
#include "transport/kv_chunks.h"

namespace kvt {
namespace {

// `bytes` as a ChunkBytes split into spans of at most `span` bytes (as gRPC's slices would be),
// owned by the returned ChunkBytes.
ChunkBytes Spans(std::string bytes, size_t span) {
  auto owned = std::make_shared<std::string>(std::move(bytes));
  std::vector<absl::string_view> spans;
  for (size_t at = 0; at < owned->size(); at += span) {
    spans.emplace_back(owned->data() + at, std::min(span, owned->size() - at));
  }
  return ChunkBytes(std::move(spans), owned);
}

std::string RandomBytes(size_t size, std::mt19937* rng) {
  std::string bytes(size, '\0');
  for (char& c : bytes) c = static_cast<char>((*rng)() & 0xff);
  return bytes;
}

// Every chunk of an HND and an NHD layer, submitted in shuffled order through a worker with a
// small queue, lands where the synchronous ScatterChunkBytes puts it.
TEST(ScatterWorkerTest, MatchesSynchronousScatterForBothLayouts) {
  std::mt19937 rng(std::random_device{}());
  for (Layout layout : {Layout::kHND, Layout::kNHD}) {
    const LayerGeometry geometry{layout, /*num_heads=*/3, /*num_tokens=*/97, /*head_dim=*/8,
                                 /*element_size=*/2};
    std::vector<char> expected(geometry.layer_bytes()), actual(geometry.layer_bytes(), 0);
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t start = 0; start < geometry.num_tokens; start += 10) {
      ranges.emplace_back(start, std::min<int64_t>(10, geometry.num_tokens - start));
    }
    std::shuffle(ranges.begin(), ranges.end(), rng);
    {
      ScatterWorker worker(/*max_queued_bytes=*/1000);  // forces Submit to wait
      for (auto [start, count] : ranges) {
        const std::string bytes = RandomBytes(geometry.chunk_bytes(count), &rng);
        ScatterChunkBytes(geometry, start, count, Spans(bytes, 1 << 20), expected.data());
        worker.Submit(geometry, start, count, Spans(bytes, 7), actual.data());
      }
      worker.Drain();
      EXPECT_EQ(actual, expected) << "layout " << static_cast<int>(layout);
    }
  }
}

// `then` runs after its own copy and every earlier one, in submission order.
TEST(ScatterWorkerTest, ThenRunsInOrderAfterTheCopies) {
  const LayerGeometry geometry{Layout::kNHD, 1, 64, 4, 1};
  std::vector<char> layer(geometry.layer_bytes(), 0);
  std::vector<int> order;
  std::atomic<bool> copies_seen{true};
  ScatterWorker worker(1 << 20);
  for (int i = 0; i < 16; ++i) {
    worker.Submit(geometry, 4 * i, 4, Spans(std::string(16, static_cast<char>(i + 1)), 16),
                  layer.data(), [&, i] {
                    for (int j = 0; j <= i; ++j) {
                      if (layer[16 * j] != j + 1) copies_seen = false;
                    }
                    order.push_back(i);
                  });
  }
  worker.Drain();
  EXPECT_TRUE(copies_seen.load());
  ASSERT_EQ(order.size(), 16u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(order[i], i);
}

// A chunk larger than the queue bound still goes through, and the destructor finishes every
// queued copy before returning (the layer buffer is freed right after it).
TEST(ScatterWorkerTest, OversizedChunkPassesAndDestructorDrains) {
  const LayerGeometry geometry{Layout::kNHD, 2, 1024, 64, 2};
  auto layer = std::make_unique<std::vector<char>>(geometry.layer_bytes(), 0);
  std::mt19937 rng(7);
  const std::string bytes = RandomBytes(geometry.layer_bytes(), &rng);
  {
    ScatterWorker worker(/*max_queued_bytes=*/4096);
    worker.Submit(geometry, 0, 1024, Spans(bytes, 1000), layer->data());
    worker.Submit(geometry, 0, 1024, Spans(bytes, 333), layer->data());
  }
  EXPECT_EQ(std::memcmp(layer->data(), bytes.data(), bytes.size()), 0);
}

}  // namespace
}  // namespace kvt
