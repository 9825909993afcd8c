// The held-out quality a mapper records, as the gates read it: one rule for `kvt fit`, which
// writes quality.r2_heldout into manifest.yaml, and kvtd's prefix-cache gate, which reads the
// recorded figures back (docs/MAPPER_FORMAT.md, `quality:`).
#pragma once

#include <optional>

#include "mapper_store/format/manifest.h"

namespace kvt {

// The mean of the per-layer held-out R^2 of K and V (layers[l].r2_k_heldout, r2_v_heldout) over
// the target layers past 0 (layer 0 is a function of the current token and inflates any
// average; docs/EVAL.md), or over every layer when only layer 0 records them; nullopt when no
// layer does.
std::optional<double> MeanHeldoutR2(const Manifest& manifest);

// The mapper's recorded held-out quality and the metric it is: the held-out attention-output
// cosine `kvt fit` records when the target dumps carried queries (quality.attention_cosine_heldout),
// else MeanHeldoutR2. value nullopt: neither recorded (metric then "r2_heldout", what was looked
// for last).
struct RecordedQuality {
  std::optional<double> value;
  const char* metric = "r2_heldout";
  const char* description = "held-out R^2";
};
RecordedQuality MapperRecordedQuality(const Manifest& manifest);

}  // namespace kvt
