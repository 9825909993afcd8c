// Test-only float64 reference of SPEC 3 (direct loops, double math, its own RoPE rotation from
// Rope's frequencies) and fixtures: random mappers and caches that own their bytes.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/backend.h"
#include "kernels/mapper_view.h"
#include "kernels/rope.h"
#include "kernels/types.h"

namespace kvt {
namespace testing {

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
// per layer or per target head, on the same gathered, RoPE-stripped x.
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

// RoPE configs that exercise each scaling type's every branch at small positions (llama3 with
// original_max_position_embeddings 64 hits all three bands). rotary_dim 0: the full head.
RopeConfig MakeTestRope(RopeScalingType type, RopeStyle style = RopeStyle::kNeox,
                        int rotary_dim = 0, double theta = 10000.0);

// A seed from std::random_device, printed to stderr so a failing run can be replayed.
uint64_t FreshSeed(const char* what);

struct RandomMapperSpec {
  int source_layers = 2;
  int source_heads = 2;
  int source_head_dim = 16;
  int target_layers = 2;
  int target_heads = 2;
  int target_head_dim = 16;
  int k = 1;    // |sigma_k|: distinct source layers in random order
  int k_v = 0;  // |sigma_v|; 0: same as k
  DType weight_dtype = DType::kFP32;
  bool with_bias = true;
  RopeConfig source_rope;  // rotary_dim 0: the full head_dim
  RopeConfig target_rope;
  // kMlp: both chains random with hidden width mlp_hidden (biases always present), one per
  // target head when mlp_per_head.
  MapKind kind = MapKind::kRidge;
  int mlp_hidden = 8;
  bool mlp_per_head = false;
};

// A random mapper whose view points into `storage`. Movable, not copyable.
struct RandomMapper {
  RandomMapper() = default;
  RandomMapper(const RandomMapper&) = delete;
  RandomMapper& operator=(const RandomMapper&) = delete;
  RandomMapper(RandomMapper&&) = default;
  RandomMapper& operator=(RandomMapper&&) = default;

  MapperView view;
  std::vector<std::vector<uint8_t>> storage;
};

// Ridge weights ~ N(0, 1/rows) so outputs stay O(1); bias ~ N(0, 0.25). MLP: see the spec.
RandomMapper MakeRandomMapper(const RandomMapperSpec& spec, uint64_t seed);

// A cache (every layer's K and V) owning its bytes, with a read-only and a mutable view.
struct OwnedCache {
  OwnedCache() = default;
  OwnedCache(const OwnedCache&) = delete;
  OwnedCache& operator=(const OwnedCache&) = delete;
  OwnedCache(OwnedCache&&) = default;
  OwnedCache& operator=(OwnedCache&&) = default;

  CacheView view;
  MutableCacheView mutable_view;
  std::vector<std::vector<uint8_t>> k, v;
};

// Entries ~ N(0, 1) rounded to `dtype`.
OwnedCache MakeRandomCache(int layers, int heads, int head_dim, int64_t tokens, DType dtype,
                           Layout layout, uint64_t seed);
// Every byte 0xff (NaN in every dtype), so entries a backend fails to write stand out.
OwnedCache MakeOutputCache(int layers, int heads, int head_dim, int64_t tokens, DType dtype,
                           Layout layout);
// Tokens [begin, end) of `cache`, copied into a cache of their own.
OwnedCache SliceTokens(const CacheView& cache, int64_t begin, int64_t end);

}  // namespace testing
}  // namespace kvt
