#include "mapper_store/format/manifest.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <initializer_list>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/strict_reader.h"
#include "kernels/rope.h"
#include "yaml-cpp/yaml.h"

namespace kvt {
namespace {

// 1-based source lines of the nodes validation may complain about; 0 = unknown (struct built in
// code). Lets one validation routine serve parsed and hand-built manifests alike.
struct ManifestLines {
  int root = 0, kind = 0, mlp = 0, ridge = 0, source = 0, target = 0, source_rope = 0, target_rope = 0, k = 0,
      window = 0, lambda = 0, weights = 0, layers = 0, quality = 0;
  std::vector<int> layer, sigma_k, sigma_v, benefit;
};

int LineAt(const std::vector<int>& lines, size_t i) { return i < lines.size() ? lines[i] : 0; }

// Errors "<label>:<line>: ...", shared by the parser and the validation of built manifests.
using ErrorMaker = strict::Errors;
using strict::LineOf;
using strict::Path;

absl::Status ValidateModel(const ModelSpec& model, const char* which, int line, int rope_line,
                           const ErrorMaker& error) {
  if (model.name.empty()) return error(line, absl::StrCat(which, ".name must not be empty"));
  if (model.num_layers < 1) {
    return error(line, absl::StrCat(which, ".num_layers must be >= 1, got ", model.num_layers));
  }
  if (model.num_kv_heads < 1) {
    return error(line,
                 absl::StrCat(which, ".num_kv_heads must be >= 1, got ", model.num_kv_heads));
  }
  if (model.head_dim < 1) {
    return error(line, absl::StrCat(which, ".head_dim must be >= 1, got ", model.head_dim));
  }
  absl::Status rope = ValidateRopeConfig(model.rope, model.head_dim);
  if (!rope.ok()) return error(rope_line, absl::StrCat(which, ".rope: ", rope.message()));
  return absl::OkStatus();
}

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

absl::Status ValidateSigma(const std::vector<int>& sigma, const char* field, size_t layer,
                           const Manifest& m, int line, const ErrorMaker& error) {
  if (sigma.empty()) {
    return error(line, absl::StrCat("layers[", layer, "].", field,
                                    " is empty (target layer ", layer, " needs a source layer)"));
  }
  if (static_cast<int>(sigma.size()) > m.k) {
    return error(line, absl::StrCat("layers[", layer, "].", field, " has ", sigma.size(),
                                    " entries but k is ", m.k, " (target layer ", layer, ")"));
  }
  std::set<int> seen;
  for (size_t i = 0; i < sigma.size(); ++i) {
    const int j = sigma[i];
    if (j < 0 || j >= m.source.num_layers) {
      return error(line, absl::StrCat("layers[", layer, "].", field, "[", i, "] = ", j,
                                      " is out of range: source.num_layers is ",
                                      m.source.num_layers, " (target layer ", layer, ")"));
    }
    if (!seen.insert(j).second) {
      return error(line, absl::StrCat("layers[", layer, "].", field, " lists source layer ", j,
                                      " twice (target layer ", layer, ")"));
    }
  }
  return absl::OkStatus();
}

// A cosine: finite and in [-1, 1] (a little slack for rounding in the writer's arithmetic).
absl::Status ValidateCosine(const std::optional<double>& value, const std::string& name, int line,
                            const ErrorMaker& error) {
  if (value.has_value() && !(std::isfinite(*value) && std::fabs(*value) <= 1.0 + 1e-9)) {
    return error(line, absl::StrCat(name, " = ", FormatDouble(*value),
                                    " is not a valid cosine (finite, in [-1, 1])"));
  }
  return absl::OkStatus();
}

bool IsBenefitTextName(const std::string& text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

// What is wrong with one quality.benefit entry (fields named under `path`), or "".
std::string BenefitRecordProblem(const BenefitRecord& r, absl::string_view path) {
  const auto field = [&](const char* key) { return Path(path, key); };
  if (!IsBenefitTextName(r.text)) {
    return absl::StrCat(field("text"), " '", r.text,
                        "' must be a non-empty name of letters, digits, '.', '_' and '-'");
  }
  for (const auto& [key, value, min] :
       {std::tuple<const char*, int64_t, int64_t>{"windows", r.windows, 2},
        {"context_tokens", r.context_tokens, 1},
        {"continuation_tokens", r.continuation_tokens, 1}}) {
    if (value < min) return absl::StrCat(field(key), " = ", value, " must be >= ", min);
  }
  for (const auto& [key, value] : {std::pair<const char*, double>{"recovered", r.recovered},
                                   {"lower95", r.lower95},
                                   {"upper95", r.upper95},
                                   {"kl", r.kl}}) {
    if (!std::isfinite(value)) {
      return absl::StrCat(field(key), " = ", FormatDouble(value), " is not finite");
    }
  }
  // The interval must hold its own estimate.
  if (r.lower95 > r.recovered) {
    return absl::StrCat(field("lower95"), " = ", FormatDouble(r.lower95), " exceeds recovered ",
                        FormatDouble(r.recovered));
  }
  if (r.upper95 < r.recovered) {
    return absl::StrCat(field("upper95"), " = ", FormatDouble(r.upper95), " is below recovered ",
                        FormatDouble(r.recovered));
  }
  if (r.kl < 0) return absl::StrCat(field("kl"), " = ", FormatDouble(r.kl), " must be >= 0");
  return "";
}

// Every entry valid and each text named once: the gate holds each text's bound to the floor.
absl::Status ValidateBenefit(const std::vector<BenefitRecord>& benefit, const ManifestLines& lines,
                             const ErrorMaker& error) {
  for (size_t i = 0; i < benefit.size(); ++i) {
    const std::string path = absl::StrCat("quality.benefit[", i, "]");
    const int line = LineAt(lines.benefit, i) != 0 ? LineAt(lines.benefit, i) : lines.quality;
    if (std::string problem = BenefitRecordProblem(benefit[i], path); !problem.empty()) {
      return error(line, problem);
    }
    for (size_t j = 0; j < i; ++j) {
      if (benefit[j].text == benefit[i].text) {
        return error(line, absl::StrCat(path, ".text '", benefit[i].text,
                                        "' is already quality.benefit[", j,
                                        "] (one entry per text)"));
      }
    }
  }
  return absl::OkStatus();
}

// Why `calibration_yaml` (free-form YAML text) is unusable, or "" when it reads back as a map.
// The parser dumps the calibration node to text; a key that starts with bytes FE FF (not UTF-8)
// dumps to text that yaml-cpp then reads as UTF-16, so the parser checks its own dump the same way.
std::string CalibrationProblem(const std::string& calibration_yaml) {
  try {
    if (!YAML::Load(calibration_yaml).IsMap()) {
      return "calibration must be a YAML map that reads back as one (UTF-8 text)";
    }
  } catch (const YAML::Exception& e) {
    return absl::StrCat("calibration is not valid YAML: ", e.what());
  }
  return "";
}

absl::Status ValidateImpl(const Manifest& m, const ManifestLines& lines, const ErrorMaker& error) {
  if (m.format_version != kManifestFormatVersion) {
    return error(lines.root, absl::StrCat("unsupported format_version ", m.format_version,
                                          " (this build reads format_version ",
                                          kManifestFormatVersion, ")"));
  }
  if (m.kind == MapperKind::kMlp && !m.mlp.has_value()) {
    return error(lines.kind, "kind: mlp needs the 'mlp' map ({hidden: H, granularity: "
                             "per_layer|per_head})");
  }
  if (m.kind != MapperKind::kMlp && m.mlp.has_value()) {
    return error(lines.mlp, absl::StrCat("key 'mlp' is only valid with kind: mlp, but kind is ",
                                         MapperKindName(m.kind)));
  }
  if (m.mlp.has_value() && m.mlp->hidden < 1) {
    return error(lines.mlp, absl::StrCat("mlp.hidden must be >= 1, got ", m.mlp->hidden));
  }
  if (m.kind != MapperKind::kRidge && m.ridge_granularity != RidgeGranularity::kPerLayer) {
    return error(lines.ridge, absl::StrCat("ridge.granularity ",
                                           RidgeGranularityName(m.ridge_granularity),
                                           " is only valid with kind: ridge, but kind is ",
                                           MapperKindName(m.kind)));
  }
  if (absl::Status s = ValidateModel(m.source, "source", lines.source, lines.source_rope, error);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateModel(m.target, "target", lines.target, lines.target_rope, error);
      !s.ok()) {
    return s;
  }
  if (m.ridge_granularity == RidgeGranularity::kPerHead) {
    if (absl::Status s = CheckHeadLocalHeads(m.source, m.target); !s.ok()) {
      return error(lines.ridge, absl::StrCat("ridge.granularity per_head: ", s.message()));
    }
  }
  if (m.k < 1 || m.k > m.source.num_layers) {
    return error(lines.k, absl::StrCat("k = ", m.k, " must be between 1 and source.num_layers (",
                                       m.source.num_layers, ")"));
  }
  if (m.window < 1 || m.window > kMaxMapperWindow) {
    return error(lines.window, absl::StrCat("window = ", m.window, " must be between 1 and ",
                                            kMaxMapperWindow));
  }
  if (!std::isfinite(m.lambda) || m.lambda < 0) {
    return error(lines.lambda,
                 absl::StrCat("lambda must be a finite number >= 0, got ", FormatDouble(m.lambda)));
  }
  if (!IsPlainFileName(m.weights_file) || m.weights_file == kManifestFileName ||
      m.weights_file == kChecksumFileName) {
    return error(lines.weights, absl::StrCat("weights.file '", m.weights_file,
                                             "' must be a plain file name inside the mapper "
                                             "directory (e.g. weights.safetensors)"));
  }
  if (static_cast<int>(m.layers.size()) != m.target.num_layers) {
    return error(lines.layers, absl::StrCat("layers has ", m.layers.size(),
                                            " entries but target.num_layers is ",
                                            m.target.num_layers, " (one entry per target layer)"));
  }
  size_t longest = 0;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const LayerEntry& entry = m.layers[l];
    const int line = LineAt(lines.layer, l);
    if (entry.target_layer != static_cast<int>(l)) {
      return error(line, absl::StrCat("layers[", l, "].target_layer is ", entry.target_layer,
                                      ", expected ", l, " (entries must list target layers 0..",
                                      m.target.num_layers - 1, " in order)"));
    }
    if (absl::Status s =
            ValidateSigma(entry.sigma_k, "sigma_k", l, m, LineAt(lines.sigma_k, l), error);
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            ValidateSigma(entry.sigma_v, "sigma_v", l, m, LineAt(lines.sigma_v, l), error);
        !s.ok()) {
      return s;
    }
    longest = std::max({longest, entry.sigma_k.size(), entry.sigma_v.size()});
    const std::pair<const char*, const std::optional<double>*> r2s[] = {
        {"r2_k", &entry.r2_k},
        {"r2_v", &entry.r2_v},
        {"r2_k_heldout", &entry.r2_k_heldout},
        {"r2_v_heldout", &entry.r2_v_heldout}};
    for (const auto& [name, value] : r2s) {
      // Held-out R^2 can be negative (worse than the mean); above 1 is impossible.
      if (value->has_value() && (!std::isfinite(**value) || **value > 1.0)) {
        return error(line, absl::StrCat("layers[", l, "].", name, " = ", FormatDouble(**value),
                                        " is not a valid R^2 (finite, <= 1)"));
      }
    }
    if (absl::Status s = ValidateCosine(entry.attention_cosine_heldout,
                                        absl::StrCat("layers[", l, "].attention_cosine_heldout"),
                                        line, error);
        !s.ok()) {
      return s;
    }
  }
  for (const auto& [name, value] :
       {std::pair<const char*, const std::optional<double>*>{
            "quality.attention_cosine_heldout", &m.quality.attention_cosine_heldout},
        {"quality.attention_cosine_heldout_all_layers",
         &m.quality.attention_cosine_heldout_all_layers},
        {"quality.attention_cosine_heldout_lower95",
         &m.quality.attention_cosine_heldout_lower95},
        {"quality.kv_cosine_heldout", &m.quality.kv_cosine_heldout}}) {
    if (absl::Status s = ValidateCosine(*value, name, lines.quality, error); !s.ok()) return s;
  }
  if (m.quality.attention_cosine_heldout_lower95.has_value() &&
      (!m.quality.attention_cosine_heldout.has_value() ||
       *m.quality.attention_cosine_heldout_lower95 > *m.quality.attention_cosine_heldout)) {
    return error(lines.quality,
                 "quality.attention_cosine_heldout_lower95 needs an attention_cosine_heldout "
                 "at least as large");
  }
  for (const auto& [name, value] :
       {std::pair<const char*, const std::optional<int64_t>*>{
            "quality.heldout_sequences", &m.quality.heldout_sequences},
        {"quality.heldout_tokens", &m.quality.heldout_tokens}}) {
    if (value->has_value() && **value < 1) {
      return error(lines.quality, absl::StrCat(name, " = ", **value, " is not positive"));
    }
  }
  if (m.quality.r2_heldout.has_value() &&
      (!std::isfinite(*m.quality.r2_heldout) || *m.quality.r2_heldout > 1.0)) {
    return error(lines.quality, absl::StrCat("quality.r2_heldout = ",
                                             FormatDouble(*m.quality.r2_heldout),
                                             " is not a valid R^2 (finite, <= 1)"));
  }
  if (absl::Status s = ValidateBenefit(m.quality.benefit, lines, error); !s.ok()) return s;
  if (static_cast<int>(longest) != m.k) {
    return error(lines.k, absl::StrCat("k = ", m.k, " but the longest sigma list has ", longest,
                                       " entries (k must equal the longest list)"));
  }
  return absl::OkStatus();
}

// ---- Parsing ----

// Key checks, required keys and typed scalars come from the shared strict reader.
class Parser : private strict::YamlReader {
 public:
  explicit Parser(absl::string_view label) : YamlReader(label), error_(label) {}

  absl::StatusOr<Manifest> Parse(absl::string_view text) {
    absl::StatusOr<YAML::Node> root = Load(text);
    if (!root.ok()) return root.status();
    try {
      return ParseRoot(*root);
    } catch (const YAML::Exception& e) {
      // Defensive: every access below is checked, but a yaml-cpp surprise must not escape.
      return error_(e.mark.line >= 0 ? e.mark.line + 1 : 0, absl::StrCat("malformed: ", e.msg));
    }
  }

 private:
  absl::StatusOr<std::vector<int>> IntList(const YAML::Node& node, const std::string& what) {
    return ScalarList<int>(node, what, "a list of source layer indices", "an integer");
  }

  absl::Status ParseRope(const YAML::Node& node, const std::string& where, RopeConfig* rope) {
    if (absl::Status s = CheckMap(node, where, {"theta", "rotary_dim", "style", "scaling"}); !s.ok()) {
      return s;
    }
    if (absl::Status s = RequiredScalar(node, where, "theta", "a number", &rope->theta); !s.ok()) {
      return s;
    }
    if (absl::Status s =
            RequiredScalar(node, where, "rotary_dim", "an integer", &rope->rotary_dim);
        !s.ok()) {
      return s;
    }
    std::string style;
    if (absl::Status s = RequiredScalar(node, where, "style", "a string", &style); !s.ok()) {
      return s;
    }
    absl::StatusOr<RopeStyle> parsed_style = ParseRopeStyle(style);
    if (!parsed_style.ok()) {
      return error_(LineOf(node["style"]),
                    absl::StrCat(where, ".style: ", parsed_style.status().message()));
    }
    rope->style = *parsed_style;
    const YAML::Node scaling = node["scaling"];
    if (!scaling.IsDefined()) return absl::OkStatus();  // absent = type: none
    const std::string swhere = absl::StrCat(where, ".scaling");
    if (absl::Status s = CheckMap(scaling, swhere,
                                  {"type", "factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings", "beta_fast", "beta_slow",
                                   "attention_factor"});
        !s.ok()) {
      return s;
    }
    std::string type;
    if (absl::Status s = RequiredScalar(scaling, swhere, "type", "a string", &type); !s.ok()) {
      return s;
    }
    absl::StatusOr<RopeScalingType> parsed_type = ParseRopeScalingType(type);
    if (!parsed_type.ok()) {
      return error_(LineOf(scaling["type"]),
                    absl::StrCat(swhere, ".type: ", parsed_type.status().message()));
    }
    RopeScaling& s = rope->scaling;
    s.type = *parsed_type;
    const std::pair<const char*, double*> numbers[] = {
        {"factor", &s.factor},
        {"low_freq_factor", &s.low_freq_factor},
        {"high_freq_factor", &s.high_freq_factor},
        {"original_max_position_embeddings", &s.original_max_position_embeddings},
        {"beta_fast", &s.beta_fast},
        {"beta_slow", &s.beta_slow}};
    for (const auto& [key, out] : numbers) {
      if (absl::Status st = OptionalScalar(scaling, swhere, key, "a number", out); !st.ok()) {
        return st;
      }
    }
    if (scaling["attention_factor"].IsDefined()) {
      s.has_attention_factor = true;
      if (absl::Status st =
              OptionalScalar(scaling, swhere, "attention_factor", "a number", &s.attention_factor);
          !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<MlpConfig> ParseMlp(const YAML::Node& node) {
    if (absl::Status s = CheckMap(node, "mlp", {"hidden", "granularity", "activation"}); !s.ok()) {
      return s;
    }
    MlpConfig config;
    if (absl::Status s = RequiredScalar(node, "mlp", "hidden", "an integer", &config.hidden);
        !s.ok()) {
      return s;
    }
    if (config.hidden < 1) {
      return error_(LineOf(node["hidden"]),
                    absl::StrCat("mlp.hidden must be >= 1, got ", config.hidden));
    }
    std::string granularity;
    if (absl::Status s =
            RequiredScalar(node, "mlp", "granularity", "a string", &granularity);
        !s.ok()) {
      return s;
    }
    if (std::optional<MlpGranularity> parsed = ParseMlpGranularity(granularity)) {
      config.granularity = *parsed;
    } else {
      return error_(LineOf(node["granularity"]),
                    absl::StrCat("mlp.granularity '", granularity,
                                 "' must be per_layer or per_head"));
    }
    std::string activation = "relu";
    if (absl::Status s = OptionalScalar(node, "mlp", "activation", "a string", &activation);
        !s.ok()) {
      return s;
    }
    if (activation != "relu") {
      return error_(LineOf(node["activation"]),
                    absl::StrCat("mlp.activation '", activation, "' is not supported (only relu)"));
    }
    return config;
  }

  // The `ridge:` map: {granularity: per_layer|per_head}.
  absl::StatusOr<RidgeGranularity> ParseRidge(const YAML::Node& node) {
    if (absl::Status s = CheckMap(node, "ridge", {"granularity"}); !s.ok()) return s;
    std::string granularity;
    if (absl::Status s = RequiredScalar(node, "ridge", "granularity", "a string", &granularity);
        !s.ok()) {
      return s;
    }
    std::optional<RidgeGranularity> parsed = ParseRidgeGranularity(granularity);
    if (!parsed) {
      return error_(LineOf(node["granularity"]),
                    absl::StrCat("ridge.granularity '", granularity,
                                 "' must be per_layer or per_head"));
    }
    return *parsed;
  }

  absl::Status ParseModel(const YAML::Node& node, const std::string& where, ModelSpec* model,
                          int* rope_line) {
    if (absl::Status s =
            CheckMap(node, where, {"name", "num_layers", "num_kv_heads", "head_dim", "rope"});
        !s.ok()) {
      return s;
    }
    if (absl::Status s = RequiredScalar(node, where, "name", "a string", &model->name); !s.ok()) {
      return s;
    }
    for (const auto& [key, out] : {std::pair<const char*, int*>{"num_layers", &model->num_layers},
                                   {"num_kv_heads", &model->num_kv_heads},
                                   {"head_dim", &model->head_dim}}) {
      if (absl::Status s = RequiredScalar(node, where, key, "an integer", out); !s.ok()) return s;
    }
    absl::StatusOr<YAML::Node> rope = Required(node, where, "rope");
    if (!rope.ok()) return rope.status();
    *rope_line = LineOf(*rope);
    return ParseRope(*rope, absl::StrCat(where, ".rope"), &model->rope);
  }

  absl::Status ParseLayer(const YAML::Node& node, size_t index, LayerEntry* entry) {
    const std::string where = absl::StrCat("layers[", index, "]");
    if (absl::Status s = CheckMap(node, where,
                                  {"target_layer", "sigma_k", "sigma_v", "r2_k", "r2_v",
                                   "r2_k_heldout", "r2_v_heldout", "attention_cosine_heldout"});
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            RequiredScalar(node, where, "target_layer", "an integer", &entry->target_layer);
        !s.ok()) {
      return s;
    }
    for (const auto& [key, out, line_out] :
         {std::tuple<const char*, std::vector<int>*, std::vector<int>*>{"sigma_k", &entry->sigma_k,
                                                                        &lines_.sigma_k},
          {"sigma_v", &entry->sigma_v, &lines_.sigma_v}}) {
      absl::StatusOr<YAML::Node> list = Required(node, where, key);
      if (!list.ok()) return list.status();
      line_out->push_back(LineOf(*list));
      absl::StatusOr<std::vector<int>> values = IntList(*list, Path(where, key));
      if (!values.ok()) return values.status();
      *out = *std::move(values);
    }
    const std::pair<const char*, std::optional<double>*> r2s[] = {
        {"r2_k", &entry->r2_k},
        {"r2_v", &entry->r2_v},
        {"r2_k_heldout", &entry->r2_k_heldout},
        {"r2_v_heldout", &entry->r2_v_heldout},
        {"attention_cosine_heldout", &entry->attention_cosine_heldout}};
    for (const auto& [key, out] : r2s) {
      const YAML::Node value = node[key];
      if (!value.IsDefined()) continue;
      absl::StatusOr<double> r2 = Scalar<double>(value, Path(where, key), "a number");
      if (!r2.ok()) return r2.status();
      *out = *r2;
    }
    return absl::OkStatus();
  }

  absl::Status ParseQuality(const YAML::Node& node, ManifestQuality* quality) {
    if (node.IsNull()) return absl::OkStatus();  // `quality:` with nothing: none recorded
    if (absl::Status s = CheckMap(node, "quality",
                                  {"attention_cosine_heldout",
                                   "attention_cosine_heldout_all_layers",
                                   "attention_cosine_heldout_lower95", "heldout_sequences",
                                   "heldout_tokens", "r2_heldout", "kv_cosine_heldout",
                                   "benefit"});
        !s.ok()) {
      return s;
    }
    for (const auto& [key, out] :
         {std::pair<const char*, std::optional<double>*>{"attention_cosine_heldout",
                                                         &quality->attention_cosine_heldout},
          {"attention_cosine_heldout_all_layers", &quality->attention_cosine_heldout_all_layers},
          {"attention_cosine_heldout_lower95", &quality->attention_cosine_heldout_lower95},
          {"r2_heldout", &quality->r2_heldout},
          {"kv_cosine_heldout", &quality->kv_cosine_heldout}}) {
      const YAML::Node value = node[key];
      if (!value.IsDefined()) continue;
      absl::StatusOr<double> number = Scalar<double>(value, Path("quality", key), "a number");
      if (!number.ok()) return number.status();
      *out = *number;
    }
    for (const auto& [key, out] :
         {std::pair<const char*, std::optional<int64_t>*>{"heldout_sequences",
                                                          &quality->heldout_sequences},
          {"heldout_tokens", &quality->heldout_tokens}}) {
      const YAML::Node value = node[key];
      if (!value.IsDefined()) continue;
      absl::StatusOr<int64_t> number = Scalar<int64_t>(value, Path("quality", key), "an integer");
      if (!number.ok()) return number.status();
      *out = *number;
    }
    const YAML::Node benefit = node["benefit"];
    if (!benefit.IsDefined() || benefit.IsNull()) return absl::OkStatus();
    if (!benefit.IsSequence()) {
      return WrongType(benefit, "quality.benefit", "a list of {text, windows, ...} maps");
    }
    for (size_t i = 0; i < benefit.size(); ++i) {
      lines_.benefit.push_back(LineOf(benefit[i]));
      BenefitRecord record;
      if (absl::Status s = ParseBenefitRecord(benefit[i], absl::StrCat("quality.benefit[", i, "]"),
                                              &record);
          !s.ok()) {
        return s;
      }
      quality->benefit.push_back(std::move(record));
    }
    return absl::OkStatus();
  }

  // One quality.benefit entry: every key required (ValidateImpl checks the values).
  absl::Status ParseBenefitRecord(const YAML::Node& node, const std::string& where,
                                  BenefitRecord* record) {
    if (absl::Status s = CheckMap(node, where,
                                  {"text", "windows", "context_tokens", "continuation_tokens",
                                   "recovered", "lower95", "upper95", "kl"});
        !s.ok()) {
      return s;
    }
    if (absl::Status s = RequiredScalar(node, where, "text", "a string", &record->text); !s.ok()) {
      return s;
    }
    for (const auto& [key, out] :
         {std::pair<const char*, int64_t*>{"windows", &record->windows},
          {"context_tokens", &record->context_tokens},
          {"continuation_tokens", &record->continuation_tokens}}) {
      if (absl::Status s = RequiredScalar(node, where, key, "an integer", out); !s.ok()) return s;
    }
    for (const auto& [key, out] : {std::pair<const char*, double*>{"recovered", &record->recovered},
                                   {"lower95", &record->lower95},
                                   {"upper95", &record->upper95},
                                   {"kl", &record->kl}}) {
      if (absl::Status s = RequiredScalar(node, where, key, "a number", out); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Manifest> ParseRoot(const YAML::Node& root) {
    Manifest m;
    if (!root.IsMap()) return error_(LineOf(root), "the manifest must be a YAML map");
    lines_.root = LineOf(root);
    // The version first: a newer manifest gets "unsupported format_version", not complaints about
    // keys this build has never heard of.
    absl::StatusOr<YAML::Node> version = Required(root, "", "format_version");
    if (!version.ok()) return version.status();
    absl::StatusOr<int> v = Scalar<int>(*version, "format_version", "an integer");
    if (!v.ok()) return v.status();
    if (*v != kManifestFormatVersion) {
      return error_(LineOf(*version),
                    absl::StrCat("unsupported format_version ", *v,
                                 " (this build reads format_version ", kManifestFormatVersion,
                                 ")"));
    }
    m.format_version = *v;
    if (absl::Status s = CheckMap(root, "",
                                  {"format_version", "kind", "mlp", "ridge", "synthetic", "source", "target", "k",
                                   "window", "lambda", "lambda_scale", "weights", "quality", "layers",
                                   "calibration", "created_by"});
        !s.ok()) {
      return s;
    }

    std::string kind;
    if (absl::Status s = RequiredScalar(root, "", "kind", "a string", &kind); !s.ok()) return s;
    lines_.kind = LineOf(root["kind"]);
    if (kind == "ridge") {
      m.kind = MapperKind::kRidge;
    } else if (kind == "mlp") {
      m.kind = MapperKind::kMlp;
    } else {
      return error_(lines_.kind, absl::StrCat("unknown kind '", kind, "' (expected ridge or mlp)"));
    }
    const YAML::Node mlp = root["mlp"];
    if (mlp.IsDefined()) {
      lines_.mlp = LineOf(mlp);
      if (m.kind != MapperKind::kMlp) {
        return error_(lines_.mlp, absl::StrCat("key 'mlp' is only valid with kind: mlp, but kind "
                                               "is ", kind));
      }
      absl::StatusOr<MlpConfig> config = ParseMlp(mlp);
      if (!config.ok()) return config.status();
      m.mlp = *config;
    } else if (m.kind == MapperKind::kMlp) {
      return error_(lines_.kind, "missing required key 'mlp' (kind: mlp needs {hidden: H, "
                                 "granularity: per_layer|per_head})");
    }
    const YAML::Node ridge = root["ridge"];
    if (ridge.IsDefined()) {
      lines_.ridge = LineOf(ridge);
      if (m.kind != MapperKind::kRidge) {
        return error_(lines_.ridge, absl::StrCat("key 'ridge' is only valid with kind: ridge, but "
                                                 "kind is ", kind));
      }
      absl::StatusOr<RidgeGranularity> granularity = ParseRidge(ridge);
      if (!granularity.ok()) return granularity.status();
      m.ridge_granularity = *granularity;
    }
    if (absl::Status s = OptionalScalar(root, "", "synthetic", "true or false", &m.synthetic);
        !s.ok()) {
      return s;
    }

    for (const auto& [key, model, line, rope_line] :
         {std::tuple<const char*, ModelSpec*, int*, int*>{"source", &m.source, &lines_.source,
                                                          &lines_.source_rope},
          {"target", &m.target, &lines_.target, &lines_.target_rope}}) {
      absl::StatusOr<YAML::Node> node = Required(root, "", key);
      if (!node.ok()) return node.status();
      *line = LineOf(*node);
      if (absl::Status s = ParseModel(*node, key, model, rope_line); !s.ok()) return s;
    }

    if (absl::Status s = RequiredScalar(root, "", "k", "an integer", &m.k); !s.ok()) return s;
    lines_.k = LineOf(root["k"]);
    if (absl::Status s = OptionalScalar(root, "", "window", "an integer", &m.window); !s.ok()) {
      return s;
    }
    lines_.window = LineOf(root["window"]);
    if (absl::Status s = OptionalScalar(root, "", "lambda", "a number", &m.lambda); !s.ok()) {
      return s;
    }
    lines_.lambda = LineOf(root["lambda"]);
    std::string scale = "covariance";
    if (absl::Status s = OptionalScalar(root, "", "lambda_scale", "a string", &scale); !s.ok()) {
      return s;
    }
    if (scale == "covariance") {
      m.lambda_scale = LambdaScale::kCovariance;
    } else if (scale == "sum") {
      m.lambda_scale = LambdaScale::kSum;
    } else {
      return error_(LineOf(root["lambda_scale"]),
                    absl::StrCat("lambda_scale '", scale, "' must be covariance or sum"));
    }

    absl::StatusOr<YAML::Node> weights = Required(root, "", "weights");
    if (!weights.ok()) return weights.status();
    lines_.weights = LineOf(*weights);
    if (absl::Status s = CheckMap(*weights, "weights", {"file", "dtype"}); !s.ok()) return s;
    if (absl::Status s = RequiredScalar(*weights, "weights", "file", "a string", &m.weights_file);
        !s.ok()) {
      return s;
    }
    std::string dtype;
    if (absl::Status s = RequiredScalar(*weights, "weights", "dtype", "a string", &dtype); !s.ok()) {
      return s;
    }
    absl::StatusOr<DType> parsed_dtype = ParseDType(dtype);
    if (!parsed_dtype.ok()) {
      return error_(LineOf((*weights)["dtype"]),
                    absl::StrCat("weights.dtype: ", parsed_dtype.status().message()));
    }
    m.weights_dtype = *parsed_dtype;

    const YAML::Node quality = root["quality"];
    if (quality.IsDefined()) {
      lines_.quality = LineOf(quality);
      if (absl::Status s = ParseQuality(quality, &m.quality); !s.ok()) return s;
    }

    absl::StatusOr<YAML::Node> layers = Required(root, "", "layers");
    if (!layers.ok()) return layers.status();
    lines_.layers = LineOf(*layers);
    if (!layers->IsSequence()) {
      return error_(lines_.layers, "layers must be a list with one entry per target layer");
    }
    for (size_t i = 0; i < layers->size(); ++i) {
      const YAML::Node entry = (*layers)[i];
      lines_.layer.push_back(LineOf(entry));
      LayerEntry layer;
      if (absl::Status s = ParseLayer(entry, i, &layer); !s.ok()) return s;
      m.layers.push_back(std::move(layer));
    }

    const YAML::Node calibration = root["calibration"];
    if (calibration.IsDefined() && !calibration.IsNull()) {
      if (!calibration.IsMap()) {
        return error_(LineOf(calibration), "calibration must be a map (free-form keys)");
      }
      m.calibration_yaml = YAML::Dump(calibration);
      if (std::string problem = CalibrationProblem(m.calibration_yaml); !problem.empty()) {
        return error_(LineOf(calibration), problem);
      }
    }
    if (absl::Status s = OptionalScalar(root, "", "created_by", "a string", &m.created_by);
        !s.ok()) {
      return s;
    }

    if (absl::Status s = ValidateImpl(m, lines_, error_); !s.ok()) return s;
    return m;
  }

  ErrorMaker error_;
  ManifestLines lines_;
};

// ---- Emission ----

void EmitModel(YAML::Emitter& out, const ModelSpec& model) {
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << model.name;
  out << YAML::Key << "num_layers" << YAML::Value << model.num_layers;
  out << YAML::Key << "num_kv_heads" << YAML::Value << model.num_kv_heads;
  out << YAML::Key << "head_dim" << YAML::Value << model.head_dim;
  out << YAML::Key << "rope" << YAML::Value << YAML::Flow << YAML::BeginMap;
  out << YAML::Key << "theta" << YAML::Value << FormatDouble(model.rope.theta);
  out << YAML::Key << "rotary_dim" << YAML::Value << model.rope.rotary_dim;
  out << YAML::Key << "style" << YAML::Value << RopeStyleName(model.rope.style);
  const RopeScaling& s = model.rope.scaling;
  out << YAML::Key << "scaling" << YAML::Value << YAML::Flow << YAML::BeginMap;
  out << YAML::Key << "type" << YAML::Value << RopeScalingTypeName(s.type);
  // Only the parameters the scaling type reads, so the manifest says what matters.
  if (s.type != RopeScalingType::kNone) {
    out << YAML::Key << "factor" << YAML::Value << FormatDouble(s.factor);
  }
  if (s.type == RopeScalingType::kLlama3) {
    out << YAML::Key << "low_freq_factor" << YAML::Value << FormatDouble(s.low_freq_factor);
    out << YAML::Key << "high_freq_factor" << YAML::Value << FormatDouble(s.high_freq_factor);
  }
  if (s.type == RopeScalingType::kLlama3 || s.type == RopeScalingType::kYarn) {
    out << YAML::Key << "original_max_position_embeddings" << YAML::Value
        << FormatDouble(s.original_max_position_embeddings);
  }
  if (s.type == RopeScalingType::kYarn) {
    out << YAML::Key << "beta_fast" << YAML::Value << FormatDouble(s.beta_fast);
    out << YAML::Key << "beta_slow" << YAML::Value << FormatDouble(s.beta_slow);
    if (s.has_attention_factor) {
      out << YAML::Key << "attention_factor" << YAML::Value << FormatDouble(s.attention_factor);
    }
  }
  out << YAML::EndMap;  // scaling
  out << YAML::EndMap;  // rope
  out << YAML::EndMap;
}

void EmitBenefit(YAML::Emitter& out, const std::vector<BenefitRecord>& benefit) {
  out << YAML::Key << "benefit" << YAML::Value << YAML::BeginSeq;
  for (const BenefitRecord& r : benefit) {
    out << YAML::Flow << YAML::BeginMap;
    out << YAML::Key << "text" << YAML::Value << r.text;
    out << YAML::Key << "windows" << YAML::Value << r.windows;
    out << YAML::Key << "context_tokens" << YAML::Value << r.context_tokens;
    out << YAML::Key << "continuation_tokens" << YAML::Value << r.continuation_tokens;
    for (const auto& [key, value] : {std::pair<const char*, double>{"recovered", r.recovered},
                                     {"lower95", r.lower95},
                                     {"upper95", r.upper95},
                                     {"kl", r.kl}}) {
      out << YAML::Key << key << YAML::Value << FormatDouble(value);
    }
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
}

void EmitIntList(YAML::Emitter& out, const std::vector<int>& values) {
  out << YAML::Flow << YAML::BeginSeq;
  for (int v : values) out << v;
  out << YAML::EndSeq;
}

}  // namespace

const char* MapperKindName(MapperKind kind) {
  return kind == MapperKind::kRidge ? "ridge" : "mlp";
}

const char* MlpGranularityName(MlpGranularity granularity) {
  return granularity == MlpGranularity::kPerLayer ? "per_layer" : "per_head";
}

absl::StatusOr<MlpConfig> MakeMlpConfig(int64_t hidden, absl::string_view granularity) {
  MlpConfig config;
  if (std::optional<MlpGranularity> parsed = ParseMlpGranularity(granularity)) {
    config.granularity = *parsed;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--mlp_granularity='", granularity, "' must be per_layer or per_head"));
  }
  if (hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--mlp_hidden=", hidden, " must be >= 1"));
  }
  config.hidden = hidden;
  return config;
}

std::optional<MlpGranularity> ParseMlpGranularity(absl::string_view name) {
  for (MlpGranularity granularity : {MlpGranularity::kPerLayer, MlpGranularity::kPerHead}) {
    if (name == MlpGranularityName(granularity)) return granularity;
  }
  return std::nullopt;
}

const char* RidgeGranularityName(RidgeGranularity granularity) {
  return granularity == RidgeGranularity::kPerLayer ? "per_layer" : "per_head";
}

std::optional<RidgeGranularity> ParseRidgeGranularity(absl::string_view name) {
  for (RidgeGranularity granularity : {RidgeGranularity::kPerLayer, RidgeGranularity::kPerHead}) {
    if (name == RidgeGranularityName(granularity)) return granularity;
  }
  return std::nullopt;
}

const char* LambdaScaleName(LambdaScale scale) {
  return scale == LambdaScale::kCovariance ? "covariance" : "sum";
}

std::string FormatDouble(double value) {
  if (std::isnan(value)) return ".nan";
  if (std::isinf(value)) return value > 0 ? ".inf" : "-.inf";
  char buffer[40];
  // Integral values (theta, context lengths) read better as "1000000" than "1e+06".
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    std::snprintf(buffer, sizeof(buffer), "%.0f", value);
    return buffer;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  return buffer;
}

absl::StatusOr<Manifest> ParseManifest(absl::string_view yaml_text, absl::string_view label) {
  return Parser(label).Parse(yaml_text);
}

absl::StatusOr<Manifest> ReadManifestFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  return ParseManifest(*text, path);
}

absl::Status ValidateBenefitRecord(const BenefitRecord& record, absl::string_view path) {
  std::string problem = BenefitRecordProblem(record, path);
  return problem.empty() ? absl::OkStatus() : absl::InvalidArgumentError(problem);
}

absl::Status ValidateManifest(const Manifest& manifest) {
  if (absl::Status s = ValidateImpl(manifest, ManifestLines(), ErrorMaker("manifest")); !s.ok()) {
    return s;
  }
  if (!manifest.calibration_yaml.empty()) {
    if (std::string problem = CalibrationProblem(manifest.calibration_yaml); !problem.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("manifest: ", problem));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> EmitManifest(const Manifest& m) {
  if (absl::Status s = ValidateManifest(m); !s.ok()) return s;
  YAML::Emitter out;
  out << YAML::BeginMap;
  out << YAML::Key << "format_version" << YAML::Value << m.format_version;
  out << YAML::Key << "kind" << YAML::Value << MapperKindName(m.kind);
  if (m.mlp.has_value()) {
    out << YAML::Key << "mlp" << YAML::Value << YAML::Flow << YAML::BeginMap;
    out << YAML::Key << "hidden" << YAML::Value << m.mlp->hidden;
    out << YAML::Key << "granularity" << YAML::Value << MlpGranularityName(m.mlp->granularity);
    out << YAML::Key << "activation" << YAML::Value << "relu";
    out << YAML::EndMap;
  }
  // per_layer, the default, is left implicit: manifests written before per_head stay unchanged.
  if (m.ridge_granularity == RidgeGranularity::kPerHead) {
    out << YAML::Key << "ridge" << YAML::Value << YAML::Flow << YAML::BeginMap;
    out << YAML::Key << "granularity" << YAML::Value
        << RidgeGranularityName(m.ridge_granularity);
    out << YAML::EndMap;
  }
  out << YAML::Key << "synthetic" << YAML::Value << m.synthetic;
  out << YAML::Key << "source" << YAML::Value;
  EmitModel(out, m.source);
  out << YAML::Key << "target" << YAML::Value;
  EmitModel(out, m.target);
  out << YAML::Key << "k" << YAML::Value << m.k;
  // Only when not 1, so token-wise manifests read the same as before windows existed.
  if (m.window != 1) out << YAML::Key << "window" << YAML::Value << m.window;
  out << YAML::Key << "lambda" << YAML::Value << FormatDouble(m.lambda);
  out << YAML::Key << "lambda_scale" << YAML::Value << LambdaScaleName(m.lambda_scale);
  out << YAML::Key << "weights" << YAML::Value << YAML::Flow << YAML::BeginMap;
  out << YAML::Key << "file" << YAML::Value << m.weights_file;
  out << YAML::Key << "dtype" << YAML::Value << DTypeName(m.weights_dtype);
  out << YAML::EndMap;
  if (!m.quality.empty()) {
    // One flow line as before unless benefit is recorded; then a block map, one line per text.
    out << YAML::Key << "quality" << YAML::Value;
    if (m.quality.benefit.empty()) out << YAML::Flow;
    out << YAML::BeginMap;
    for (const auto& [key, value] :
         {std::pair<const char*, const std::optional<double>*>{
              "attention_cosine_heldout", &m.quality.attention_cosine_heldout},
          {"attention_cosine_heldout_all_layers", &m.quality.attention_cosine_heldout_all_layers},
          {"attention_cosine_heldout_lower95", &m.quality.attention_cosine_heldout_lower95},
          {"r2_heldout", &m.quality.r2_heldout},
          {"kv_cosine_heldout", &m.quality.kv_cosine_heldout}}) {
      if (value->has_value()) out << YAML::Key << key << YAML::Value << FormatDouble(**value);
    }
    for (const auto& [key, value] :
         {std::pair<const char*, const std::optional<int64_t>*>{
              "heldout_sequences", &m.quality.heldout_sequences},
          {"heldout_tokens", &m.quality.heldout_tokens}}) {
      if (value->has_value()) out << YAML::Key << key << YAML::Value << **value;
    }
    if (!m.quality.benefit.empty()) EmitBenefit(out, m.quality.benefit);
    out << YAML::EndMap;
  }
  out << YAML::Key << "layers" << YAML::Value << YAML::BeginSeq;
  for (const LayerEntry& layer : m.layers) {
    out << YAML::Flow << YAML::BeginMap;
    out << YAML::Key << "target_layer" << YAML::Value << layer.target_layer;
    out << YAML::Key << "sigma_k" << YAML::Value;
    EmitIntList(out, layer.sigma_k);
    out << YAML::Key << "sigma_v" << YAML::Value;
    EmitIntList(out, layer.sigma_v);
    const std::pair<const char*, const std::optional<double>*> r2s[] = {
        {"r2_k", &layer.r2_k},
        {"r2_v", &layer.r2_v},
        {"r2_k_heldout", &layer.r2_k_heldout},
        {"r2_v_heldout", &layer.r2_v_heldout},
        {"attention_cosine_heldout", &layer.attention_cosine_heldout}};
    for (const auto& [key, value] : r2s) {
      if (value->has_value()) out << YAML::Key << key << YAML::Value << FormatDouble(**value);
    }
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
  if (!m.calibration_yaml.empty()) {
    out << YAML::Key << "calibration" << YAML::Value << YAML::Load(m.calibration_yaml);
  }
  if (!m.created_by.empty()) out << YAML::Key << "created_by" << YAML::Value << m.created_by;
  out << YAML::EndMap;
  if (!out.good()) {
    return absl::InternalError(absl::StrCat("cannot emit manifest YAML: ", out.GetLastError()));
  }
  return absl::StrCat(out.c_str(), "\n");
}

}  // namespace kvt
