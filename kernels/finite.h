// The non-finite policy's check: where a cache's first NaN or Inf is, so that Publish and
// TranslateKV refuse bad data before it is stored or translated into other models.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/types.h"

namespace kvt {

// Index of the first of `count` elements of `dtype` at `data` whose exponent bits are all set
// (NaN or +-Inf); nullopt when every element is finite.
std::optional<int64_t> FirstNonFinite(DType dtype, const void* data, int64_t count);

// Every layer's K then V of `view`. INVALID_ARGUMENT naming `field`, the layer, the kind and
// the first offending element, e.g. "header.input: layer 2 V element 17 (token 3, head 0,
// dim 1) is NaN; ...".
absl::Status CheckFinite(const CacheView& view, const std::string& field);

}  // namespace kvt
