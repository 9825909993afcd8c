// Moving token ranges of one layer's K or V between a whole-layer buffer and the compact chunk
// form of the wire (KVChunk.data), in either layout; and tracking which token ranges of which
// (layer, kind) have arrived, so duplicates, overlaps and gaps are caught.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/types.h"

namespace kvt {

// Geometry of one layer's K or V buffer holding `num_tokens` tokens.
struct LayerGeometry {
  Layout layout = Layout::kHND;
  int64_t num_heads = 0;
  int64_t num_tokens = 0;
  int64_t head_dim = 0;
  int64_t element_size = 0;

  int64_t layer_bytes() const { return num_heads * num_tokens * head_dim * element_size; }
  int64_t chunk_bytes(int64_t token_count) const {
    return num_heads * token_count * head_dim * element_size;
  }
};

// Copies a chunk ([heads, count, dim] for HND, [count, heads, dim] for NHD) into the layer
// buffer at tokens [start, start + count). Bounds are the caller's to check.
void ScatterChunk(const LayerGeometry& geometry, int64_t start, int64_t count, const void* chunk,
                  void* layer);
// The inverse: extracts tokens [start, start + count) of the layer into chunk form.
void GatherChunk(const LayerGeometry& geometry, int64_t start, int64_t count, const void* layer,
                 void* chunk);

// Where tokens [start, start + count) of a layer lie, as (byte offset in the layer, length)
// ranges in chunk order: one range for NHD, one per head for HND.
std::vector<std::pair<int64_t, int64_t>> ChunkRanges(const LayerGeometry& geometry, int64_t start,
                                                     int64_t count);

// Tokens per chunk so that one chunk holds at most `max_chunk_bytes` (at least 1 token).
int64_t TokensPerChunk(const LayerGeometry& geometry, int64_t max_chunk_bytes);

// Which tokens of each (layer, kind) have been received.
class CoverageTracker {
 public:
  CoverageTracker(int num_layers, int64_t num_tokens);

  // Records [start, start + count) of (layer, kind 0=K / 1=V). INVALID_ARGUMENT naming the
  // chunk when it overlaps tokens already received.
  absl::Status Add(int layer, int kind, int64_t start, int64_t count);
  bool LayerComplete(int layer) const;
  // Every token of (layer, kind) has arrived.
  bool KindComplete(int layer, int kind) const {
    return received_count_[layer * 2 + kind] == num_tokens_;
  }
  bool Complete() const;
  // e.g. "layer 3 V: tokens [128, 256) missing" for the first gap, or "" when complete.
  std::string FirstGap() const;

 private:
  int64_t num_tokens_;
  std::vector<std::vector<bool>> received_;  // [layer * 2 + kind][token]
  std::vector<int64_t> received_count_;      // per layer * 2 + kind
};

}  // namespace kvt
