#include "kernels/rope.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvt {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

bool Positive(double value) { return std::isfinite(value) && value > 0; }

absl::Status FieldError(const char* field, double value, const char* requirement) {
  return absl::InvalidArgumentError(
      absl::StrCat("rope.", field, "=", value, " is invalid: must be ", requirement));
}

// Hugging Face _compute_llama3_parameters, in double.
void ScaleLlama3(const RopeScaling& s, std::vector<double>* inv_freq) {
  const double low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
  const double high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
  for (double& f : *inv_freq) {
    const double wavelen = kTwoPi / f;
    if (wavelen > low_freq_wavelen) {
      f /= s.factor;
    } else if (wavelen >= high_freq_wavelen) {
      const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      f = (1 - smooth) * f / s.factor + smooth * f;
    }
  }
}

// Hugging Face _compute_yarn_parameters (truncate=True), in double, with dim = rotary dim.
void ScaleYarn(const RopeScaling& s, double theta, int dim, std::vector<double>* inv_freq) {
  const auto correction_dim = [&](double num_rotations) {
    return dim * std::log(s.original_max_position_embeddings / (num_rotations * kTwoPi)) /
           (2 * std::log(theta));
  };
  const double low = std::max(std::floor(correction_dim(s.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(s.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // HF's guard against a zero-width ramp
  for (size_t m = 0; m < inv_freq->size(); ++m) {
    const double ramp = std::clamp((static_cast<double>(m) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1 - ramp;
    const double extrapolated = (*inv_freq)[m];
    const double interpolated = extrapolated / s.factor;
    (*inv_freq)[m] =
        interpolated * (1 - extrapolation_factor) + extrapolated * extrapolation_factor;
  }
}

}  // namespace

absl::StatusOr<RopeStyle> ParseRopeStyle(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "neox") return RopeStyle::kNeox;
  if (lower == "gptj") return RopeStyle::kGptj;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported RoPE style '", name, "' (expected neox or gptj)"));
}

const char* RopeStyleName(RopeStyle style) {
  return style == RopeStyle::kNeox ? "neox" : "gptj";
}

absl::StatusOr<RopeScalingType> ParseRopeScalingType(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  // Hugging Face calls unscaled RoPE "default".
  if (lower == "none" || lower == "default") return RopeScalingType::kNone;
  if (lower == "linear") return RopeScalingType::kLinear;
  if (lower == "llama3") return RopeScalingType::kLlama3;
  if (lower == "yarn") return RopeScalingType::kYarn;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported RoPE scaling type '", name,
                   "' (supported: none, linear, llama3, yarn; dynamic NTK, longrope and "
                   "M-RoPE are not)"));
}

const char* RopeScalingTypeName(RopeScalingType type) {
  switch (type) {
    case RopeScalingType::kNone:
      return "none";
    case RopeScalingType::kLinear:
      return "linear";
    case RopeScalingType::kLlama3:
      return "llama3";
    case RopeScalingType::kYarn:
      return "yarn";
  }
  return "?";
}

absl::Status ValidateRopeConfig(const RopeConfig& config, int head_dim) {
  if (head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim=", head_dim, " is invalid: must be positive"));
  }
  if (!Positive(config.theta)) return FieldError("theta", config.theta, "positive and finite");
  if (config.rotary_dim <= 0 || config.rotary_dim % 2 != 0 || config.rotary_dim > head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope.rotary_dim=", config.rotary_dim,
                     " is invalid: must be even, positive and <= head_dim=", head_dim));
  }
  if (config.style != RopeStyle::kNeox && config.style != RopeStyle::kGptj) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope.style=", static_cast<int>(config.style), " is not a known style"));
  }
  const RopeScaling& s = config.scaling;
  switch (s.type) {
    case RopeScalingType::kNone:
      return absl::OkStatus();
    case RopeScalingType::kLinear:
      if (!Positive(s.factor)) return FieldError("scaling.factor", s.factor, "positive");
      return absl::OkStatus();
    case RopeScalingType::kLlama3:
      if (!Positive(s.factor)) return FieldError("scaling.factor", s.factor, "positive");
      if (!Positive(s.low_freq_factor)) {
        return FieldError("scaling.low_freq_factor", s.low_freq_factor, "positive");
      }
      // The smooth band divides by high - low.
      if (!Positive(s.high_freq_factor) || s.high_freq_factor <= s.low_freq_factor) {
        return FieldError("scaling.high_freq_factor", s.high_freq_factor,
                          "finite and greater than scaling.low_freq_factor");
      }
      if (!Positive(s.original_max_position_embeddings)) {
        return FieldError("scaling.original_max_position_embeddings",
                          s.original_max_position_embeddings, "positive");
      }
      return absl::OkStatus();
    case RopeScalingType::kYarn:
      if (!Positive(s.factor)) return FieldError("scaling.factor", s.factor, "positive");
      if (!Positive(s.beta_fast)) return FieldError("scaling.beta_fast", s.beta_fast, "positive");
      if (!Positive(s.beta_slow)) return FieldError("scaling.beta_slow", s.beta_slow, "positive");
      if (!Positive(s.original_max_position_embeddings)) {
        return FieldError("scaling.original_max_position_embeddings",
                          s.original_max_position_embeddings, "positive");
      }
      if (s.has_attention_factor && !Positive(s.attention_factor)) {
        return FieldError("scaling.attention_factor", s.attention_factor, "positive");
      }
      // theta == 1 would make the correction range divide by log(theta) = 0.
      if (config.theta == 1.0) return FieldError("theta", config.theta, "!= 1 for yarn");
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "rope.scaling.type=", static_cast<int>(s.type), " is not a known scaling type"));
}

absl::StatusOr<Rope> Rope::Create(const RopeConfig& config, int head_dim) {
  if (absl::Status status = ValidateRopeConfig(config, head_dim); !status.ok()) return status;
  Rope rope;
  rope.config_ = config;
  rope.head_dim_ = head_dim;
  const int r = config.rotary_dim;
  rope.inv_freq_.resize(r / 2);
  for (int m = 0; m < r / 2; ++m) {
    rope.inv_freq_[m] = std::pow(config.theta, -2.0 * m / r);
  }
  const RopeScaling& s = config.scaling;
  switch (s.type) {
    case RopeScalingType::kNone:
      break;
    case RopeScalingType::kLinear:
      for (double& f : rope.inv_freq_) f /= s.factor;
      break;
    case RopeScalingType::kLlama3:
      ScaleLlama3(s, &rope.inv_freq_);
      break;
    case RopeScalingType::kYarn:
      ScaleYarn(s, config.theta, r, &rope.inv_freq_);
      if (s.has_attention_factor) {
        rope.attention_factor_ = s.attention_factor;
      } else {
        rope.attention_factor_ = s.factor <= 1 ? 1.0 : 0.1 * std::log(s.factor) + 1.0;
      }
      break;
  }
  for (double f : rope.inv_freq_) {
    rope.step_cos_.push_back(std::cos(f));
    rope.step_sin_.push_back(std::sin(f));
  }
  // Strip receives cos/sin that already carry the factor A; undoing A R(phi) needs 1/A^2.
  rope.strip_scale_ = static_cast<float>(1.0 / (rope.attention_factor_ * rope.attention_factor_));
  return rope;
}

double Rope::Angle(uint64_t position, int m) const {
  // p * f split exactly into hi + lo (positions below 2^53 are exact doubles), then reduced by a
  // two-part 2 pi. fmod by the double nearest 2 pi alone would be off by (x / 2 pi) * 2.4e-16,
  // which reaches 1e-4 rad near p = 2^40.
  constexpr double kTwoPiHi = 6.283185307179586232;
  constexpr double kTwoPiLo = 2.4492935982947064e-16;
  const double p = static_cast<double>(position);
  const double f = inv_freq_[m];
  const double hi = p * f;
  const double lo = std::fma(p, f, -hi);
  const double turns = std::floor(hi / kTwoPiHi);
  double angle = (std::fma(-turns, kTwoPiHi, hi) - turns * kTwoPiLo) + lo;
  // The division may round `turns` across an integer; one correction either way suffices.
  if (angle < 0) angle += kTwoPi;
  if (angle >= kTwoPi) angle -= kTwoPi;
  return angle;
}

void Rope::CosSin(uint64_t position, float* cos, float* sin) const {
  const int half = config_.rotary_dim / 2;
  for (int m = 0; m < half; ++m) {
    const double angle = Angle(position, m);
    cos[m] = static_cast<float>(attention_factor_ * std::cos(angle));
    sin[m] = static_cast<float>(attention_factor_ * std::sin(angle));
  }
}

void Rope::CosSinRange(uint64_t first, int64_t count, float* cos, float* sin) const {
  // Re-anchoring every kAnchor rows bounds the drift of the recurrence whatever the count.
  constexpr int64_t kAnchor = 64;
  const int half = config_.rotary_dim / 2;
  const double factor = attention_factor_;
  std::vector<double> c(half), s(half);
  for (int64_t i = 0; i < count; ++i) {
    if (i % kAnchor == 0) {
      for (int m = 0; m < half; ++m) {
        const double angle = Angle(first + static_cast<uint64_t>(i), m);
        c[m] = std::cos(angle);
        s[m] = std::sin(angle);
      }
    } else {
      for (int m = 0; m < half; ++m) {
        const double next_c = c[m] * step_cos_[m] - s[m] * step_sin_[m];
        s[m] = s[m] * step_cos_[m] + c[m] * step_sin_[m];
        c[m] = next_c;
      }
    }
    float* row_cos = cos + i * half;
    float* row_sin = sin + i * half;
    for (int m = 0; m < half; ++m) {
      row_cos[m] = static_cast<float>(factor * c[m]);
      row_sin[m] = static_cast<float>(factor * s[m]);
    }
  }
}

void Rope::ApplyHead(const float* cos, const float* sin, float* x) const {
  const int half = config_.rotary_dim / 2;
  if (config_.style == RopeStyle::kNeox) {
    float* lo = x;
    float* hi = x + half;
    int m = 0;
    // Eight pairs at a time (AVX2 + FMA, the kernels' baseline); same arithmetic as the tail.
    for (; m + 8 <= half; m += 8) {
      const __m256 a = _mm256_loadu_ps(lo + m), b = _mm256_loadu_ps(hi + m);
      const __m256 c = _mm256_loadu_ps(cos + m), s = _mm256_loadu_ps(sin + m);
      _mm256_storeu_ps(lo + m, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
      _mm256_storeu_ps(hi + m, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
    }
    for (; m < half; ++m) {
      const float a = lo[m];
      const float b = hi[m];
      lo[m] = a * cos[m] - b * sin[m];
      hi[m] = b * cos[m] + a * sin[m];
    }
  } else {
    for (int m = 0; m < half; ++m) {
      const float a = x[2 * m];
      const float b = x[2 * m + 1];
      x[2 * m] = a * cos[m] - b * sin[m];
      x[2 * m + 1] = b * cos[m] + a * sin[m];
    }
  }
}

void Rope::StripHead(const float* cos, const float* sin, float* x) const {
  const int half = config_.rotary_dim / 2;
  const float scale = strip_scale_;
  if (config_.style == RopeStyle::kNeox) {
    float* lo = x;
    float* hi = x + half;
    int m = 0;
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (; m + 8 <= half; m += 8) {
      const __m256 a = _mm256_loadu_ps(lo + m), b = _mm256_loadu_ps(hi + m);
      const __m256 c = _mm256_loadu_ps(cos + m), s = _mm256_loadu_ps(sin + m);
      _mm256_storeu_ps(lo + m, _mm256_mul_ps(_mm256_fmadd_ps(a, c, _mm256_mul_ps(b, s)), scale8));
      _mm256_storeu_ps(hi + m, _mm256_mul_ps(_mm256_fmsub_ps(b, c, _mm256_mul_ps(a, s)), scale8));
    }
    for (; m < half; ++m) {
      const float a = lo[m];
      const float b = hi[m];
      lo[m] = (a * cos[m] + b * sin[m]) * scale;
      hi[m] = (b * cos[m] - a * sin[m]) * scale;
    }
  } else {
    for (int m = 0; m < half; ++m) {
      const float a = x[2 * m];
      const float b = x[2 * m + 1];
      x[2 * m] = (a * cos[m] + b * sin[m]) * scale;
      x[2 * m + 1] = (b * cos[m] - a * sin[m]) * scale;
    }
  }
}

void RopeTablesFor(const Rope& rope, const Positions& positions, int64_t first_token,
                   int64_t count, float* cos, float* sin) {
  if (positions.explicit_positions == nullptr) {
    rope.CosSinRange(positions.at(first_token), count, cos, sin);
    return;
  }
  const int half = rope.rotary_dim() / 2;
  for (int64_t i = 0; i < count; ++i) {
    rope.CosSin(positions.at(first_token + i), cos + i * half, sin + i * half);
  }
}

absl::StatusOr<TranslationRope> TranslationRope::Create(const RopeConfig& source,
                                                        int source_head_dim,
                                                        const RopeConfig& target,
                                                        int target_head_dim) {
  absl::StatusOr<Rope> strip = Rope::Create(source, source_head_dim);
  if (!strip.ok()) return strip.status();
  absl::StatusOr<Rope> apply = Rope::Create(target, target_head_dim);
  if (!apply.ok()) return apply.status();
  TranslationRope rope;
  rope.strip_ = *std::move(strip);
  rope.apply_ = *std::move(apply);
  return rope;
}

RopeTableLayout TranslationRope::TableLayout(int64_t read_rows, int64_t rows) const {
  RopeTableLayout layout;
  layout.strip_cos = 0;
  layout.strip_sin = read_rows * strip_half();
  layout.apply_cos = 2 * read_rows * strip_half();
  layout.apply_sin = layout.apply_cos + rows * apply_half();
  layout.floats = layout.apply_sin + rows * apply_half();
  return layout;
}

RopeTableLayout TranslationRope::Fill(const Positions& positions, int64_t read_begin,
                                      int64_t read_rows, int64_t begin, int64_t rows,
                                      float* tables) const {
  const RopeTableLayout layout = TableLayout(read_rows, rows);
  RopeTablesFor(strip_, positions, read_begin, read_rows, tables + layout.strip_cos,
                tables + layout.strip_sin);
  RopeTablesFor(apply_, positions, begin, rows, tables + layout.apply_cos,
                tables + layout.apply_sin);
  return layout;
}

}  // namespace kvt
