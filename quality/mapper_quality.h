// The held-out quality a mapper records, as the gates read it: one rule for `kvt fit`, which
// writes quality.r2_heldout into manifest.yaml, and kvtd's prefix-cache gate, which reads the
// recorded figures back (docs/MAPPER_FORMAT.md, `quality:`).
#pragma once

#include <optional>
#include <string>

#include "mapper_store/format/manifest.h"

namespace kvt {

// The mean of the per-layer held-out R^2 of K and V (layers[l].r2_k_heldout, r2_v_heldout) over
// the target layers past 0 (layer 0 is a function of the current token and inflates any
// average; docs/EVAL.md), or over every layer when only layer 0 records them; nullopt when no
// layer does.
std::optional<double> MeanHeldoutR2(const Manifest& manifest);

// What the gates compare with their floor: the one-sided 95% lower bound of the held-out
// attention-output cosine (quality.attention_cosine_heldout_lower95) when `kvt fit` recorded the
// cosine, never its point estimate, so a figure from few held-out sequences cannot pass on luck;
// else MeanHeldoutR2 (mappers fitted without target queries). value nullopt: nothing to gate
// on, and `missing` says what is missing (a cosine without a bound rests on one held-out
// sequence, or was recorded before bounds were).
struct RecordedQuality {
  std::optional<double> value;
  const char* metric = "r2_heldout";
  const char* description = "held-out R^2";
  std::string missing = "the mapper records no held-out quality "
                        "(quality.attention_cosine_heldout_lower95, r2_k_heldout / r2_v_heldout)";
};
RecordedQuality MapperRecordedQuality(const Manifest& manifest);

// The measured context benefit the benefit gate holds to its floor (quality.benefit, written by
// `kvt record-benefit` from `python -m kvt.qualify`): the entry with the lowest lower95, since
// every text source must clear the floor; nullopt when none is recorded.
struct RecordedBenefit {
  double lower95 = 0;
  std::string text;
};
std::optional<RecordedBenefit> MapperRecordedBenefit(const Manifest& manifest);

}  // namespace kvt
