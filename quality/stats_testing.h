// Test support: a synthetic mapper directory that also carries the feature statistics `kvt fit`
// stores (stats.source.{j}.{k,v}.{mean,var}), for input-shift tests.
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "kernels/types.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace testing {

// value(source_layer, keys, feature, variance): the mean (variance=false) or variance of
// feature `feature` (head-major, < n_s * d_s) of that source layer's K (content space) or V.
using StatsValue = std::function<double(int source_layer, bool keys, int feature, bool variance)>;

// WriteSynthMapper plus, for every source layer, the four statistics tensors in `stats_dtype`
// (kvt fit writes F32; other dtypes exercise the loader's checks).
absl::Status WriteSynthMapperWithStats(const std::string& dir, const SynthOptions& options,
                                       const StatsValue& value,
                                       DType stats_dtype = DType::kFP32);

}  // namespace testing
}  // namespace kvt
