// Test fixtures over HostCache: a random cache of a model's shape, copies of the kernels'
// OwnedCache fixtures, and the float64 check of a translated cache (one home for what the
// service, MLP-serving, window-serving and mapper-control tests share).
#pragma once

#include <cstdint>

#include "host_cache/host_cache.h"
#include "kernels/backend.h"
#include "kernels/mapper_view.h"
#include "kernels/testing/reference.h"
#include "kernels/types.h"

namespace kvt {
namespace testing {

// A cache of `model`'s shape (layers, KV heads, head_dim) with N(0, 1) elements drawn from
// `seed`, stored in `dtype` and `layout`.
HostCache RandomHostCache(const ModelSpec& model, int64_t tokens, DType dtype, Layout layout,
                          uint64_t seed);

// A HostCache holding a copy of `owned` (kernels/testing/reference.h fixtures).
HostCache ToHostCache(const OwnedCache& owned);


// Max relative error of `target` against the float64 reference translation of `source` by
// `mapper` at `positions`, over every target layer, K and V.
double MaxErrorAgainstReference(const MapperView& mapper, const CacheView& source,
                                const CacheView& target, const Positions& positions);

}  // namespace testing
}  // namespace kvt
