#include "mapper_store/hf_config.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/rope.h"
#include "mapper_store/format/file_util.h"
#include "nlohmann/json.hpp"

namespace kvt {
namespace {

using nlohmann::json;

absl::Status Error(absl::string_view label, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(label, ": ", message));
}

// A positive integer at `key` of `object`; `present` reports whether the key exists (null counts
// as absent: HF writes "head_dim": null for "derive it").
absl::StatusOr<int> PositiveInt(const json& object, const std::string& key,
                                absl::string_view label, absl::string_view prefix,
                                bool* present) {
  *present = false;
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return 0;
  *present = true;
  if (!it->is_number_integer() || it->get<int64_t>() < 1 || it->get<int64_t>() > (1 << 24)) {
    return Error(label, absl::StrCat(prefix, key, " must be a positive integer, got ", it->dump()));
  }
  return static_cast<int>(it->get<int64_t>());
}

absl::StatusOr<int> RequiredInt(const json& object, const std::string& key,
                                absl::string_view label, absl::string_view prefix) {
  bool present = false;
  absl::StatusOr<int> value = PositiveInt(object, key, label, prefix, &present);
  if (value.ok() && !present) {
    return Error(label, absl::StrCat("missing required key ", prefix, key));
  }
  return value;
}

// A number at `key`, or `fallback` when absent or null.
absl::StatusOr<double> Number(const json& object, const std::string& key, double fallback,
                              absl::string_view label, absl::string_view prefix) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_number()) {
    return Error(label, absl::StrCat(prefix, key, " must be a number, got ", it->dump()));
  }
  return it->get<double>();
}

absl::StatusOr<RopeScaling> ParseScaling(const json& scaling, const json& config,
                                         absl::string_view label, absl::string_view prefix) {
  RopeScaling out;
  if (scaling.is_null()) return out;
  if (!scaling.is_object()) {
    return Error(label, absl::StrCat(prefix, " must be an object or null, got ", scaling.dump()));
  }
  const std::string dot = absl::StrCat(prefix, ".");
  // transformers >= 4.45 writes rope_type; older files (and some models) write type.
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    auto it = scaling.find(key);
    if (it != scaling.end() && !it->is_null()) {
      if (!it->is_string()) {
        return Error(label, absl::StrCat(dot, key, " must be a string, got ", it->dump()));
      }
      type = it->get<std::string>();
      break;
    }
  }
  if (type.empty()) {
    return Error(label, absl::StrCat("missing required key ", dot, "rope_type (or ", dot, "type)"));
  }
  absl::StatusOr<RopeScalingType> parsed = ParseRopeScalingType(type);
  if (!parsed.ok()) {
    return Error(label, absl::StrCat(dot, "rope_type '", type,
                                     "' is not supported (supported: default, linear, llama3, "
                                     "yarn; dynamic NTK, longrope and mrope are refused)"));
  }
  out.type = *parsed;
  if (out.type == RopeScalingType::kNone) return out;
  absl::StatusOr<double> factor = Number(scaling, "factor", 0.0, label, dot);
  if (!factor.ok()) return factor.status();
  if (*factor <= 0) return Error(label, absl::StrCat("missing or non-positive ", dot, "factor"));
  out.factor = *factor;
  if (out.type == RopeScalingType::kLlama3) {
    for (auto [key, field] : {std::pair<const char*, double*>{"low_freq_factor", &out.low_freq_factor},
                              {"high_freq_factor", &out.high_freq_factor},
                              {"original_max_position_embeddings",
                               &out.original_max_position_embeddings}}) {
      if (scaling.find(key) == scaling.end()) {
        return Error(label, absl::StrCat("missing required key ", dot, key, " (llama3 scaling)"));
      }
      absl::StatusOr<double> value = Number(scaling, key, *field, label, dot);
      if (!value.ok()) return value.status();
      *field = *value;
    }
  } else if (out.type == RopeScalingType::kYarn) {
    // DeepSeek-style mscale changes the attention factor by a rule kvt does not implement.
    for (const char* key : {"mscale", "mscale_all_dim"}) {
      if (scaling.find(key) != scaling.end()) {
        return Error(label, absl::StrCat(dot, key, " is not supported (DeepSeek yarn variant)"));
      }
    }
    absl::StatusOr<double> beta_fast = Number(scaling, "beta_fast", out.beta_fast, label, dot);
    absl::StatusOr<double> beta_slow = Number(scaling, "beta_slow", out.beta_slow, label, dot);
    absl::StatusOr<double> max_positions =
        Number(config, "max_position_embeddings", 0.0, label, "");
    if (!beta_fast.ok()) return beta_fast.status();
    if (!beta_slow.ok()) return beta_slow.status();
    if (!max_positions.ok()) return max_positions.status();
    absl::StatusOr<double> original =
        Number(scaling, "original_max_position_embeddings", *max_positions, label, dot);
    if (!original.ok()) return original.status();
    if (*original <= 0) {
      return Error(label, absl::StrCat("missing ", dot,
                                       "original_max_position_embeddings (and no "
                                       "max_position_embeddings to fall back on)"));
    }
    out.beta_fast = *beta_fast;
    out.beta_slow = *beta_slow;
    out.original_max_position_embeddings = *original;
    auto attention = scaling.find("attention_factor");
    if (attention != scaling.end() && !attention->is_null()) {
      absl::StatusOr<double> value = Number(scaling, "attention_factor", 1.0, label, dot);
      if (!value.ok()) return value.status();
      out.has_attention_factor = true;
      out.attention_factor = *value;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<ModelSpec> ParseHfConfig(absl::string_view json_text, absl::string_view label,
                                        const std::string& name) {
  json root = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Error(label, "not valid JSON");
  if (!root.is_object()) return Error(label, "top level is not a JSON object");
  const json* config = &root;
  std::string prefix;
  if (root.find("num_hidden_layers") == root.end() && root.contains("text_config") &&
      root["text_config"].is_object()) {
    config = &root["text_config"];
    prefix = "text_config.";
  }
  ModelSpec spec;
  spec.name = name;
  if (spec.name.empty()) {
    auto it = root.find("_name_or_path");
    if (it != root.end() && it->is_string()) spec.name = it->get<std::string>();
  }
  if (spec.name.empty()) {
    return Error(label, "no model name: the file has no _name_or_path; pass the name explicitly");
  }
  absl::StatusOr<int> layers = RequiredInt(*config, "num_hidden_layers", label, prefix);
  if (!layers.ok()) return layers.status();
  spec.num_layers = *layers;
  bool has_heads = false, has_kv_heads = false, has_head_dim = false, has_hidden = false;
  absl::StatusOr<int> heads =
      PositiveInt(*config, "num_attention_heads", label, prefix, &has_heads);
  absl::StatusOr<int> kv_heads =
      PositiveInt(*config, "num_key_value_heads", label, prefix, &has_kv_heads);
  absl::StatusOr<int> head_dim = PositiveInt(*config, "head_dim", label, prefix, &has_head_dim);
  absl::StatusOr<int> hidden = PositiveInt(*config, "hidden_size", label, prefix, &has_hidden);
  for (const auto* status : {&heads, &kv_heads, &head_dim, &hidden}) {
    if (!status->ok()) return status->status();
  }
  if (has_kv_heads) {
    spec.num_kv_heads = *kv_heads;
  } else if (has_heads) {
    spec.num_kv_heads = *heads;
  } else {
    return Error(label, absl::StrCat("missing required key ", prefix, "num_key_value_heads (and no ",
                                     prefix, "num_attention_heads to fall back on)"));
  }
  if (has_head_dim) {
    spec.head_dim = *head_dim;
  } else if (has_hidden && has_heads) {
    if (*hidden % *heads != 0) {
      return Error(label, absl::StrCat(prefix, "hidden_size ", *hidden,
                                       " is not a multiple of num_attention_heads ", *heads,
                                       "; give head_dim"));
    }
    spec.head_dim = *hidden / *heads;
  } else {
    return Error(label, absl::StrCat("missing required key ", prefix, "head_dim (and no ", prefix,
                                     "hidden_size / num_attention_heads to derive it)"));
  }
  // transformers 5 moves theta and the scaling rule into one rope_parameters map.
  const json* rope_map = nullptr;
  bool from_parameters = false;
  std::string rope_prefix = absl::StrCat(prefix, "rope_scaling");
  auto parameters = config->find("rope_parameters");
  if (parameters != config->end() && parameters->is_object()) {
    rope_map = &*parameters;
    from_parameters = true;
    rope_prefix = absl::StrCat(prefix, "rope_parameters");
  } else {
    auto scaling = config->find("rope_scaling");
    if (scaling != config->end()) rope_map = &*scaling;
  }
  const json& theta_holder =
      rope_map != nullptr && rope_map->is_object() && rope_map->contains("rope_theta") ? *rope_map
                                                                                      : *config;
  absl::StatusOr<double> theta = Number(theta_holder, "rope_theta", 10000.0, label,
                                        &theta_holder == config ? prefix : rope_prefix + ".");
  if (!theta.ok()) return theta.status();
  spec.rope.theta = *theta;
  absl::StatusOr<double> partial = Number(*config, "partial_rotary_factor", 1.0, label, prefix);
  if (!partial.ok()) return partial.status();
  if (*partial <= 0 || *partial > 1) {
    return Error(label, absl::StrCat(prefix, "partial_rotary_factor must be in (0, 1], got ",
                                     *partial));
  }
  // HF: int(head_dim * partial_rotary_factor); RoPE pairs dimensions, so it must be even.
  spec.rope.rotary_dim = static_cast<int>(spec.head_dim * *partial + 1e-9);
  if (spec.rope.rotary_dim % 2 != 0 || spec.rope.rotary_dim == 0) {
    return Error(label, absl::StrCat(prefix, "partial_rotary_factor ", *partial, " x head_dim ",
                                     spec.head_dim, " gives rotary_dim ", spec.rope.rotary_dim,
                                     ", which is not a positive even number"));
  }
  spec.rope.style = RopeStyle::kNeox;
  if (rope_map != nullptr) {
    json scaling = *rope_map;
    if (from_parameters) scaling.erase("rope_theta");
    absl::StatusOr<RopeScaling> parsed = ParseScaling(scaling, *config, label, rope_prefix);
    if (!parsed.ok()) return parsed.status();
    spec.rope.scaling = *parsed;
  }
  absl::Status valid = ValidateRopeConfig(spec.rope, spec.head_dim);
  if (!valid.ok()) return Error(label, valid.message());
  return spec;
}

absl::StatusOr<ModelSpec> ReadHfConfig(const std::string& path, const std::string& name) {
  const std::string file = IsDirectory(path) ? JoinPath(path, "config.json") : path;
  absl::StatusOr<std::string> text = ReadFileToString(file);
  if (!text.ok()) return text.status();
  return ParseHfConfig(*text, file, name);
}

}  // namespace kvt
