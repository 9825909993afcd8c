// `kvt import`: a mapper written by another project -> a kvt mapper directory.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "cli/command_table.h"
#include "cli/commands.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"
#include "mapper_store/import_semantic_router.h"
#include "mapper_store/inspect.h"

ABSL_FLAG(std::string, format, "", "kvt import: the input's format: semantic-router.");
ABSL_FLAG(int32_t, source_num_layers, 0,
          "kvt import without --source_config: the source model's layer count.");
ABSL_FLAG(int32_t, target_num_layers, 0,
          "kvt import without --target_config: the target's layer count (0: the manifest's).");
ABSL_FLAG(double, source_rope_theta, 0,
          "kvt import without --source_config: the source's RoPE theta (neox, whole head).");
ABSL_FLAG(double, target_rope_theta, 0,
          "kvt import without --target_config: the target's RoPE theta (neox, whole head).");

ABSL_DECLARE_FLAG(std::string, in);
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(std::string, source_config);
ABSL_DECLARE_FLAG(std::string, target_config);
ABSL_DECLARE_FLAG(bool, overwrite);
ABSL_DECLARE_FLAG(std::string, weight_dtype);
ABSL_DECLARE_FLAG(std::string, source_model);
ABSL_DECLARE_FLAG(std::string, target_model);

namespace kvt {
namespace cli {
namespace {

int Fail(const std::string& message, int code = 2) {
  std::fprintf(stderr, "kvt import: %s\n", message.c_str());
  return code;
}

}  // namespace

int RunImport(const std::vector<std::string>& args) {
  if (!args.empty()) {
    return Fail(absl::StrCat("unexpected argument '", args[0], "'\n", CommandUsage("import")),
                1);
  }
  const std::string format = absl::GetFlag(FLAGS_format);
  const std::string in = absl::GetFlag(FLAGS_in);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (format.empty() || in.empty() || out.empty()) {
    return Fail(absl::StrCat("--format, --in and --out are required\n", CommandUsage("import")), 1);
  }
  if (format != "semantic-router") {
    return Fail(absl::StrCat("--format '", format, "' is not supported (semantic-router)"), 1);
  }
  SemanticRouterImportOptions options;
  options.source_config = absl::GetFlag(FLAGS_source_config);
  options.target_config = absl::GetFlag(FLAGS_target_config);
  options.source_name = absl::GetFlag(FLAGS_source_model);
  options.target_name = absl::GetFlag(FLAGS_target_model);
  options.overwrite = absl::GetFlag(FLAGS_overwrite);
  // The artifact stores no RoPE and no source layer count: without a config.json they must be
  // given, never defaulted, or a wrong theta would silently corrupt every translated key.
  if (options.source_config.empty()) {
    const int layers = absl::GetFlag(FLAGS_source_num_layers);
    const double theta = absl::GetFlag(FLAGS_source_rope_theta);
    if (layers < 1 || !(theta > 0)) {
      return Fail(
          "give --source_config, or --source_num_layers and --source_rope_theta (the "
          "semantic-router artifact stores neither)",
          1);
    }
    options.source_spec = NeoxModelSpec("", layers, 0, 0, theta);
  }
  if (options.target_config.empty()) {
    const int layers = absl::GetFlag(FLAGS_target_num_layers);
    const double theta = absl::GetFlag(FLAGS_target_rope_theta);
    if (layers < 0 || !(theta > 0)) {
      return Fail(
          "give --target_config, or --target_rope_theta (and optionally "
          "--target_num_layers; the semantic-router artifact stores no RoPE settings)",
          1);
    }
    options.target_spec = NeoxModelSpec("", layers, 0, 0, theta);
  }
  const std::string dtype = absl::GetFlag(FLAGS_weight_dtype);
  if (!dtype.empty()) {
    absl::StatusOr<DType> parsed = ParseDType(dtype);
    if (!parsed.ok()) return Fail(absl::StrCat("--weight_dtype: ", parsed.status().message()), 1);
    options.weights_dtype = *parsed;
  }
  absl::StatusOr<SemanticRouterImportResult> result = ImportSemanticRouterMapper(in, out, options);
  if (!result.ok()) return Fail(result.status().ToString());
  std::printf(
      "imported semantic-router mapper %s (%s) from %s\n", result->original.mapper_id.c_str(),
      result->original.variant == SemanticRouterVariant::kPerHead ? "per_head" : "full_head",
      in.c_str());
  absl::StatusOr<std::string> report = InspectMapperDir(out);
  if (!report.ok()) {
    return Fail(
        absl::StrCat("wrote ", out, " but cannot read it back: ", report.status().ToString()));
  }
  std::printf("%s", report->c_str());
  return 0;
}

}  // namespace cli
}  // namespace kvt
