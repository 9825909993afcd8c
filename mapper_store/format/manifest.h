// The manifest.yaml of a mapper directory as a struct: parsing with errors that name the key and
// line, semantic validation (shapes, sigma ranges, RoPE), and emission. docs/MAPPER_FORMAT.md.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"

namespace kvt {

// The one manifest format version this build reads and writes.
inline constexpr int kManifestFormatVersion = 1;
inline constexpr char kManifestFileName[] = "manifest.yaml";
inline constexpr char kDefaultWeightsFileName[] = "weights.safetensors";
inline constexpr char kChecksumFileName[] = "SHA256SUMS";
// The widest `window` a manifest may declare: the apply path keeps window - 1 rows of history.
inline constexpr int kMaxMapperWindow = 64;

enum class MapperKind {
  kRidge,  // x W + b per target layer and K|V (SPEC 3)
  kMlp,    // relu(relu(x A1 + c1) A2 + c2) A3 + c3 per target layer and K|V (SPEC 3)
};
const char* MapperKindName(MapperKind kind);

// Whether an MLP mapper has one chain per target layer (head outputs stacked in fc3's columns)
// or one per target head (the paper), each seeing the full x and writing its head's d_t columns.
enum class MlpGranularity { kPerLayer, kPerHead };
const char* MlpGranularityName(MlpGranularity granularity);
// The inverse of MlpGranularityName ("per_layer", "per_head"); nullopt for anything else.
std::optional<MlpGranularity> ParseMlpGranularity(absl::string_view name);

// The `mlp:` map of a kind: mlp manifest. Only ReLU exists, so the activation is implied.
struct MlpConfig {
  int64_t hidden = 1024;  // H, the width of both hidden layers
  MlpGranularity granularity = MlpGranularity::kPerLayer;
};
// An MlpConfig from command-line values: INVALID_ARGUMENT naming the flag (--mlp_hidden,
// --mlp_granularity) when hidden < 1 or the granularity is not per_layer / per_head.
absl::StatusOr<MlpConfig> MakeMlpConfig(int64_t hidden, absl::string_view granularity);

// Whether a ridge mapper maps each target layer from the whole gathered row (per_layer, SPEC 3)
// or each target head only from its matching source heads (per_head, head-local: the
// `ridge: {granularity: per_head}` map; kernels/mapper_view.h HeadLocalSources pairs the heads).
enum class RidgeGranularity { kPerLayer, kPerHead };
const char* RidgeGranularityName(RidgeGranularity granularity);
// The inverse of RidgeGranularityName ("per_layer", "per_head"); nullopt for anything else.
std::optional<RidgeGranularity> ParseRidgeGranularity(absl::string_view name);

// Where the ridge penalty lambda was added (SPEC 4.1).
enum class LambdaScale {
  kCovariance,  // to S_xx = X^T X / N (default)
  kSum,         // to the un-normalised X^T X
};
const char* LambdaScaleName(LambdaScale scale);

// One target layer: the ordered source layers feeding its K and V maps, and fit quality.
struct LayerEntry {
  int target_layer = 0;
  std::vector<int> sigma_k;
  std::vector<int> sigma_v;
  std::optional<double> r2_k, r2_v;                  // in-sample, head-averaged
  std::optional<double> r2_k_heldout, r2_v_heldout;  // on held-out calibration sequences
  // Causal attention-output cosine (SPEC 5) of the target over this layer's translated K/V
  // against its own, with its own queries, on held-out calibration sequences; in [-1, 1].
  std::optional<double> attention_cosine_heldout;
};

// One `quality.benefit` entry: what `python -m kvt.qualify` measured of the target model on
// held-out windows of one named text source. "Recovered" is the share of the context benefit
// the mapped cache keeps: (CE_none - CE_mapped) / (CE_none - CE_own), the target's cross-entropy
// on the continuation with no context, the translated context, and its own context. The
// attention cosine does not see this (docs/EVAL.md, "A second text source"), so kvtd's gate
// reads it (prefix_cache.min_benefit_recovered).
struct BenefitRecord {
  std::string text;  // the source's name; unique within the list, [A-Za-z0-9._-]+
  int64_t windows = 0;              // >= 2 (the interval needs two)
  int64_t context_tokens = 0;       // >= 1 per window
  int64_t continuation_tokens = 0;  // >= 1 per window
  double recovered = 0;             // point estimate; may be < 0 or > 1
  double lower95 = 0, upper95 = 0;  // 95% paired-bootstrap interval around it
  double kl = 0;  // mean KL(own || mapped), nats per continuation token, >= 0
};

// The `quality:` map: held-out summaries `kvt fit` records for gates (kvtd's prefix cache).
// Every field is optional; an empty map is the same as none.
struct ManifestQuality {
  // Mean over target layers past 0 of layers[l].attention_cosine_heldout (every layer when the
  // target has one), and over all layers.
  std::optional<double> attention_cosine_heldout;
  std::optional<double> attention_cosine_heldout_all_layers;
  // One-sided 95% lower bound (Student t over the held-out sequences, quality/mean_interval.h)
  // of attention_cosine_heldout: what kvtd's quality gate compares with its floor. Absent with
  // fewer than two held-out sequences.
  std::optional<double> attention_cosine_heldout_lower95;
  // What the held-out figures rest on.
  std::optional<int64_t> heldout_sequences;
  std::optional<int64_t> heldout_tokens;
  // Mean of r2_k_heldout and r2_v_heldout over target layers past 0 (every layer when only
  // layer 0 has them).
  std::optional<double> r2_heldout;
  // The statistic kvtd's live verification measures on served handoffs (quality/kv_quality.h
  // KvCosineOverLayers): cos(translated, true) per token and head, averaged over tokens, heads,
  // K and V, then over target layers past 0 (every layer when the target has one), over the
  // held-out sequences. Absent in manifests written before it (live checks then never take the
  // mapper out of service).
  std::optional<double> kv_cosine_heldout;
  // Measured context benefit per text source (`kvt record-benefit` writes it); empty in
  // manifests from before it, which then emit exactly as they did.
  std::vector<BenefitRecord> benefit;
  bool empty() const {
    return !attention_cosine_heldout && !attention_cosine_heldout_all_layers &&
           !attention_cosine_heldout_lower95 && !heldout_sequences && !heldout_tokens &&
           !r2_heldout && !kv_cosine_heldout && benefit.empty();
  }
};

struct Manifest {
  int format_version = kManifestFormatVersion;
  MapperKind kind = MapperKind::kRidge;
  std::optional<MlpConfig> mlp;  // set iff kind == kMlp
  // kind: ridge only. per_head is emitted as `ridge: {granularity: per_head}`; per_layer (the
  // default) emits nothing, so existing manifests and their checksums stay byte-identical.
  RidgeGranularity ridge_granularity = RidgeGranularity::kPerLayer;
  bool synthetic = false;  // random weights from `kvt synth`
  ModelSpec source;
  ModelSpec target;
  int k = 0;  // the longest sigma list (every sigma has 1..k entries, at least one has k)
  // Tokens the map reads per output token: the token itself and the window - 1 before it in the
  // same request (x at p, p-1, ..., p-window+1 side by side; zero rows before the request's first
  // token). 1 is SPEC 3's token-wise map; docs/MAPPER_FORMAT.md, "Window mappers".
  int window = 1;
  double lambda = 0.01;
  LambdaScale lambda_scale = LambdaScale::kCovariance;
  std::string weights_file = kDefaultWeightsFileName;
  DType weights_dtype = DType::kBF16;
  ManifestQuality quality;         // emitted as `quality:` unless empty
  std::vector<LayerEntry> layers;  // exactly target.num_layers, in order
  // The free-form `calibration` map as YAML text, kept as written; empty if absent.
  std::string calibration_yaml;
  std::string created_by;  // free-form
};

// Parses manifest.yaml text. Errors are INVALID_ARGUMENT and read
// "<label> line N: ..." naming the offending key: YAML syntax, unknown or duplicate keys, missing
// required keys, wrong scalar types, unsupported format_version, sigma entries out of range, RoPE
// settings kvt::ValidateRopeConfig refuses. `label` is how messages name the file.
absl::StatusOr<Manifest> ParseManifest(absl::string_view yaml_text,
                                       absl::string_view label = kManifestFileName);
// Reads and parses a file; messages name its path.
absl::StatusOr<Manifest> ReadManifestFile(const std::string& path);

// The semantic checks of ParseManifest for a struct built in code (writers call this before
// anything touches the disk). Messages name the field, e.g. "layers[3].sigma_k[1] = 40 ...".
absl::Status ValidateManifest(const Manifest& manifest);

// YAML text of a valid manifest (validated first). ParseManifest(EmitManifest(m)) == m.
absl::StatusOr<std::string> EmitManifest(const Manifest& manifest);

// The semantic checks of one quality.benefit entry, messages naming `path`'s fields
// ("quality.benefit[1].lower95 = ..."): the text name's characters, the counts, a finite
// interval around the estimate, a non-negative KL. ValidateManifest applies it to each entry
// (and refuses a text named twice); `kvt record-benefit` to the entries it reads.
absl::Status ValidateBenefitRecord(const BenefitRecord& record, absl::string_view path);

// Shortest decimal that reads back as the same double ("0.01", "1000000", "1e-07").
std::string FormatDouble(double value);

}  // namespace kvt
