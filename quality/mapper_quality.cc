#include "quality/mapper_quality.h"

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
  if (manifest.quality.attention_cosine_heldout.has_value()) {
    return {manifest.quality.attention_cosine_heldout, "attention_cosine_heldout",
            "held-out attention-output cosine"};
  }
  return {MeanHeldoutR2(manifest)};
}

}  // namespace kvt
