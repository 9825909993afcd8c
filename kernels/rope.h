// Rotary position embedding exactly as SPEC section 2 fixes it: frequencies (none, linear,
// llama3, yarn scaling), neox and gptj pairing, partial rotary, yarn's attention factor, and
// angles from exact integer positions. The one home of RoPE for every backend.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvt {

enum class RopeStyle {
  kNeox,  // dimension m pairs with m + r/2 (Hugging Face rotate_half)
  kGptj,  // dimension 2m pairs with 2m + 1 (interleaved)
};

enum class RopeScalingType { kNone, kLinear, kLlama3, kYarn };

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;                              // linear, llama3, yarn
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  double original_max_position_embeddings = 8192;   // llama3, yarn
  double beta_fast = 32.0;                          // yarn
  double beta_slow = 1.0;                           // yarn
  // yarn: multiplies cos and sin. Unset -> 0.1 * ln(factor) + 1 (Hugging Face default).
  bool has_attention_factor = false;
  double attention_factor = 1.0;
};

struct RopeConfig {
  double theta = 10000.0;
  int rotary_dim = 0;  // r: even, 0 < r <= head_dim. Dimensions >= r pass through.
  RopeStyle style = RopeStyle::kNeox;
  RopeScaling scaling;
};

// "neox"/"gptj", "none"/"linear"/"llama3"/"yarn". Parsing refuses anything else with an error
// that names the type (dynamic, longrope, mrope, ...).
absl::StatusOr<RopeStyle> ParseRopeStyle(const std::string& name);
const char* RopeStyleName(RopeStyle style);
absl::StatusOr<RopeScalingType> ParseRopeScalingType(const std::string& name);
const char* RopeScalingTypeName(RopeScalingType type);

// Checks ranges (theta > 0, r even and <= head_dim, factors > 0, ...); errors name the field.
absl::Status ValidateRopeConfig(const RopeConfig& config, int head_dim);

// Precomputed frequencies of one model. Cheap to copy.
class Rope {
 public:
  static absl::StatusOr<Rope> Create(const RopeConfig& config, int head_dim);

  int head_dim() const { return head_dim_; }
  int rotary_dim() const { return config_.rotary_dim; }
  RopeStyle style() const { return config_.style; }
  // cos and sin are multiplied by this (1 except for yarn).
  double attention_factor() const { return attention_factor_; }
  // What StripHead multiplies by: 1 / attention_factor^2 as float (device kernels strip with
  // the same value).
  float strip_scale() const { return strip_scale_; }
  // r/2 inverse frequencies after scaling, in double.
  const std::vector<double>& inv_freq() const { return inv_freq_; }

  // Angle p * inv_freq[m] reduced to [0, 2 pi), computed in double from the exact position.
  double Angle(uint64_t position, int m) const;

  // Fills cos[m], sin[m] (m < r/2) for `position`, including the attention factor, as float.
  void CosSin(uint64_t position, float* cos, float* sin) const;

  // CosSin for the consecutive positions first .. first + count - 1, row i (r/2 floats) at
  // cos + i * r/2 and sin + i * r/2. Every 64th row is computed as CosSin does; the rows
  // between by double-precision angle addition from it (error ~1e-14 before the cast to float),
  // which costs a few multiplies per pair instead of a sin and a cos.
  void CosSinRange(uint64_t first, int64_t count, float* cos, float* sin) const;

  // In place on one head vector of head_dim floats at `position`:
  //   Apply: x <- R(p) x (scaled by the attention factor), as a model writes its cache.
  //   Strip: x <- R(p)^-1 x / attention factor, back to content space.
  // cos/sin as filled by CosSin for that position.
  void ApplyHead(const float* cos, const float* sin, float* x) const;
  void StripHead(const float* cos, const float* sin, float* x) const;

 private:
  RopeConfig config_;
  int head_dim_ = 0;
  double attention_factor_ = 1.0;
  float strip_scale_ = 1.0f;  // 1 / attention_factor^2, see StripHead
  std::vector<double> inv_freq_;
  std::vector<double> step_cos_, step_sin_;  // cos, sin of inv_freq: one position forward
};

// Absolute positions of a request's tokens: offset + i, or an explicit list.
struct Positions {
  uint64_t offset = 0;
  const uint64_t* explicit_positions = nullptr;  // num_tokens entries when set
  uint64_t at(int64_t token) const {
    return explicit_positions ? explicit_positions[token] : offset + static_cast<uint64_t>(token);
  }
};

// `rope`'s cos/sin rows for tokens first_token .. first_token + count - 1 of a request (row i,
// rotary_dim/2 floats, at cos + i * rotary_dim/2): by angle addition when the positions are
// consecutive, one exact row per token otherwise.
void RopeTablesFor(const Rope& rope, const Positions& positions, int64_t first_token,
                   int64_t count, float* cos, float* sin);

// Where one piece's four tables sit in one buffer of `floats` floats (offsets in floats): the
// source's strip rows for the tokens the piece reads (with a window mapper's earlier ones), then
// the target's apply rows for the piece's own tokens.
struct RopeTableLayout {
  int64_t strip_cos = 0, strip_sin = 0, apply_cos = 0, apply_sin = 0;
  int64_t floats = 0;
};

// The two rotations of one translation (SPEC 3): the source model's RoPE, stripped from the
// gathered keys, and the target model's, applied to the mapped keys. Every backend builds it
// from the mapper's two models and fills its per-piece tables through it, so the tables (and the
// positions they are computed from) are the same bits on every backend.
class TranslationRope {
 public:
  static absl::StatusOr<TranslationRope> Create(const RopeConfig& source, int source_head_dim,
                                                const RopeConfig& target, int target_head_dim);

  const Rope& strip() const { return strip_; }
  const Rope& apply() const { return apply_; }
  int strip_half() const { return strip_.rotary_dim() / 2; }
  int apply_half() const { return apply_.rotary_dim() / 2; }

  // Strip rows for `read_rows` tokens, apply rows for `rows` tokens.
  RopeTableLayout TableLayout(int64_t read_rows, int64_t rows) const;
  // Fills `tables` (TableLayout(read_rows, rows).floats floats): strip rows for tokens
  // read_begin .., apply rows for tokens begin ...
  RopeTableLayout Fill(const Positions& positions, int64_t read_begin, int64_t read_rows,
                       int64_t begin, int64_t rows, float* tables) const;

 private:
  Rope strip_;
  Rope apply_;
};

}  // namespace kvt
