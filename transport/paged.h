// Moving one layer of a request between vLLM's paged layout (blocks picked by a block table,
// see PagedLayout in kernels/types.h) and the contiguous whole-layer buffers the backends read
// and write. The table must have passed CheckBlockTable (and an engine order
// CheckEngineBlockOrder).
#pragma once

#include <cstdint>

#include "kernels/types.h"
#include "transport/kv_chunks.h"

namespace kvt {

// Copies the request's tokens [0, layer.num_tokens) of `kind` (0 = K, 1 = V) out of the paged
// layer tensor `paged_layer` into the contiguous `dst` (layer.layout).
void GatherPaged(const PagedLayout& paged, const uint32_t* block_table, int kind,
                 const void* paged_layer, const LayerGeometry& layer, void* dst);
// The inverse for tokens [first_token, end_token) of the contiguous `src` (of layer.num_tokens
// tokens), leaving every other slot untouched (the slots before first_token may be blocks the
// engine shares with other requests).
void ScatterPaged(const PagedLayout& paged, const uint32_t* block_table, int kind,
                  const void* src, const LayerGeometry& layer, void* paged_layer,
                  int64_t first_token, int64_t end_token);

}  // namespace kvt
