// The one home of "translate a cache through a pinned mapper and measure it against the target's
// own cache" (SPEC 5, quality/kv_quality.h): ValidateKV's measurement, and live verification's
// comparison of a translated stored prefix with the target engine's published cache.
#pragma once

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/rope.h"
#include "kernels/types.h"
#include "mapper_store/store.h"
#include "quality/kv_quality.h"
#include "server/translate/request_plan.h"

namespace kvt {

struct MeasureInputs {
  CacheView source;  // the source model's cache, any dtype and layout
  CacheView truth;   // the target's own cache of the same tokens (the translation's dtype)
  // The target's post-RoPE queries, one "K" buffer per target layer (num_kv_heads = query
  // heads, v empty), or num_kv_heads 0 for none (no attention cosine then).
  CacheView queries;
  Positions positions;
  TranslateOptions options;
  bool cosines_only = false;  // LayerQualityInputs::cosines_only (live verification)
};

// Translates `in.source` target layer by target layer with the backend exactly as TranslateKV
// returns it (in in.truth's dtype, NHD), and measures each layer against in.truth into
// (*layers)[layer] (resized to the target's layers). `cancelled` (may be empty) is polled
// between layers (CANCELLED); `deadline` bounds waiting for a streamed page-in.
absl::Status MeasureTranslation(const MapperHandle& mapper, const ComputeMapper& compute,
                                const MeasureInputs& in, absl::Time deadline,
                                const std::function<bool()>& cancelled,
                                std::vector<LayerQuality>* layers);

}  // namespace kvt
