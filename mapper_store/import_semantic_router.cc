#include "mapper_store/import_semantic_router.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "common/strict_reader.h"
#include "kernels/dtype.h"
#include "mapper_store/hf_config.h"
#include "mapper_store/mapper.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"
#include "yaml-cpp/yaml.h"

namespace kvt {
namespace {

using nlohmann::json;

using strict::JsonReader;

std::string Dump(const json& value) { return JsonReader::Dump(value); }

// artifact.py's normalize_precision.
absl::StatusOr<std::string> NormalizePrecision(const std::string& precision) {
  static const auto* aliases = new std::map<std::string, std::string>{
      {"fp16", "fp16"},     {"float16", "fp16"}, {"half", "fp16"},   {"bf16", "bf16"},
      {"bfloat16", "bf16"}, {"fp32", "fp32"},    {"float32", "fp32"}};
  auto it = aliases->find(absl::AsciiStrToLower(absl::StripAsciiWhitespace(precision)));
  if (it == aliases->end()) {
    return absl::InvalidArgumentError(absl::StrCat("compatibility.precision '", precision,
                                                   "' is not supported (fp16, bf16, fp32)"));
  }
  return it->second;
}

// One channel of source_layers_per_target: {"0": [j, ...], "1": [...], ...} -> per target layer.
absl::StatusOr<std::vector<std::vector<int>>> ParseSelection(const JsonReader& reader,
                                                             const json& selection,
                                                             const std::string& path, int topk) {
  if (!selection.is_object() || selection.empty()) {
    return reader.Error(absl::StrCat(path,
                                     " must be a non-empty object {\"<target layer>\": "
                                     "[source layers]}, got ",
                                     Dump(selection)));
  }
  std::map<int, std::vector<int>> by_layer;
  for (auto it = selection.begin(); it != selection.end(); ++it) {
    const std::string field = absl::StrCat(path, "[\"", it.key(), "\"]");
    int layer = -1;
    // Keys are str(int): canonical decimal, so "01" or " 1" is a writer bug, not a layer.
    if (!absl::SimpleAtoi(it.key(), &layer) || layer < 0 || absl::StrCat(layer) != it.key()) {
      return reader.Error(absl::StrCat(path, " has key '", it.key(),
                                       "', which is not a target layer index (0, 1, ...)"));
    }
    if (!it.value().is_array() || it.value().empty()) {
      return reader.Error(absl::StrCat(field, " must be a non-empty list of source layers, got ",
                                       Dump(it.value())));
    }
    std::vector<int> sources;
    std::set<int> seen;
    for (size_t i = 0; i < it.value().size(); ++i) {
      absl::StatusOr<int> source =
          reader.Int(it.value()[i], absl::StrCat(field, "[", i, "]"), /*min=*/0);
      if (!source.ok()) return source.status();
      if (!seen.insert(*source).second) {
        return reader.Error(absl::StrCat(field, " repeats source layer ", *source));
      }
      sources.push_back(*source);
    }
    if (static_cast<int>(sources.size()) != topk) {
      return reader.Error(
          absl::StrCat(field, " has ", sources.size(), " source layers but topk is ", topk));
    }
    by_layer[layer] = std::move(sources);
  }
  std::vector<std::vector<int>> out;
  for (const auto& [layer, sources] : by_layer) {
    if (layer != static_cast<int>(out.size())) {
      return reader.Error(absl::StrCat(path, " has no entry for target layer ", out.size(),
                                       " (target layers must be 0..L-1, all present)"));
    }
    out.push_back(sources);
  }
  return out;
}

// JSON -> YAML node, for the free-form calibration map of the kvt manifest.
absl::StatusOr<YAML::Node> JsonToYaml(const json& value, int depth) {
  if (depth > 64) return absl::InvalidArgumentError("calibration is nested too deeply");
  switch (value.type()) {
    case json::value_t::object: {
      YAML::Node node(YAML::NodeType::Map);
      for (auto it = value.begin(); it != value.end(); ++it) {
        absl::StatusOr<YAML::Node> child = JsonToYaml(it.value(), depth + 1);
        if (!child.ok()) return child.status();
        node[it.key()] = *child;
      }
      return node;
    }
    case json::value_t::array: {
      YAML::Node node(YAML::NodeType::Sequence);
      for (const json& item : value) {
        absl::StatusOr<YAML::Node> child = JsonToYaml(item, depth + 1);
        if (!child.ok()) return child.status();
        node.push_back(*child);
      }
      return node;
    }
    case json::value_t::string:
      return YAML::Node(value.get<std::string>());
    case json::value_t::boolean:
      return YAML::Node(value.get<bool>());
    case json::value_t::number_integer:
      return YAML::Node(value.get<int64_t>());
    case json::value_t::number_unsigned:
      return YAML::Node(value.get<uint64_t>());
    case json::value_t::number_float:
      return YAML::Node(value.get<double>());
    default:
      return YAML::Node(YAML::NodeType::Null);
  }
}

absl::StatusOr<SemanticRouterManifest> ParseManifestJson(absl::string_view json_text,
                                                         absl::string_view label) {
  const JsonReader reader(label);
  absl::StatusOr<json> parsed_root = reader.Parse(json_text);
  if (!parsed_root.ok()) return parsed_root.status();
  const json& root = *parsed_root;
  SemanticRouterManifest m;

  // Checked first, so a newer schema gets one clear message rather than complaints about fields.
  auto schema = root.find("schema_version");
  if (schema != root.end()) {
    absl::StatusOr<int> version = reader.Int(*schema, "schema_version", 0);
    if (!version.ok()) return version.status();
    if (*version != 1) {
      return reader.Error(absl::StrCat("schema_version ", *version,
                                       " is not supported (this importer reads version 1)"));
    }
  }
  absl::StatusOr<std::string> mapper_id = reader.String(root, "", "mapper_id");
  if (!mapper_id.ok()) return mapper_id.status();
  m.mapper_id = *mapper_id;

  absl::StatusOr<const json*> compat = reader.Required(root, "", "compatibility");
  if (!compat.ok()) return compat.status();
  const json& c = **compat;
  // CompatibilitySpec(**data) refuses unknown fields; so does this.
  if (absl::Status status = reader.CheckObject(
          c, "compatibility",
          {"source_model", "source_revision", "target_model", "target_revision", "variant",
           "precision", "source_tp", "target_tp", "head_order", "num_kv_heads", "head_dim"});
      !status.ok()) {
    return status;
  }
  for (auto [key, field] : {std::pair<const char*, std::string*>{"source_model", &m.source_model},
                            {"source_revision", &m.source_revision},
                            {"target_model", &m.target_model},
                            {"target_revision", &m.target_revision},
                            {"head_order", &m.head_order}}) {
    absl::StatusOr<std::string> value = reader.String(c, "compatibility", key);
    if (!value.ok()) return value.status();
    *field = *value;
  }
  absl::StatusOr<std::string> variant = reader.String(c, "compatibility", "variant");
  if (!variant.ok()) return variant.status();
  if (*variant == "full_head") {
    m.variant = SemanticRouterVariant::kFullHead;
  } else if (*variant == "per_head") {
    m.variant = SemanticRouterVariant::kPerHead;
  } else {
    return reader.Error(absl::StrCat("compatibility.variant '", *variant,
                                     "' is not supported (full_head, per_head)"));
  }
  absl::StatusOr<std::string> precision = reader.String(c, "compatibility", "precision");
  if (!precision.ok()) return precision.status();
  absl::StatusOr<std::string> normalized = NormalizePrecision(*precision);
  if (!normalized.ok()) return reader.Error(normalized.status().message());
  m.precision = *normalized;
  for (auto [key, field] : {std::pair<const char*, int*>{"source_tp", &m.source_tp},
                            {"target_tp", &m.target_tp},
                            {"num_kv_heads", &m.num_kv_heads},
                            {"head_dim", &m.head_dim}}) {
    absl::StatusOr<int> value = reader.Int(c, "compatibility", key, 1);
    if (!value.ok()) return value.status();
    *field = *value;
  }

  absl::StatusOr<int> topk = reader.Int(root, "", "topk", 1);
  if (!topk.ok()) return topk.status();
  m.topk = *topk;
  absl::StatusOr<double> alpha = reader.Number(root, "", "ridge_alpha");
  if (!alpha.ok()) return alpha.status();
  if (!(*alpha >= 0) || !std::isfinite(*alpha)) {
    return reader.Error(absl::StrCat("ridge_alpha must be a finite number >= 0, got ", *alpha));
  }
  m.ridge_alpha = *alpha;
  absl::StatusOr<bool> centered = reader.Bool(root, "", "centered_inputs");
  if (!centered.ok()) return centered.status();
  m.centered_inputs = *centered;
  absl::StatusOr<bool> stripped = reader.Bool(root, "", "rope_stripped_on_keys");
  if (!stripped.ok()) return stripped.status();
  m.rope_stripped_on_keys = *stripped;

  absl::StatusOr<const json*> selections = reader.Required(root, "", "source_layers_per_target");
  if (!selections.ok()) return selections.status();
  const json& s = **selections;
  if (absl::Status status = reader.CheckObject(s, "source_layers_per_target", {"k", "v"});
      !status.ok()) {
    return status;
  }
  for (auto [key, field] :
       {std::pair<const char*, std::vector<std::vector<int>>*>{"k", &m.sources_k},
        {"v", &m.sources_v}}) {
    const std::string path = absl::StrCat("source_layers_per_target.", key);
    absl::StatusOr<const json*> channel = reader.Required(s, "source_layers_per_target", key);
    if (!channel.ok()) return channel.status();
    absl::StatusOr<std::vector<std::vector<int>>> parsed =
        ParseSelection(reader, **channel, path, m.topk);
    if (!parsed.ok()) return parsed.status();
    *field = *std::move(parsed);
  }
  if (m.sources_k.size() != m.sources_v.size()) {
    return reader.Error(absl::StrCat("source_layers_per_target.k has ", m.sources_k.size(),
                                     " target layers but source_layers_per_target.v has ",
                                     m.sources_v.size()));
  }

  auto calibration = root.find("calibration");
  if (calibration == root.end() || calibration->is_null()) {
    m.calibration_json = "{}";
  } else if (!calibration->is_object()) {
    return reader.Error(absl::StrCat("calibration must be an object, got ", Dump(*calibration)));
  } else {
    m.calibration_json = Dump(*calibration);
  }
  auto report = root.find("evaluation_report");
  if (report != root.end() && !report->is_null()) {
    if (!report->is_string()) {
      return reader.Error(
          absl::StrCat("evaluation_report must be a string or null, got ", Dump(*report)));
    }
    m.evaluation_report = report->get<std::string>();
  }
  return m;
}

absl::Status ChecksumMismatch(const std::string& file, const std::string& expected,
                              const std::string& actual) {
  return absl::DataLossError(absl::StrCat("checksum mismatch for ", file, ": SHA256SUMS says ",
                                          expected, " but the file hashes to ", actual,
                                          " (corrupt or partially copied)"));
}

// A model from its config.json, or from `spec` with the manifest filling the KV shape.
absl::StatusOr<ModelSpec> ResolveModel(const char* role, const std::string& config_path,
                                       const ModelSpec& spec, const std::string& name,
                                       const SemanticRouterManifest& m, int default_layers) {
  ModelSpec model;
  if (!config_path.empty()) {
    absl::StatusOr<ModelSpec> read = ReadHfConfig(config_path, name);
    if (!read.ok()) return read.status();
    model = *std::move(read);
  } else {
    model = spec;
    model.name = name;
    if (model.num_kv_heads == 0) model.num_kv_heads = m.num_kv_heads;
    if (model.head_dim == 0) model.head_dim = m.head_dim;
    if (model.num_layers == 0) model.num_layers = default_layers;
    if (model.num_layers <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          role,
          " model: the semantic-router artifact does not store its layer count; give its "
          "config.json or the number of layers"));
    }
    if (model.rope.rotary_dim == 0) model.rope.rotary_dim = model.head_dim;
    if (absl::Status s = ValidateRopeConfig(model.rope, model.head_dim); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(role, " model RoPE: ", s.message()));
    }
  }
  const std::string where = config_path.empty() ? absl::StrCat(role, " model")
                                                : absl::StrCat(role, " model (", config_path, ")");
  if (model.num_kv_heads != m.num_kv_heads || model.head_dim != m.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " has ", model.num_kv_heads, " KV heads x head_dim ", model.head_dim,
        " but manifest.json has compatibility.num_kv_heads ", m.num_kv_heads, " and head_dim ",
        m.head_dim, " (the semantic-router format has one KV shape for both models)"));
  }
  return model;
}

std::string TensorName(int layer, char kv, bool bias) {
  return absl::StrCat("target.", layer, ".", std::string(1, kv), bias ? ".b" : ".W");
}

// Reads float32 element `index` of a tensor whose bytes need not be 4-byte aligned.
float LoadF32(const uint8_t* data, int64_t index) {
  float value;
  std::memcpy(&value, data + index * sizeof(float), sizeof(float));
  return value;
}

// One kvt weight or bias and where it comes from.
struct Source {
  const TensorInfo* info = nullptr;
  bool compact_per_head = false;  // W stored as [n, k d, d], kvt's head-local layout already
};

// A kvt head-local W [n, k d, d] from a per_head W: head h's row b d + i is source head
// HeadLocalSources(h) (= h: both models have n heads) of block b, dim i; from the compact
// [n, k d, d] as it is, or from the dense block matrix's row (b n + h) d + i, columns
// [h d, (h + 1) d) (the only non-zero block, checked in step 6).
absl::Status FillPerHead(const Manifest& out, const TensorSpec& spec, const Source& src,
                         const uint8_t* data, absl::Span<uint8_t> dst) {
  const int64_t n = spec.shape[0], rows = spec.shape[1], d = spec.shape[2];
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(spec.dtype);
  std::vector<float> row(d);
  for (int64_t h = 0; h < n; ++h) {
    const int64_t s = HeadLocalSources(out.source, out.target, static_cast<int>(h)).first;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / d, i = r % d;
      const int64_t first = src.compact_per_head ? (h * rows + r) * d
                                                 : ((b * n + s) * d + i) * (n * d) + h * d;
      for (int64_t o = 0; o < d; ++o) row[o] = LoadF32(data, first + o);
      FromFloat(spec.dtype, row.data(), dst.data() + (h * rows + r) * row_bytes, d);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SemanticRouterManifest> ParseSemanticRouterManifest(absl::string_view json_text,
                                                                   absl::string_view label) {
  // parse(..., allow_exceptions = false) does not throw, nor do the typed accessors after their
  // type checks; this is a second line for what nlohmann may still throw (e.g. bad_alloc).
  try {
    return ParseManifestJson(json_text, label);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": ", e.what()));
  }
}

absl::StatusOr<SemanticRouterImportResult> ImportSemanticRouterMapper(
    const std::string& in_dir_arg, const std::string& out_dir,
    const SemanticRouterImportOptions& options) {
  std::string in_dir = in_dir_arg;
  while (in_dir.size() > 1 && in_dir.back() == '/') in_dir.pop_back();
  if (!IsDirectory(in_dir)) {
    return absl::NotFoundError(
        absl::StrCat(in_dir, ": not a semantic-router mapper directory (does not exist)"));
  }
  const std::string sums_path = JoinPath(in_dir, kChecksumFileName);
  const std::string manifest_path = JoinPath(in_dir, kSemanticRouterManifestFile);
  const std::string weights_path = JoinPath(in_dir, kSemanticRouterWeightsFile);

  // 1. SHA256SUMS: the artifact's own integrity check (artifact.py verify_checksums).
  absl::StatusOr<std::string> sums_text = ReadFileToString(sums_path);
  if (!sums_text.ok()) {
    if (absl::IsNotFound(sums_text.status())) {
      return absl::NotFoundError(absl::StrCat(in_dir, ": missing ", kChecksumFileName));
    }
    return sums_text.status();
  }
  absl::StatusOr<std::vector<ChecksumEntry>> entries = ParseSha256Sums(*sums_text);
  if (!entries.ok()) {
    return absl::Status(entries.status().code(),
                        absl::StrCat(sums_path, ": ", entries.status().message()));
  }
  std::map<std::string, std::string> sums;
  for (const ChecksumEntry& entry : *entries) sums[entry.filename] = entry.hex;
  for (const char* required : {kSemanticRouterManifestFile, kSemanticRouterWeightsFile}) {
    if (sums.count(required) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(sums_path, " has no entry for ", required));
    }
  }

  // 2. manifest.json, verified before it is parsed.
  absl::StatusOr<std::string> manifest_text = ReadFileToString(manifest_path);
  if (!manifest_text.ok()) {
    if (absl::IsNotFound(manifest_text.status())) {
      return absl::NotFoundError(absl::StrCat(in_dir, ": missing ", kSemanticRouterManifestFile));
    }
    return manifest_text.status();
  }
  absl::StatusOr<std::string> manifest_sum = Sha256Hex(*manifest_text);
  if (!manifest_sum.ok()) return manifest_sum.status();
  if (*manifest_sum != sums[kSemanticRouterManifestFile]) {
    return ChecksumMismatch(manifest_path, sums[kSemanticRouterManifestFile], *manifest_sum);
  }
  absl::StatusOr<SemanticRouterManifest> parsed =
      ParseSemanticRouterManifest(*manifest_text, manifest_path);
  if (!parsed.ok()) return parsed.status();
  const SemanticRouterManifest& m = *parsed;
  if (!m.rope_stripped_on_keys) {
    return absl::UnimplementedError(absl::StrCat(
        manifest_path,
        ": rope_stripped_on_keys is false: the keys were fitted with RoPE applied, but kvt maps "
        "keys in content space (source RoPE stripped, target RoPE re-applied, SPEC 3)"));
  }
  if (m.head_order != "contiguous") {
    return absl::UnimplementedError(
        absl::StrCat(manifest_path, ": compatibility.head_order '", m.head_order,
                     "' is not supported (kvt rows and columns are head-major: 'contiguous')"));
  }
  const int num_target_layers = static_cast<int>(m.sources_k.size());

  // 3. The two models.
  absl::StatusOr<ModelSpec> source =
      ResolveModel("source", options.source_config, options.source_spec,
                   options.source_name.empty() ? m.source_model : options.source_name, m, 0);
  if (!source.ok()) return source.status();
  absl::StatusOr<ModelSpec> target = ResolveModel(
      "target", options.target_config, options.target_spec,
      options.target_name.empty() ? m.target_model : options.target_name, m, num_target_layers);
  if (!target.ok()) return target.status();
  if (target->num_layers != num_target_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        manifest_path, ": source_layers_per_target has ", num_target_layers,
        " target layers but the target model ", target->name, " has ", target->num_layers,
        " (a semantic-router mapper covers every target layer, in order)"));
  }
  for (auto [kv, lists] : {std::pair<char, const std::vector<std::vector<int>>*>{'k', &m.sources_k},
                           {'v', &m.sources_v}}) {
    for (int l = 0; l < num_target_layers; ++l) {
      for (size_t i = 0; i < (*lists)[l].size(); ++i) {
        if ((*lists)[l][i] >= source->num_layers) {
          return absl::InvalidArgumentError(absl::StrCat(
              manifest_path, ": source_layers_per_target.", std::string(1, kv), "[\"", l, "\"][", i,
              "] = ", (*lists)[l][i], " is out of range: the source model ", source->name, " has ",
              source->num_layers, " layers"));
        }
      }
    }
  }

  // 4. The weights, hashed while they are read.
  SafetensorsReadOptions read_options;
  read_options.compute_sha256 = true;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> weights =
      SafetensorsFile::Open(weights_path, read_options);
  const std::string& expected_weights = sums[kSemanticRouterWeightsFile];
  if (!weights.ok()) {
    // A damaged file usually fails its checksum too; that is the actionable cause.
    if (PathExists(weights_path)) {
      absl::StatusOr<std::string> actual = Sha256OfFile(weights_path);
      if (actual.ok() && *actual != expected_weights) {
        return absl::DataLossError(
            absl::StrCat(ChecksumMismatch(weights_path, expected_weights, *actual).message(), "; ",
                         weights.status().message()));
      }
    }
    return weights.status();
  }
  if ((*weights)->sha256_hex() != expected_weights) {
    return ChecksumMismatch(weights_path, expected_weights, (*weights)->sha256_hex());
  }
  // sha256sum -c semantics: anything else listed must be intact too.
  for (const auto& [file, hex] : sums) {
    if (file == kSemanticRouterManifestFile || file == kSemanticRouterWeightsFile) continue;
    absl::StatusOr<std::string> actual = Sha256OfFile(JoinPath(in_dir, file));
    if (!actual.ok()) return actual.status();
    if (*actual != hex) return ChecksumMismatch(JoinPath(in_dir, file), hex, *actual);
  }
  const SafetensorsFile& file = **weights;

  // 5. Tensor names, dtypes and shapes.
  const int64_t n = m.num_kv_heads, d = m.head_dim, width = n * d;
  const bool per_head = m.variant == SemanticRouterVariant::kPerHead;
  auto tensor_error = [&](absl::string_view message) {
    return absl::InvalidArgumentError(absl::StrCat(weights_path, ": ", message));
  };
  std::set<std::string> expected_names;
  std::map<std::string, Source> sources;
  for (int l = 0; l < num_target_layers; ++l) {
    for (char kv : {'k', 'v'}) {
      const int64_t k = static_cast<int64_t>((kv == 'k' ? m.sources_k : m.sources_v)[l].size());
      for (bool bias : {false, true}) {
        const std::string name = TensorName(l, kv, bias);
        expected_names.insert(name);
        const TensorInfo* info = file.Find(name);
        if (info == nullptr) {
          return tensor_error(absl::StrCat(
              "missing tensor '", name, "' (a semantic-router mapper with ", num_target_layers,
              " target layers holds target.{L}.{k,v}.{W,b} for every L in [0, ", num_target_layers,
              "))"));
        }
        if (info->spec.dtype != DType::kFP32) {
          return tensor_error(absl::StrCat("tensor '", name, "' has dtype ",
                                           SafetensorsDTypeName(info->spec.dtype),
                                           " but semantic-router mappers store F32"));
        }
        const std::vector<int64_t> dense =
            bias ? std::vector<int64_t>{width} : std::vector<int64_t>{k * width, width};
        const std::vector<int64_t> compact = {n, k * d, d};
        Source src{info, false};
        if (info->spec.shape == dense) {
          sources[name] = src;
          continue;
        }
        if (!bias && per_head && info->spec.shape == compact) {
          src.compact_per_head = true;
          sources[name] = src;
          continue;
        }
        std::string required = FormatShape(dense);
        if (!bias && per_head) absl::StrAppend(&required, " or, per head, ", FormatShape(compact));
        return tensor_error(absl::StrCat("tensor '", name, "' has shape ",
                                         FormatShape(info->spec.shape),
                                         " but the manifest requires ", required, " (", k,
                                         " source layers x ", n, " KV heads x head_dim ", d, ")"));
      }
    }
  }
  for (const TensorInfo& info : file.tensors()) {
    if (expected_names.count(info.spec.name) == 0) {
      return tensor_error(absl::StrCat(
          "unexpected tensor '", info.spec.name, "' (a semantic-router mapper with ",
          num_target_layers, " target layers holds only target.{L}.{k,v}.{W,b}, L in [0, ",
          num_target_layers, "))"));
    }
  }

  // 6. Values: finite everywhere (artifact.py's validate_artifact), and a dense per_head matrix
  // must not feed target head h from any source head but h, or the import would silently change
  // the map.
  for (const auto& [name, src] : sources) {
    const uint8_t* data = file.data(*src.info).data();
    const std::vector<int64_t>& shape = src.info->spec.shape;
    const int64_t count = src.info->spec.num_elements();
    const bool check_blocks = per_head && !src.compact_per_head && shape.size() == 2;
    for (int64_t i = 0; i < count; ++i) {
      const float value = LoadF32(data, i);
      if (!std::isfinite(value)) {
        return tensor_error(absl::StrCat("tensor '", name, "' holds a non-finite value (", value,
                                         ") at element ", i));
      }
      if (check_blocks && value != 0) {
        const int64_t row = i / width, col = i % width;
        const int64_t source_head = (row / d) % n, target_head = col / d;
        if (source_head != target_head) {
          return tensor_error(absl::StrCat(
              "tensor '", name, "' is not per_head (compatibility.variant): element [", row, ", ",
              col, "] = ", value, " feeds target head ", target_head, " from source head ",
              source_head, "; per_head maps each target head from the same source head only"));
        }
      }
    }
  }

  // 7. The kvt manifest. Rows and columns already follow kvt's convention (x W + b; row block b
  // is the b-th listed source layer, head-major inside; column block h is target head h), so
  // full_head weights are copied as they are. per_head maps target head h from source head h of
  // each selected layer only: kvt's head-local ridge (n_s = n_t, one source head per target
  // head), kept compact [n, k d, d] rather than expanded into an n times larger dense matrix.
  Manifest out;
  out.kind = MapperKind::kRidge;
  out.ridge_granularity = per_head ? RidgeGranularity::kPerHead : RidgeGranularity::kPerLayer;
  out.synthetic = false;
  out.source = *source;
  out.target = *target;
  out.k = m.topk;
  out.lambda = m.ridge_alpha;
  out.lambda_scale = LambdaScale::kSum;  // ridge.py adds alpha * I to the centred sum X^T X
  out.weights_dtype = options.weights_dtype;
  for (int l = 0; l < num_target_layers; ++l) {
    LayerEntry layer;
    layer.target_layer = l;
    layer.sigma_k = m.sources_k[l];
    layer.sigma_v = m.sources_v[l];
    out.layers.push_back(std::move(layer));
  }
  YAML::Node provenance(YAML::NodeType::Map);
  provenance["mapper_id"] = m.mapper_id;
  provenance["variant"] = per_head ? "per_head" : "full_head";
  provenance["source_model"] = m.source_model;
  provenance["source_revision"] = m.source_revision;
  provenance["target_model"] = m.target_model;
  provenance["target_revision"] = m.target_revision;
  provenance["precision"] = m.precision;
  provenance["source_tp"] = m.source_tp;
  provenance["target_tp"] = m.target_tp;
  provenance["head_order"] = m.head_order;
  provenance["ridge_alpha"] = m.ridge_alpha;
  provenance["centered_inputs"] = m.centered_inputs;
  provenance["schema_version"] = m.schema_version;
  if (!m.evaluation_report.empty()) provenance["evaluation_report"] = m.evaluation_report;
  const json calibration = json::parse(m.calibration_json, nullptr, /*allow_exceptions=*/false);
  absl::StatusOr<YAML::Node> calibration_yaml = JsonToYaml(calibration, 0);
  if (!calibration_yaml.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(manifest_path, ": ", calibration_yaml.status().message()));
  }
  provenance["calibration"] = *calibration_yaml;
  YAML::Node calibration_map(YAML::NodeType::Map);
  calibration_map["imported_from"] = "semantic-router kv_mapper";
  calibration_map["semantic_router"] = provenance;
  out.calibration_yaml = YAML::Dump(calibration_map);
  out.created_by = "kvt import --format=semantic-router";

  // 8. Write, one tensor at a time, converting to the requested dtype row by row.
  const std::vector<TensorSpec> specs = MapperTensorSpecs(out);
  auto fill = [&](size_t index, absl::Span<uint8_t> dst) -> absl::Status {
    const TensorSpec& spec = specs[index];
    // "layers.{l}.{k|v}.{weight|bias}" -> "target.{l}.{k|v}.{W|b}".
    const int l = static_cast<int>(index / 4);
    const char kv = (index % 4) < 2 ? 'k' : 'v';
    const bool bias = index % 2 == 1;
    const Source& src = sources.at(TensorName(l, kv, bias));
    const uint8_t* data = file.data(*src.info).data();
    if (per_head && !bias) return FillPerHead(out, spec, src, data, dst);
    // A per_head bias [n, d] holds the same floats as the dense [n d], row after row.
    const int64_t rows = spec.shape.size() == 2 ? spec.shape[0] : 1;
    const int64_t cols = spec.shape.back();
    const size_t out_row_bytes = static_cast<size_t>(cols) * DTypeSize(spec.dtype);
    std::vector<float> row(cols);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(row.data(), data + r * cols * sizeof(float), cols * sizeof(float));
      FromFloat(spec.dtype, row.data(), dst.data() + r * out_row_bytes, cols);
    }
    return absl::OkStatus();
  };
  WriteOptions write_options;
  write_options.overwrite = options.overwrite;
  if (absl::Status s = WriteMapperDir(out_dir, out, specs, fill, write_options); !s.ok()) {
    return s;
  }
  SemanticRouterImportResult result;
  result.original = *std::move(parsed);
  result.manifest = std::move(out);
  return result;
}

}  // namespace kvt
