// `kvt synth`, `kvt inspect` and `kvt record-benefit`: mapper directories on local disk, no server
// involved.
#include <cstdio>
#include <optional>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "mapper_store/inspect.h"
#include "mapper_store/record_benefit.h"
#include "mapper_store/synth.h"

ABSL_FLAG(std::string, preset, "",
          "kvt synth: a named pair (demo-tiny, qwen3-14b-to-32b, qwen3-8b-to-32b, "
          "qwen3-32b-to-14b, llama3.1-8b-to-70b, ministral-3b-to-8b). Empty: custom shapes.");
ABSL_FLAG(std::string, out, "",
          "kvt synth / import / fit: the mapper directory to write (must not exist).");
ABSL_FLAG(uint64_t, seed, 1,
          "kvt synth / demo / fit: random seed (same seed, same bytes; fit: held-out choice "
          "and MLP training).");
ABSL_FLAG(std::string, weight_dtype, "",
          "kvt synth / fit / import: bf16 | fp16 | fp32 (default: preset's; import: fp32).");
ABSL_FLAG(int32_t, k, -1, "kvt synth: source layers per target layer (0 = all; default preset's).");
ABSL_FLAG(std::string, source_model, "",
          "Source model name (synth custom shapes; translate / demo header; fit / import).");
ABSL_FLAG(std::string, target_model, "",
          "Target model name (synth custom shapes; translate / demo header; fit / import).");
ABSL_FLAG(int32_t, source_layers, 4, "kvt synth custom: source layers.");
ABSL_FLAG(int32_t, source_heads, 2, "kvt synth custom: source KV heads.");
ABSL_FLAG(int32_t, source_head_dim, 32, "kvt synth custom: source head_dim.");
ABSL_FLAG(int32_t, target_layers, 6, "kvt synth custom: target layers.");
ABSL_FLAG(int32_t, target_heads, 2, "kvt synth custom: target KV heads.");
ABSL_FLAG(int32_t, target_head_dim, 32, "kvt synth custom: target head_dim.");
ABSL_FLAG(double, rope_theta, 10000.0, "kvt synth custom: RoPE theta of both models (neox).");
ABSL_FLAG(std::string, ridge_granularity, "per_layer",
          "kvt synth --kind=ridge: per_layer (each target layer from the whole row) or per_head "
          "(each target head from its matching source heads only: n_kv times fewer weights).");
// Shared with `kvt fit` (defined in fit_commands.cc): synth --kind=mlp writes a random MLP.
ABSL_FLAG(std::string, mapper, "",
          "kvt record-benefit: the mapper directory whose manifest records the benefit.");
ABSL_FLAG(std::string, benefit, "",
          "kvt record-benefit: the JSON file `python -m kvt.qualify` wrote "
          "({\"benefit\": [entries]}).");
ABSL_DECLARE_FLAG(std::string, kind);
ABSL_DECLARE_FLAG(int64_t, mlp_hidden);
ABSL_DECLARE_FLAG(std::string, mlp_granularity);
ABSL_DECLARE_FLAG(int32_t, window);

namespace kvt {
namespace cli {

int RunSynth(const std::vector<std::string>& args) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::fprintf(stderr, "kvt synth: --out=DIR is required\n");
    return 1;
  }
  SynthOptions options;
  const std::string preset = absl::GetFlag(FLAGS_preset);
  if (!preset.empty()) {
    absl::StatusOr<SynthOptions> preset_options = SynthPreset(preset);
    if (!preset_options.ok()) {
      std::fprintf(stderr, "kvt synth: %s (presets: %s)\n",
                   std::string(preset_options.status().message()).c_str(),
                   absl::StrJoin(SynthPresetNames(), ", ").c_str());
      return 1;
    }
    options = *preset_options;
  } else {
    const std::string source_name = absl::GetFlag(FLAGS_source_model);
    const std::string target_name = absl::GetFlag(FLAGS_target_model);
    const double theta = absl::GetFlag(FLAGS_rope_theta);
    options.source = NeoxModelSpec(source_name.empty() ? "custom/source" : source_name,
                                   absl::GetFlag(FLAGS_source_layers),
                                   absl::GetFlag(FLAGS_source_heads),
                                   absl::GetFlag(FLAGS_source_head_dim), theta);
    options.target = NeoxModelSpec(target_name.empty() ? "custom/target" : target_name,
                                   absl::GetFlag(FLAGS_target_layers),
                                   absl::GetFlag(FLAGS_target_heads),
                                   absl::GetFlag(FLAGS_target_head_dim), theta);
    options.k = 2;
  }
  if (absl::GetFlag(FLAGS_k) >= 0) options.k = absl::GetFlag(FLAGS_k);
  if (!absl::GetFlag(FLAGS_weight_dtype).empty()) {
    absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_weight_dtype));
    if (!dtype.ok()) {
      std::fprintf(stderr, "kvt synth: --weight_dtype: %s\n",
                   std::string(dtype.status().message()).c_str());
      return 1;
    }
    options.dtype = *dtype;
  }
  options.seed = absl::GetFlag(FLAGS_seed);
  options.window = absl::GetFlag(FLAGS_window);  // the manifest's checks name a bad one
  const std::string kind = absl::GetFlag(FLAGS_kind);
  if (kind == "mlp") {
    absl::StatusOr<MlpConfig> mlp =
        MakeMlpConfig(absl::GetFlag(FLAGS_mlp_hidden), absl::GetFlag(FLAGS_mlp_granularity));
    if (!mlp.ok()) {
      std::fprintf(stderr, "kvt synth: %s\n", std::string(mlp.status().message()).c_str());
      return 1;
    }
    options.mlp = *mlp;
  } else if (kind != "ridge") {
    std::fprintf(stderr, "kvt synth: --kind='%s' must be ridge or mlp\n", kind.c_str());
    return 1;
  }
  const std::string granularity = absl::GetFlag(FLAGS_ridge_granularity);
  if (std::optional<RidgeGranularity> parsed = ParseRidgeGranularity(granularity)) {
    options.ridge_granularity = *parsed;  // with --kind=mlp, per_head is refused by name below
  } else {
    std::fprintf(stderr, "kvt synth: --ridge_granularity='%s' must be per_layer or per_head\n",
                 granularity.c_str());
    return 1;
  }
  absl::Status written = WriteSynthMapper(out, options);
  if (!written.ok()) {
    std::fprintf(stderr, "kvt synth: %s\n", written.ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::string> report = InspectMapperDir(out);
  if (!report.ok()) {
    std::fprintf(stderr, "kvt synth: wrote %s but cannot read it back: %s\n", out.c_str(),
                 report.status().ToString().c_str());
    return 2;
  }
  std::printf("%s", report->c_str());
  return 0;
}

int RunInspect(const std::vector<std::string>& args) {
  if (args.size() != 1) {
    std::fprintf(stderr, "usage: kvt inspect DIR\n");
    return 1;
  }
  absl::StatusOr<std::string> report = InspectMapperDir(args[0]);
  if (!report.ok()) {
    std::fprintf(stderr, "kvt inspect: %s\n", report.status().ToString().c_str());
    return 2;
  }
  std::printf("%s", report->c_str());
  return 0;
}

int RunRecordBenefit(const std::vector<std::string>& args) {
  const std::string dir = absl::GetFlag(FLAGS_mapper);
  const std::string benefit = absl::GetFlag(FLAGS_benefit);
  if (!args.empty() || dir.empty() || benefit.empty()) {
    std::fprintf(stderr, "usage: kvt record-benefit --mapper=DIR --benefit=FILE.json\n");
    return 1;
  }
  absl::StatusOr<std::vector<BenefitRecord>> merged = RecordBenefit(dir, benefit);
  if (!merged.ok()) {
    std::fprintf(stderr, "kvt record-benefit: %s (the mapper is unchanged)\n",
                 merged.status().ToString().c_str());
    return 2;
  }
  std::printf("%s: quality.benefit now records %zu text%s\n", dir.c_str(), merged->size(),
              merged->size() == 1 ? "" : "s");
  for (const BenefitRecord& record : *merged) {
    std::printf("  %s\n", DescribeBenefit(record).c_str());
  }
  return 0;
}

}  // namespace cli
}  // namespace kvt
