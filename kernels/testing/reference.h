// Test fixtures: random mappers and caches that own their bytes, test RoPE configs and seeds,
// beside the float64 reference of SPEC 3 (kernels/reference.h) under its test-side names.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "common/testing/test_seed.h"
#include "kernels/backend.h"
#include "kernels/mapper_view.h"
#include "kernels/reference.h"
#include "kernels/rope.h"
#include "kernels/types.h"

namespace kvt {
namespace testing {

// The float64 reference itself is production code (kernels/reference.h, also used by kvtd's
// start-up self-check); tests keep reaching it through this namespace.
using ::kvt::reference::Kind;
using ::kvt::reference::MaxRelError;
using ::kvt::reference::ReadLayer;
using ::kvt::reference::ReferenceOptions;
using ::kvt::reference::ReferenceTranslate;
using ::kvt::reference::RotateDouble;
using ::kvt::reference::TranslationTolerance;

// RoPE configs that exercise each scaling type's every branch at small positions (llama3 with
// original_max_position_embeddings 64 hits all three bands). rotary_dim 0: the full head.
RopeConfig MakeTestRope(RopeScalingType type, RopeStyle style = RopeStyle::kNeox,
                        int rotary_dim = 0, double theta = 10000.0);

// FreshSeed, the seed of a random test fixture (replayable with KVT_TEST_SEED), comes with this
// header from common/testing/test_seed.h.

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
  int window = 1;  // MapperView::window: tokens each output token reads
  // kRidge: head-local (per_head) weights, n_t x [window k g d_s, d_t] stacked (MapperView).
  bool ridge_per_head = false;
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
