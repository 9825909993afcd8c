#include "mapper_store/hf_config.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/strict_reader.h"
#include "kernels/rope.h"
#include "nlohmann/json.hpp"

namespace kvt {
namespace {

using nlohmann::json;
using strict::JsonReader;
using strict::Path;

// Hugging Face configs carry many keys kvt does not read, so unknown keys are allowed; null
// counts as absent (HF writes "head_dim": null for "derive it").
const json* Find(const json& object, const std::string& key) {
  auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

// A positive integer at `path`.`key` of `object`; `present` reports whether the key is given.
absl::StatusOr<int> PositiveInt(const JsonReader& reader, const json& object,
                                absl::string_view path, const std::string& key, bool* present) {
  *present = false;
  const json* value = Find(object, key);
  if (value == nullptr) return 0;
  *present = true;
  absl::StatusOr<int> parsed = reader.Int(*value, Path(path, key), 1);
  if (!parsed.ok() || *parsed > (1 << 24)) {
    return reader.WrongType(*value, Path(path, key), "a positive integer");
  }
  return *parsed;
}

absl::StatusOr<int> RequiredInt(const JsonReader& reader, const json& object,
                                absl::string_view path, const std::string& key) {
  bool present = false;
  absl::StatusOr<int> value = PositiveInt(reader, object, path, key, &present);
  if (value.ok() && !present) return reader.Error(strict::MissingKeyMessage(Path(path, key)));
  return value;
}

// A number at `path`.`key`, or `fallback` when absent or null.
absl::StatusOr<double> Number(const JsonReader& reader, const json& object, absl::string_view path,
                              const std::string& key, double fallback) {
  const json* value = Find(object, key);
  if (value == nullptr) return fallback;
  if (!value->is_number()) return reader.WrongType(*value, Path(path, key), "a number");
  return value->get<double>();
}

// `scaling` is the value at `path` (rope_scaling, or rope_parameters without rope_theta).
absl::StatusOr<RopeScaling> ParseScaling(const JsonReader& reader, const json& scaling,
                                         const json& config, absl::string_view config_path,
                                         absl::string_view path) {
  RopeScaling out;
  if (scaling.is_null()) return out;
  if (!scaling.is_object()) return reader.WrongType(scaling, path, "an object or null");
  // transformers >= 4.45 writes rope_type; older files (and some models) write type.
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    if (const json* value = Find(scaling, key)) {
      if (!value->is_string()) return reader.WrongType(*value, Path(path, key), "a string");
      type = value->get<std::string>();
      break;
    }
  }
  if (type.empty()) {
    return reader.Error(absl::StrCat(strict::MissingKeyMessage(Path(path, "rope_type")), " (or '",
                                     Path(path, "type"), "')"));
  }
  absl::StatusOr<RopeScalingType> parsed = ParseRopeScalingType(type);
  if (!parsed.ok()) {
    return reader.Error(absl::StrCat(Path(path, "rope_type"), " '", type,
                                     "' is not supported (supported: default, linear, llama3, "
                                     "yarn; dynamic NTK, longrope and mrope are refused)"));
  }
  out.type = *parsed;
  if (out.type == RopeScalingType::kNone) return out;
  absl::StatusOr<double> factor = Number(reader, scaling, path, "factor", 0.0);
  if (!factor.ok()) return factor.status();
  if (*factor <= 0) {
    return reader.Error(absl::StrCat("missing or non-positive '", Path(path, "factor"), "'"));
  }
  out.factor = *factor;
  if (out.type == RopeScalingType::kLlama3) {
    for (auto [key, field] :
         {std::pair<const char*, double*>{"low_freq_factor", &out.low_freq_factor},
          {"high_freq_factor", &out.high_freq_factor},
          {"original_max_position_embeddings", &out.original_max_position_embeddings}}) {
      if (scaling.find(key) == scaling.end()) {
        return reader.Error(
            absl::StrCat(strict::MissingKeyMessage(Path(path, key)), " (llama3 scaling)"));
      }
      absl::StatusOr<double> value = Number(reader, scaling, path, key, *field);
      if (!value.ok()) return value.status();
      *field = *value;
    }
  } else if (out.type == RopeScalingType::kYarn) {
    // DeepSeek-style mscale changes the attention factor by a rule kvt does not implement.
    for (const char* key : {"mscale", "mscale_all_dim"}) {
      if (scaling.find(key) != scaling.end()) {
        return reader.Error(
            absl::StrCat("key '", Path(path, key), "' is not supported (DeepSeek yarn variant)"));
      }
    }
    absl::StatusOr<double> beta_fast = Number(reader, scaling, path, "beta_fast", out.beta_fast);
    absl::StatusOr<double> beta_slow = Number(reader, scaling, path, "beta_slow", out.beta_slow);
    absl::StatusOr<double> max_positions =
        Number(reader, config, config_path, "max_position_embeddings", 0.0);
    if (!beta_fast.ok()) return beta_fast.status();
    if (!beta_slow.ok()) return beta_slow.status();
    if (!max_positions.ok()) return max_positions.status();
    absl::StatusOr<double> original =
        Number(reader, scaling, path, "original_max_position_embeddings", *max_positions);
    if (!original.ok()) return original.status();
    if (*original <= 0) {
      return reader.Error(absl::StrCat(
          strict::MissingKeyMessage(Path(path, "original_max_position_embeddings")), " (and no '",
          Path(config_path, "max_position_embeddings"), "' to fall back on)"));
    }
    out.beta_fast = *beta_fast;
    out.beta_slow = *beta_slow;
    out.original_max_position_embeddings = *original;
    if (Find(scaling, "attention_factor") != nullptr) {
      absl::StatusOr<double> value = Number(reader, scaling, path, "attention_factor", 1.0);
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
  const JsonReader reader(label);
  absl::StatusOr<json> parsed_root = reader.Parse(json_text);
  if (!parsed_root.ok()) return parsed_root.status();
  const json& root = *parsed_root;
  const json* config = &root;
  std::string path;  // of the language model's keys: "" or "text_config"
  if (root.find("num_hidden_layers") == root.end() && root.contains("text_config") &&
      root["text_config"].is_object()) {
    config = &root["text_config"];
    path = "text_config";
  }
  ModelSpec spec;
  spec.name = name;
  if (spec.name.empty()) {
    auto it = root.find("_name_or_path");
    if (it != root.end() && it->is_string()) spec.name = it->get<std::string>();
  }
  if (spec.name.empty()) {
    return reader.Error("no model name: the file has no _name_or_path; pass the name explicitly");
  }
  absl::StatusOr<int> layers = RequiredInt(reader, *config, path, "num_hidden_layers");
  if (!layers.ok()) return layers.status();
  spec.num_layers = *layers;
  bool has_heads = false, has_kv_heads = false, has_head_dim = false, has_hidden = false;
  absl::StatusOr<int> heads = PositiveInt(reader, *config, path, "num_attention_heads", &has_heads);
  absl::StatusOr<int> kv_heads =
      PositiveInt(reader, *config, path, "num_key_value_heads", &has_kv_heads);
  absl::StatusOr<int> head_dim = PositiveInt(reader, *config, path, "head_dim", &has_head_dim);
  absl::StatusOr<int> hidden = PositiveInt(reader, *config, path, "hidden_size", &has_hidden);
  for (const auto* status : {&heads, &kv_heads, &head_dim, &hidden}) {
    if (!status->ok()) return status->status();
  }
  if (has_kv_heads) {
    spec.num_kv_heads = *kv_heads;
  } else if (has_heads) {
    spec.num_kv_heads = *heads;
  } else {
    return reader.Error(absl::StrCat(strict::MissingKeyMessage(Path(path, "num_key_value_heads")),
                                     " (and no '", Path(path, "num_attention_heads"),
                                     "' to fall back on)"));
  }
  if (has_head_dim) {
    spec.head_dim = *head_dim;
  } else if (has_hidden && has_heads) {
    if (*hidden % *heads != 0) {
      return reader.Error(absl::StrCat(Path(path, "hidden_size"), " ", *hidden,
                                       " is not a multiple of num_attention_heads ", *heads,
                                       "; give head_dim"));
    }
    spec.head_dim = *hidden / *heads;
  } else {
    return reader.Error(absl::StrCat(strict::MissingKeyMessage(Path(path, "head_dim")),
                                     " (and no '", Path(path, "hidden_size"), "' / '",
                                     Path(path, "num_attention_heads"), "' to derive it)"));
  }
  // transformers 5 moves theta and the scaling rule into one rope_parameters map.
  const json* rope_map = nullptr;
  bool from_parameters = false;
  std::string rope_path = Path(path, "rope_scaling");
  auto parameters = config->find("rope_parameters");
  if (parameters != config->end() && parameters->is_object()) {
    rope_map = &*parameters;
    from_parameters = true;
    rope_path = Path(path, "rope_parameters");
  } else {
    auto scaling = config->find("rope_scaling");
    if (scaling != config->end()) rope_map = &*scaling;
  }
  const bool theta_in_rope_map =
      rope_map != nullptr && rope_map->is_object() && rope_map->contains("rope_theta");
  absl::StatusOr<double> theta = theta_in_rope_map
                                     ? Number(reader, *rope_map, rope_path, "rope_theta", 10000.0)
                                     : Number(reader, *config, path, "rope_theta", 10000.0);
  if (!theta.ok()) return theta.status();
  spec.rope.theta = *theta;
  absl::StatusOr<double> partial = Number(reader, *config, path, "partial_rotary_factor", 1.0);
  if (!partial.ok()) return partial.status();
  if (*partial <= 0 || *partial > 1) {
    return reader.Error(absl::StrCat("key '", Path(path, "partial_rotary_factor"),
                                     "' must be in (0, 1], got ", *partial));
  }
  // HF: int(head_dim * partial_rotary_factor); RoPE pairs dimensions, so it must be even.
  spec.rope.rotary_dim = static_cast<int>(spec.head_dim * *partial + 1e-9);
  if (spec.rope.rotary_dim % 2 != 0 || spec.rope.rotary_dim == 0) {
    return reader.Error(absl::StrCat(
        Path(path, "partial_rotary_factor"), " ", *partial, " x head_dim ", spec.head_dim,
        " gives rotary_dim ", spec.rope.rotary_dim, ", which is not a positive even number"));
  }
  spec.rope.style = RopeStyle::kNeox;
  if (rope_map != nullptr) {
    json scaling = *rope_map;
    if (from_parameters) scaling.erase("rope_theta");
    absl::StatusOr<RopeScaling> parsed = ParseScaling(reader, scaling, *config, path, rope_path);
    if (!parsed.ok()) return parsed.status();
    spec.rope.scaling = *parsed;
  }
  absl::Status valid = ValidateRopeConfig(spec.rope, spec.head_dim);
  if (!valid.ok()) return reader.Error(valid.message());
  return spec;
}

absl::StatusOr<ModelSpec> ReadHfConfig(const std::string& path, const std::string& name) {
  const std::string file = IsDirectory(path) ? JoinPath(path, "config.json") : path;
  absl::StatusOr<std::string> text = ReadFileToString(file);
  if (!text.ok()) return text.status();
  return ParseHfConfig(*text, file, name);
}

}  // namespace kvt
