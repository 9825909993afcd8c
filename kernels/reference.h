// The float64 reference of SPEC 3: direct loops in double, its own RoPE rotation from Rope's
// frequencies, and the SPEC 3 error measure and tolerances. Production code (kvtd's start-up
// self-check, server/backend_self_check.h) and tests (kernels/testing/reference.h re-exports
// it beside the random fixtures) share this one copy. Slow by design: small shapes only.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/mapper_view.h"
#include "kernels/rope.h"
#include "kernels/types.h"

namespace kvt {
namespace reference {

enum class Kind { kK, kV };

struct ReferenceOptions {
  bool strip_source_rope = true;
  // False gives the paper's ablation "target RoPE dropped": tests use it to show the difference.
  bool apply_target_rope = true;
};

// Rotates one head vector (rope.head_dim() doubles) at `position` in double: forward as a model
// writes its cache (times the attention factor), or inverse (strip: rotate by -phi, divide).
// The angle p * inv_freq[m] and its cos/sin are taken in long double, so the phase stays exact
// well past the 10^6 positions the backends must handle.
void RotateDouble(const Rope& rope, uint64_t position, bool inverse, double* x);

// Target layer `layer`'s K or V for every source token, in [token][head][dim] order: the ridge
// map x W + b, or for an MLP mapper (mapper.kind) the chain relu(relu(x A1 + c1) A2 + c2) A3 + c3
// per layer or per target head, on the same gathered, RoPE-stripped x; a head-local ridge
// (MapperView::head_local) maps each target head from its own source heads of x only. The
// mapper must have
// passed CheckMapperView (a bad RoPE config aborts).
std::vector<double> ReferenceTranslate(const MapperView& mapper, int layer, Kind kind,
                                       const CacheView& source, const Positions& positions,
                                       const ReferenceOptions& options = ReferenceOptions());

// One layer's K or V of a cache as doubles in [token][head][dim] order, whatever its layout.
std::vector<double> ReadLayer(const CacheView& cache, int layer, Kind kind);
std::vector<double> ReadLayer(const MutableCacheView& cache, int layer, Kind kind);

// max |actual - expected| / max |expected|: the error measure of the SPEC 3 tolerances (1e-5
// fp32, 1e-2 bf16). Normalising by the largest reference entry rather than per element keeps
// near-zero entries (cancellation in the rotation) from dominating. Infinity on a size mismatch
// or any NaN.
double MaxRelError(const std::vector<double>& actual, const std::vector<double>& expected);

// SPEC 3 tolerance of MaxRelError against this reference for a backend's output dtype: 1e-5
// fp32, 1e-3 fp16, 1e-2 bf16. The reference reads the same (already rounded) inputs and weights,
// so what remains is fp32 arithmetic plus the output's rounding (2^-9 bf16, 2^-11 fp16).
double TranslationTolerance(DType output);

}  // namespace reference
}  // namespace kvt
