// vLLM's CPU attention block order ("vec" ISA) as a PagedLayout, for the paged tests and benchmark.
#pragma once

#include <cstdint>

#include "kernels/types.h"

namespace kvt {

// Per block and head K transposed, [head_dim, block_size], then V, [block_size, head_dim]; the
// layers back to back.
inline PagedLayout VllmCpuOrder(int64_t blocks, int64_t block_size, int64_t heads, int64_t dim,
                                int64_t element_size, int num_layers = 1) {
  PagedLayout paged{Layout::kNHD, blocks, block_size, heads, dim, element_size};
  EngineBlockOrder order;
  order.block_stride = heads * 2 * block_size * dim;
  for (int l = 0; l < num_layers; ++l) {
    order.layer_offsets.push_back(l * blocks * order.block_stride * element_size);
  }
  order.kv[0] = BlockStrides{0, 1, 2 * block_size * dim, block_size};
  order.kv[1] = BlockStrides{block_size * dim, dim, 2 * block_size * dim, 1};
  paged.engine_order = order;
  return paged;
}

}  // namespace kvt
