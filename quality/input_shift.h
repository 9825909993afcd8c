// Input-shift score: how far a request's source features lie from the calibration distribution
// `kvt fit` stored with the mapper (fp32 tensors stats.source.{j}.{k,v}.{mean,var}, n_s*d_s
// each, K in content space). About 1 for inputs like the calibration data, larger when they
// drift. Exact formula: docs/TELEMETRY.md "Input-shift score".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/rope.h"
#include "mapper_store/mapper.h"

namespace kvt {

// "stats.source.3.k.mean" and friends: the names `kvt fit` writes.
std::string SourceStatsTensorName(int source_layer, char kv /* 'k' or 'v' */,
                                  bool variance);

// Tokens the score reads at most: every s-th token, s = ceil(T / kInputShiftMaxTokens).
inline constexpr int64_t kInputShiftMaxTokens = 512;

class InputShiftStats {
 public:
  // The statistics of every source layer the mapper reads (K for the layers in some sigma_K,
  // V for those in some sigma_V). nullopt when any of them is missing (the mapper simply has no
  // score); INVALID_ARGUMENT naming the tensor when one is present but not F32 of n_s*d_s
  // elements.
  static absl::StatusOr<std::optional<InputShiftStats>> FromMapper(const LoadedMapper& mapper);

  // The score of `source` (the whole source cache of a request, every layer the mapper reads).
  double Score(const CacheView& source, const Positions& positions) const;

 private:
  struct Feature {
    int layer;
    bool keys;                      // K (stripped of source RoPE) or V
    std::vector<float> mean;        // n_s * d_s, head-major
    std::vector<float> inv_var;     // 1 / max(var, floor)
  };
  InputShiftStats(const Rope& rope, int heads, int head_dim)
      : rope_(rope), heads_(heads), head_dim_(head_dim) {}

  Rope rope_;
  int heads_;
  int head_dim_;
  std::vector<Feature> features_;
};

}  // namespace kvt
