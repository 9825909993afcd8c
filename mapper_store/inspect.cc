#include "mapper_store/inspect.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kernels/rope.h"

namespace kvt {
namespace {

std::string DescribeRope(const RopeConfig& rope, int head_dim) {
  std::string text = absl::StrCat("theta ", FormatDouble(rope.theta), ", ",
                                  RopeStyleName(rope.style), ", rotary_dim ", rope.rotary_dim);
  if (rope.rotary_dim < head_dim) absl::StrAppend(&text, " (partial)");
  const RopeScaling& s = rope.scaling;
  switch (s.type) {
    case RopeScalingType::kNone:
      absl::StrAppend(&text, ", no scaling");
      break;
    case RopeScalingType::kLinear:
      absl::StrAppend(&text, ", linear scaling x", FormatDouble(s.factor));
      break;
    case RopeScalingType::kLlama3:
      absl::StrAppend(&text, ", llama3 scaling x", FormatDouble(s.factor), " (low ",
                      FormatDouble(s.low_freq_factor), ", high ", FormatDouble(s.high_freq_factor),
                      ", original ", FormatDouble(s.original_max_position_embeddings), ")");
      break;
    case RopeScalingType::kYarn:
      absl::StrAppend(&text, ", yarn scaling x", FormatDouble(s.factor), " (beta_fast ",
                      FormatDouble(s.beta_fast), ", beta_slow ", FormatDouble(s.beta_slow),
                      ", original ", FormatDouble(s.original_max_position_embeddings));
      if (s.has_attention_factor) {
        absl::StrAppend(&text, ", attention_factor ", FormatDouble(s.attention_factor));
      }
      absl::StrAppend(&text, ")");
      break;
  }
  return text;
}

std::string DescribeModel(const ModelSpec& m) {
  return absl::StrCat(m.name, ": ", m.num_layers, " layers, ", m.num_kv_heads, " KV heads x ",
                      m.head_dim, "\n              RoPE ", DescribeRope(m.rope, m.head_dim));
}

std::string List(const std::vector<int>& values) {
  return absl::StrCat("[", absl::StrJoin(values, ", "), "]");
}

std::string R2(const std::optional<double>& value) {
  return value.has_value() ? absl::StrFormat("%.3f", *value) : "-";
}

// Mean of the present values, if any.
std::optional<double> Mean(const std::vector<LayerEntry>& layers,
                           std::optional<double> LayerEntry::*field) {
  double sum = 0;
  int count = 0;
  for (const LayerEntry& layer : layers) {
    if ((layer.*field).has_value()) {
      sum += *(layer.*field);
      ++count;
    }
  }
  if (count == 0) return std::nullopt;
  return sum / count;
}

}  // namespace

std::string HumanBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double value = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (value >= 1024 && unit < 3) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

std::string HumanCount(int64_t count) {
  if (count < 1000) return absl::StrCat(count);
  if (count < 1000000) return absl::StrFormat("%.1f K", count / 1e3);
  if (count < 1000000000) return absl::StrFormat("%.1f M", count / 1e6);
  return absl::StrFormat("%.2f B", count / 1e9);
}

std::string InspectManifest(const Manifest& m, const std::string& id) {
  std::string out;
  const int64_t params = MapperNumParams(m);
  const uint64_t bytes = MapperWeightBytes(m);
  absl::StrAppend(&out, "mapper        ", id, "\n");
  absl::StrAppend(&out, "kind          ", MapperKindName(m.kind),
                  m.synthetic ? " (SYNTHETIC: random weights, not a fitted mapper)" : "", "\n");
  if (m.mlp.has_value()) {
    absl::StrAppend(&out, "mlp           hidden ", m.mlp->hidden, ", ",
                    MlpGranularityName(m.mlp->granularity),
                    m.mlp->granularity == MlpGranularity::kPerHead
                        ? absl::StrCat(" (", m.target.num_kv_heads, " chains per target layer and K|V)")
                        : " (one chain per target layer and K|V)",
                    ", relu\n");
  }
  if (m.ridge_granularity == RidgeGranularity::kPerHead) {
    const int g = HeadLocalSources(m.source, m.target, 0).count;
    absl::StrAppend(&out, "ridge         per_head: target head h maps only source head",
                    g == 1 ? "" : "s", " ",
                    g == 1 ? "h x n_s / n_t" : absl::StrCat("[h x n_s / n_t, + ", g, ")"),
                    " of each selected layer (", m.target.num_kv_heads, " GEMMs per target layer "
                    "and K|V)\n");
  }
  absl::StrAppend(&out, "format        version ", m.format_version,
                  m.created_by.empty() ? "" : absl::StrCat(", created by ", m.created_by), "\n");
  absl::StrAppend(&out, "source        ", DescribeModel(m.source), "\n");
  absl::StrAppend(&out, "target        ", DescribeModel(m.target), "\n");
  absl::StrAppend(&out, "k             ", m.k, " source layers per target layer (of ",
                  m.source.num_layers, ")\n");
  if (m.window > 1) {
    absl::StrAppend(&out, "window        ", m.window, " tokens: each output token reads itself and the ",
                    m.window - 1, " before it in the request\n");
  }
  absl::StrAppend(&out, "lambda        ", FormatDouble(m.lambda), " (", LambdaScaleName(m.lambda_scale),
                  " scale)\n");
  absl::StrAppend(&out, "weights       ", m.weights_file, ", ", DTypeName(m.weights_dtype), ", ",
                  HumanCount(params), " parameters (", params, "), ", HumanBytes(bytes), " (",
                  bytes, " bytes)\n");
  const int64_t out_cols = static_cast<int64_t>(m.target.num_kv_heads) * m.target.head_dim;
  const int64_t in_per_layer = static_cast<int64_t>(m.source.num_kv_heads) * m.source.head_dim;
  if (m.mlp.has_value()) {
    const int64_t hidden = m.mlp->hidden;
    if (m.mlp->granularity == MlpGranularity::kPerHead) {
      absl::StrAppend(&out, "per layer     K, V: fc1 [", m.target.num_kv_heads, ", len(sigma) x ",
                      in_per_layer, ", ", hidden, "], fc2 [", m.target.num_kv_heads, ", ", hidden,
                      ", ", hidden, "], fc3 [", m.target.num_kv_heads, ", ", hidden, ", ",
                      m.target.head_dim, "] + biases\n");
    } else {
      absl::StrAppend(&out, "per layer     K, V: fc1 [len(sigma) x ", in_per_layer, ", ", hidden,
                      "], fc2 [", hidden, ", ", hidden, "], fc3 [", hidden, ", ", out_cols,
                      "] + biases\n");
    }
  } else if (m.ridge_granularity == RidgeGranularity::kPerHead) {
    const int64_t head_in = static_cast<int64_t>(HeadLocalSources(m.source, m.target, 0).count) *
                            m.source.head_dim;
    absl::StrAppend(&out, "per layer     W_K, W_V [", m.target.num_kv_heads, ", ",
                    m.window > 1 ? absl::StrCat(m.window, " x ") : "", "len(sigma) x ", head_in,
                    ", ", m.target.head_dim, "], b_K, b_V [", m.target.num_kv_heads, ", ",
                    m.target.head_dim, "]\n");
  } else {
    absl::StrAppend(&out, "per layer     W_K, W_V [", m.window > 1 ? absl::StrCat(m.window, " x ") : "",
                    "len(sigma) x ", in_per_layer, ", ", out_cols, "], b_K, b_V [", out_cols,
                    "]\n");
  }
  if (!m.calibration_yaml.empty()) {
    absl::StrAppend(&out, "calibration\n");
    for (absl::string_view line :
         absl::StrSplit(absl::StripSuffix(m.calibration_yaml, "\n"), '\n')) {
      absl::StrAppend(&out, "  ", line, "\n");
    }
  }

  const std::pair<const char*, std::optional<double> LayerEntry::*> r2_fields[] = {
      {"r2_k", &LayerEntry::r2_k},
      {"r2_v", &LayerEntry::r2_v},
      {"r2_k_heldout", &LayerEntry::r2_k_heldout},
      {"r2_v_heldout", &LayerEntry::r2_v_heldout}};
  std::vector<std::pair<const char*, std::optional<double> LayerEntry::*>> present;
  for (const auto& field : r2_fields) {
    if (Mean(m.layers, field.second).has_value()) present.push_back(field);
  }
  if (!present.empty()) {
    absl::StrAppend(&out, "R^2 mean     ");
    for (const auto& [name, field] : present) {
      absl::StrAppend(&out, " ", name, " ", R2(Mean(m.layers, field)));
    }
    absl::StrAppend(&out, "\n");
  }

  if (!m.quality.benefit.empty()) {
    // What kvtd's benefit gate holds to prefix_cache.min_benefit_recovered: each lower bound.
    absl::StrAppend(&out, "benefit       context benefit recovered [95% interval] per text "
                          "(quality.benefit)\n");
    for (const BenefitRecord& record : m.quality.benefit) {
      absl::StrAppend(&out, "  ", DescribeBenefit(record), "\n");
    }
  }

  // Per-layer table; a V list equal to the K list prints as "= sigma_k" to keep lines short.
  size_t k_width = 7;
  for (const LayerEntry& layer : m.layers) k_width = std::max(k_width, List(layer.sigma_k).size());
  absl::StrAppend(&out, "\nlayer  ", absl::StrFormat("%-*s", static_cast<int>(k_width), "sigma_k"),
                  "  sigma_v");
  std::vector<std::string> v_column;
  size_t v_width = 7;
  for (const LayerEntry& layer : m.layers) {
    v_column.push_back(layer.sigma_v == layer.sigma_k ? "= sigma_k" : List(layer.sigma_v));
    v_width = std::max(v_width, v_column.back().size());
  }
  if (!present.empty()) {
    absl::StrAppend(&out, std::string(v_width - 7, ' '));
    for (const auto& [name, field] : present) absl::StrAppend(&out, absl::StrFormat("  %12s", name));
  }
  absl::StrAppend(&out, "\n");
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const LayerEntry& layer = m.layers[i];
    std::string line = absl::StrFormat("%5d  %-*s  ", layer.target_layer, static_cast<int>(k_width),
                                       List(layer.sigma_k));
    if (present.empty()) {
      absl::StrAppend(&line, v_column[i]);
    } else {
      absl::StrAppend(&line, absl::StrFormat("%-*s", static_cast<int>(v_width), v_column[i]));
      for (const auto& [name, field] : present) {
        absl::StrAppend(&line, absl::StrFormat("  %12s", R2(layer.*field)));
      }
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

std::string DescribeBenefit(const BenefitRecord& r) {
  return absl::StrCat(r.text, ": recovered ", FormatDouble(r.recovered), " [",
                      FormatDouble(r.lower95), ", ", FormatDouble(r.upper95), "], KL ",
                      FormatDouble(r.kl), " nats/token (", r.windows, " windows, ",
                      r.context_tokens, " + ", r.continuation_tokens, " tokens)");
}

std::string InspectMapper(const LoadedMapper& mapper) {
  std::string out = InspectManifest(mapper.manifest(), mapper.id());
  // Insert the location and load facts after the first line.
  const size_t first_line = out.find('\n') + 1;
  out.insert(first_line,
             absl::StrCat("path          ", mapper.path(), "\n", "loaded        ",
                          HumanBytes(mapper.weight_bytes()), " in host memory, ",
                          mapper.weights().tensors().size(), " tensors, checksums ",
                          mapper.checksums_verified() ? "verified" : "NOT verified", "\n"));
  return out;
}

absl::StatusOr<std::string> InspectMapperDir(const std::string& dir, const LoadOptions& options) {
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(dir, options);
  if (!mapper.ok()) return mapper.status();
  return InspectMapper(**mapper);
}

}  // namespace kvt
