#include "transport/kv_chunks.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvt {

void ScatterChunk(const LayerGeometry& g, int64_t start, int64_t count, const void* chunk,
                  void* layer) {
  const char* in = static_cast<const char*>(chunk);
  char* out = static_cast<char*>(layer);
  const int64_t row = g.head_dim * g.element_size;
  if (g.layout == Layout::kNHD) {
    std::memcpy(out + start * g.num_heads * row, in, count * g.num_heads * row);
    return;
  }
  for (int64_t h = 0; h < g.num_heads; ++h) {
    std::memcpy(out + (h * g.num_tokens + start) * row, in + h * count * row, count * row);
  }
}

void GatherChunk(const LayerGeometry& g, int64_t start, int64_t count, const void* layer,
                 void* chunk) {
  const char* in = static_cast<const char*>(layer);
  char* out = static_cast<char*>(chunk);
  const int64_t row = g.head_dim * g.element_size;
  if (g.layout == Layout::kNHD) {
    std::memcpy(out, in + start * g.num_heads * row, count * g.num_heads * row);
    return;
  }
  for (int64_t h = 0; h < g.num_heads; ++h) {
    std::memcpy(out + h * count * row, in + (h * g.num_tokens + start) * row, count * row);
  }
}

std::vector<std::pair<int64_t, int64_t>> ChunkRanges(const LayerGeometry& g, int64_t start,
                                                     int64_t count) {
  const int64_t row = g.head_dim * g.element_size;
  if (g.layout == Layout::kNHD) return {{start * g.num_heads * row, count * g.num_heads * row}};
  std::vector<std::pair<int64_t, int64_t>> ranges;
  ranges.reserve(static_cast<size_t>(g.num_heads));
  for (int64_t h = 0; h < g.num_heads; ++h) {
    ranges.emplace_back((h * g.num_tokens + start) * row, count * row);
  }
  return ranges;
}

int64_t TokensPerChunk(const LayerGeometry& g, int64_t max_chunk_bytes) {
  const int64_t per_token = std::max<int64_t>(1, g.chunk_bytes(1));
  return std::max<int64_t>(1, max_chunk_bytes / per_token);
}

CoverageTracker::CoverageTracker(int num_layers, int64_t num_tokens)
    : num_tokens_(num_tokens),
      received_(static_cast<size_t>(num_layers) * 2, std::vector<bool>(num_tokens, false)),
      received_count_(static_cast<size_t>(num_layers) * 2, 0) {}

absl::Status CoverageTracker::Add(int layer, int kind, int64_t start, int64_t count) {
  std::vector<bool>& bits = received_[layer * 2 + kind];
  for (int64_t t = start; t < start + count; ++t) {
    if (bits[t]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk layer=", layer, " kind=", kind == 0 ? "K" : "V", " tokens [", start, ", ",
          start + count, ") repeats token ", t, ", which an earlier chunk already carried"));
    }
  }
  for (int64_t t = start; t < start + count; ++t) bits[t] = true;
  received_count_[layer * 2 + kind] += count;
  return absl::OkStatus();
}

bool CoverageTracker::LayerComplete(int layer) const {
  return received_count_[layer * 2] == num_tokens_ && received_count_[layer * 2 + 1] == num_tokens_;
}

bool CoverageTracker::Complete() const {
  for (int64_t count : received_count_) {
    if (count != num_tokens_) return false;
  }
  return true;
}

std::string CoverageTracker::FirstGap() const {
  for (size_t i = 0; i < received_.size(); ++i) {
    if (received_count_[i] == num_tokens_) continue;
    const std::vector<bool>& bits = received_[i];
    int64_t begin = 0;
    while (begin < num_tokens_ && bits[begin]) ++begin;
    int64_t end = begin;
    while (end < num_tokens_ && !bits[end]) ++end;
    return absl::StrCat("layer ", i / 2, " ", i % 2 == 0 ? "K" : "V", ": tokens [", begin, ", ",
                        end, ") missing");
  }
  return "";
}

}  // namespace kvt
