#include "quality/mapper_quality.h"

#include "absl/strings/str_cat.h"

namespace kvt {

std::optional<double> MeanHeldoutR2(const Manifest& manifest) {
  double sum = 0;
  int n = 0;
  for (int pass = 0; pass < 2 && n == 0; ++pass) {
    for (const LayerEntry& layer : manifest.layers) {
      if (pass == 0 && layer.target_layer == 0) continue;
      for (const std::optional<double>& r2 : {layer.r2_k_heldout, layer.r2_v_heldout}) {
        if (r2.has_value()) sum += *r2, ++n;
      }
    }
  }
  if (n == 0) return std::nullopt;
  return sum / n;
}

RecordedQuality MapperRecordedQuality(const Manifest& manifest) {
  const ManifestQuality& quality = manifest.quality;
  RecordedQuality cosine{quality.attention_cosine_heldout_lower95,
                         "attention_cosine_heldout_lower95",
                         "held-out attention-output cosine (95% lower bound)"};
  if (quality.attention_cosine_heldout_lower95.has_value()) return cosine;
  if (quality.attention_cosine_heldout.has_value()) {
    cosine.missing = absl::StrCat(
        "the mapper's held-out attention-output cosine (", *quality.attention_cosine_heldout,
        ") has no 95% lower bound (quality.attention_cosine_heldout_lower95): it rests on ",
        quality.heldout_sequences.value_or(1) < 2 ? "one held-out sequence"
                                                   : "a fit from before bounds were recorded",
        "; refit with at least 16 held-out sequences");
    return cosine;
  }
  return {MeanHeldoutR2(manifest)};
}

std::optional<RecordedBenefit> MapperRecordedBenefit(const Manifest& manifest) {
  std::optional<RecordedBenefit> worst;
  for (const BenefitRecord& record : manifest.quality.benefit) {
    // Strictly lower: among equal bounds the first listed is named, so the reason is stable.
    if (!worst.has_value() || record.lower95 < worst->lower95) {
      worst = RecordedBenefit{record.lower95, record.text};
    }
  }
  return worst;
}

}  // namespace kvt
