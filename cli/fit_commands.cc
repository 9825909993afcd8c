// `kvt fit` and `kvt fit merge`: calibration dumps -> mapper directory (docs/FIT.md).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/command_table.h"
#include "cli/commands.h"
#include "fit/calibration.h"
#include "fit/fit.h"
#include "fit/report.h"
#include "kernels/types.h"
#include "mapper_store/format/manifest.h"
#include "mapper_store/mapper.h"

ABSL_FLAG(std::string, source_config, "",
          "kvt fit / import: the source model's Hugging Face config.json (or its directory).");
ABSL_FLAG(std::string, target_config, "", "kvt fit / import: the target model's config.json.");
ABSL_FLAG(std::string, source_dumps, "",
          "kvt fit: directory of source KV dumps (*.safetensors, one per sequence).");
ABSL_FLAG(std::string, target_dumps, "",
          "kvt fit: directory of target KV dumps with the same file names.");
ABSL_FLAG(std::string, pairs, "",
          "kvt fit: instead of the two directories, a list file of 'SOURCE TARGET' lines.");
ABSL_FLAG(int32_t, stride, 4, "kvt fit: keep every stride-th token position.");
ABSL_FLAG(std::string, top_k, "8",
          "kvt fit: source layers per target layer, an integer or 'all'.");
ABSL_FLAG(int32_t, window, 1,
          "kvt fit / synth: tokens each output token reads (a window mapper: the chosen source layers at "
          "p, p-1, ..., p-window+1); 1: the token-wise map of SPEC 3.");
ABSL_FLAG(double, lambda, 0.01, "kvt fit / merge: ridge penalty.");
ABSL_FLAG(std::string, lambda_scale, "covariance",
          "kvt fit / merge: where lambda is added: covariance (S_xx = X^T X / N) or sum "
          "(X^T X).");
ABSL_FLAG(double, heldout_fraction, 0.1,
          "kvt fit: share of sequences held out (chosen by a hash of --seed and file name).");
ABSL_FLAG(std::string, heldout_split, "hash",
          "kvt fit: which sequences are held out: hash (a hash of --seed and file name) or tail "
          "(the list's last ones: dumps in corpus order hold out its last documents).");
ABSL_FLAG(std::string, corpus, "", "kvt fit: what the calibration text was (recorded).");
ABSL_FLAG(bool, partial, false,
          "kvt fit: write this shard's statistics to --out (a file) instead of a mapper.");
ABSL_FLAG(std::string, shard, "",
          "kvt fit: 'i/n': use only sequences i, i+n, ... of the calibration set.");
ABSL_FLAG(std::string, plan, "",
          "kvt fit: a plan from `kvt fit merge` of probe shards: skip the probe pass.");
ABSL_FLAG(int32_t, threads, 0, "kvt fit / merge: OpenBLAS threads (0: every core).");
ABSL_FLAG(int32_t, chunk_mb, 256, "kvt fit: MiB of feature rows buffered per BLAS round.");
ABSL_FLAG(std::string, kind, "ridge",
          "kvt fit: ridge (closed form), mlp (trained chains), or both (fits both into "
          "--out/ridge and --out/mlp and recommends one from the held-out attention-output "
          "cosine; needs target dumps with queries: tools/dump_kv.py --queries). "
          "kvt synth: ridge or mlp (random weights).");
ABSL_FLAG(int64_t, mlp_hidden, 1024,
          "kvt fit --kind mlp|both, synth --kind=mlp: hidden width H of both layers.");
ABSL_FLAG(int32_t, mlp_epochs, 20, "kvt fit --kind mlp|both: Adam epochs over the training rows.");
ABSL_FLAG(int64_t, mlp_batch, 4096, "kvt fit --kind mlp|both: rows per Adam step.");
ABSL_FLAG(double, mlp_lr, 1e-3, "kvt fit --kind mlp|both: Adam learning rate.");
ABSL_FLAG(std::string, mlp_granularity, "per_layer",
          "kvt fit --kind mlp|both, synth --kind=mlp: per_layer (one chain per target layer and "
          "K|V) or per_head "
          "(one per target head, the paper).");
ABSL_FLAG(bool, mlp_keep_best_epoch, false,
          "kvt fit --kind mlp|both: return each chain at the epoch with the lowest loss on the "
          "held-out sequences, not after the last epoch (false: the last).");
ABSL_FLAG(int64_t, mlp_max_observations, 200000,
          "kvt fit --kind mlp|both: training rows per chain (a seeded subsample beyond; 0: all).");
ABSL_FLAG(std::string, refine, "none",
          "kvt fit: none, or attention (Adam from the closed-form ridge, or the MSE-trained MLP, "
          "on the error of the target's attention outputs under its own queries; --kind both "
          "refines both; needs training target dumps with queries: tools/dump_kv.py --queries). "
          "The mapper keeps its kind.");
ABSL_FLAG(int32_t, refine_steps, 100, "kvt fit --refine=attention: Adam steps.");
ABSL_FLAG(int32_t, refine_batch, 2, "kvt fit --refine=attention: sequences per step.");
ABSL_FLAG(int32_t, refine_queries, 16,
          "kvt fit --refine=attention: query tokens per sequence and step (a seeded sample; "
          "0: every token).");
ABSL_FLAG(std::string, refine_queries_from, "handoff",
          "kvt fit --refine=attention: handoff (queries after a seeded boundary read the mapped "
          "keys before it and the target's own from it on, as after a real handoff) or prefix "
          "(queries inside the mapped prefix, reading mapped keys only).");
ABSL_FLAG(int64_t, refine_cache_mb, 1024,
          "kvt fit --refine=attention: training sequences kept in memory after their first "
          "read, up to this many MiB; the rest is re-read from disk when it comes up again.");
ABSL_FLAG(double, refine_lr, 0.003,
          "kvt fit --refine=attention: Adam step size, relative to each tensor's RMS.");
ABSL_FLAG(double, refine_mlp_lr, 0.001,
          "kvt fit --kind mlp|both --refine=attention: the MLP's Adam step size, relative to "
          "each tensor's RMS.");
ABSL_FLAG(int32_t, refine_mlp_steps, 300,
          "kvt fit --kind mlp|both --refine=attention: the MLP's Adam steps.");
ABSL_FLAG(int32_t, refine_mlp_batch, 4,
          "kvt fit --kind mlp|both --refine=attention: the MLP's sequences per step.");
ABSL_FLAG(int32_t, refine_mlp_queries, 64,
          "kvt fit --kind mlp|both --refine=attention: the MLP's query tokens per sequence and "
          "step (0: every token).");
ABSL_FLAG(std::string, unrefined_mlp_out, "",
          "kvt fit --kind mlp|both --refine=attention: also write the MSE-trained MLP as it was "
          "before refinement to this mapper directory (no second training).");
ABSL_FLAG(bool, overwrite, false,
          "kvt fit / merge / import: replace an existing mapper directory.");

ABSL_FLAG(std::string, granularity, "per_layer",
          "kvt fit / merge: the ridge's granularity: per_layer (every target head from the whole "
          "gathered row), per_head (head-local: each target head from its matching source heads; "
          "n_kv times fewer bytes and FLOPs), or both (kvt fit only: fits both into "
          "--out/per_layer and --out/per_head and recommends one from the held-out "
          "attention-output cosine; needs target dumps with queries).");
ABSL_FLAG(std::string, per_head_objective, "auto",
          "kvt fit --granularity per_head|both: the head-local ridge's objective: mse, "
          "attention_weighted (each token's residual weighted by the attention mass the "
          "target's own queries give it; needs training target dumps with queries), or auto "
          "(attention_weighted when the first training target dump has queries, else mse).");
ABSL_FLAG(std::string, per_head_probe, "full",
          "kvt fit / merge --granularity per_head: how unmatched KV shapes rank source layers: "
          "full (each target head on the whole source layer) or head_local (on its matching "
          "source heads only).");
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, weight_dtype);
ABSL_DECLARE_FLAG(int32_t, k);
ABSL_DECLARE_FLAG(std::string, source_model);
ABSL_DECLARE_FLAG(std::string, target_model);

namespace kvt {
namespace cli {
namespace {

int Fail(const std::string& message, int code = 2) {
  std::fprintf(stderr, "kvt fit: %s\n", message.c_str());
  return code;
}

// --granularity: per_layer or per_head into `options`; both only where `both` is given (kvt
// fit, not merge), which is then set.
absl::Status GranularityFromFlags(fit::SolveOptions* options, bool* both) {
  const std::string granularity = absl::GetFlag(FLAGS_granularity);
  if (granularity == "both" && both != nullptr) {
    *both = true;
    return absl::OkStatus();
  }
  std::optional<RidgeGranularity> parsed = ParseRidgeGranularity(granularity);
  if (!parsed.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--granularity must be per_layer or per_head", both != nullptr ? " or both" : "",
        ", got '", granularity, "'"));
  }
  options->ridge.per_head = *parsed == RidgeGranularity::kPerHead;
  return absl::OkStatus();
}

// --per_head_probe: whether a per_head fit probes unmatched shapes head-locally.
absl::StatusOr<bool> HeadLocalProbeFromFlags(bool per_head) {
  const std::string probe = absl::GetFlag(FLAGS_per_head_probe);
  if (probe != "full" && probe != "head_local") {
    return absl::InvalidArgumentError(
        absl::StrCat("--per_head_probe must be full or head_local, got '", probe, "'"));
  }
  if (probe == "head_local" && !per_head) {
    return absl::InvalidArgumentError("--per_head_probe=head_local needs --granularity per_head");
  }
  return probe == "head_local";
}

// --per_head_objective into ridge->attention_weighted for a head-local fit (per_head, or
// `granularity_both`): mse, attention_weighted, or auto (attention_weighted when the first
// training target dump of `sequences` has queries; the choice is printed).
absl::Status ObjectiveFromFlags(bool granularity_both,
                                const std::vector<fit::SequencePair>& sequences,
                                const ModelSpec& target, fit::RidgeOptions* ridge) {
  const std::string objective = absl::GetFlag(FLAGS_per_head_objective);
  if (objective != "mse" && objective != "attention_weighted" && objective != "auto") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--per_head_objective must be mse, attention_weighted or auto, got '", objective, "'"));
  }
  const bool head_local = ridge->per_head || granularity_both;
  if (objective == "attention_weighted" && !head_local) {
    return absl::InvalidArgumentError(
        "--per_head_objective=attention_weighted needs --granularity per_head or both");
  }
  ridge->attention_weighted = head_local && objective == "attention_weighted";
  if (head_local && objective == "auto") {
    for (const fit::SequencePair& pair : sequences) {
      if (pair.heldout) continue;
      absl::StatusOr<fit::DumpQueries> q = fit::ReadDumpQueries(pair.target_path, target);
      if (!q.ok() && !absl::IsNotFound(q.status())) return q.status();
      ridge->attention_weighted = q.ok();
      std::printf("--per_head_objective=auto: %s\n",
                  q.ok() ? "attention_weighted (the target dumps carry queries)"
                         : "mse (the target dumps carry no queries)");
      break;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<fit::SolveOptions> SolveOptionsFromFlags(bool* granularity_both = nullptr) {
  fit::SolveOptions options;
  if (absl::Status g = GranularityFromFlags(&options, granularity_both); !g.ok()) return g;
  options.ridge.lambda = absl::GetFlag(FLAGS_lambda);
  if (!(options.ridge.lambda >= 0)) {
    return absl::InvalidArgumentError("--lambda must be >= 0");
  }
  const std::string scale = absl::GetFlag(FLAGS_lambda_scale);
  if (scale == "covariance") {
    options.ridge.scale = LambdaScale::kCovariance;
  } else if (scale == "sum") {
    options.ridge.scale = LambdaScale::kSum;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--lambda_scale must be covariance or sum, got '", scale, "'"));
  }
  const std::string dtype = absl::GetFlag(FLAGS_weight_dtype);
  if (!dtype.empty()) {
    absl::StatusOr<DType> parsed = ParseDType(dtype);
    if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat("--weight_dtype: ", parsed.status().message()));
    options.weight_dtype = *parsed;
  }
  options.overwrite = absl::GetFlag(FLAGS_overwrite);
  return options;
}

void PrintSummary(const fit::FitResult& result) {
  const Manifest& m = result.manifest;
  std::printf("wrote %s (%s -> %s, k = %d%s)\n", result.mapper_dir.c_str(),
              m.source.name.c_str(), m.target.name.c_str(), m.k,
              m.window > 1 ? absl::StrCat(", window = ", m.window).c_str() : "");
  std::printf("report: %s\n", result.report_path.c_str());
  auto show = [&](fit::R2Field field) {
    std::optional<double> all = fit::MeanR2(m, field, false);
    std::optional<double> without = fit::MeanR2(m, field, true);
    return absl::StrCat(all ? absl::StrFormat("%.4f", *all) : "-", " (",
                        without ? absl::StrFormat("%.4f", *without) : "-", ")");
  };
  std::printf("mean R^2 (without layer 0): K %s  V %s  held-out K %s  V %s\n",
              show(fit::R2Field::kK).c_str(), show(fit::R2Field::kV).c_str(),
              show(fit::R2Field::kKHeldout).c_str(), show(fit::R2Field::kVHeldout).c_str());
  for (const std::string& w : result.warnings) std::printf("warning: %s\n", w.c_str());
}

int RunGranularityBoth(const fit::FitOptions& options, const std::string& out,
                       const fit::StatSet* plan) {
  absl::StatusOr<fit::GranularityResult> both = fit::RunFitGranularityBoth(options, out, plan);
  if (!both.ok()) return Fail(both.status().ToString());
  PrintSummary(both->per_layer);
  PrintSummary(both->per_head);
  const fit::HeldoutQuality& q = *both->per_layer.heldout;
  std::printf("held-out (%d sequences, %lld tokens)   attention-output cosine without layer 0 "
              "[95%% lower bound] (all layers)   mapper bytes   solve+measure (s)\n",
              q.sequences, static_cast<long long>(q.tokens));
  for (const fit::FitResult* r : {&both->per_layer, &both->per_head}) {
    const fit::HeldoutQuality& h = *r->heldout;
    std::printf("  %-9s %.4f [%s] (%.4f)   %llu   %.2f\n",
                RidgeGranularityName(r->manifest.ridge_granularity),
                h.attention_cosine_without_layer0,
                h.attention_cosine_lower95 ? absl::StrFormat("%.4f", *h.attention_cosine_lower95).c_str()
                                           : "-",
                h.attention_cosine, static_cast<unsigned long long>(MapperWeightBytes(r->manifest)),
                r == &both->per_layer ? both->per_layer_seconds : both->per_head_seconds);
  }
  std::printf("per_head minus per_layer: %+.4f [%s, %s] (paired, 95%%)\n", both->difference,
              both->difference_lower95 ? absl::StrFormat("%+.4f", *both->difference_lower95).c_str()
                                       : "-",
              both->difference_upper95 ? absl::StrFormat("%+.4f", *both->difference_upper95).c_str()
                                       : "-");
  std::printf("recommended: %s (%s)\n", both->recommended.c_str(),
              (both->recommended == "per_head" ? both->per_head : both->per_layer)
                  .mapper_dir.c_str());
  std::printf("comparison: %s\n", both->report_json_path.c_str());
  return 0;
}

int RunMerge(const std::vector<std::string>& shards) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty() || shards.empty()) return Fail(CommandUsage("fit"), 1);
  absl::StatusOr<fit::SolveOptions> solve = SolveOptionsFromFlags();
  if (!solve.ok()) return Fail(std::string(solve.status().message()), 1);
  fit::SetBlasThreads(absl::GetFlag(FLAGS_threads));
  absl::StatusOr<fit::StatSet> merged = fit::MergeStatFiles(shards);
  if (!merged.ok()) return Fail(merged.status().ToString());
  const std::string phase = merged->metadata["kvt_fit_phase"];
  if (phase == "probe") {
    std::vector<std::string> warnings;
    absl::StatusOr<bool> local = HeadLocalProbeFromFlags(solve->ridge.per_head);
    if (!local.ok()) return Fail(std::string(local.status().message()), 1);
    absl::StatusOr<fit::StatSet> plan = fit::MakePlan(*merged, &warnings, *local);
    if (!plan.ok()) return Fail(plan.status().ToString());
    absl::Status written = fit::WriteStatSet(out, *plan);
    if (!written.ok()) return Fail(written.ToString());
    for (const std::string& w : warnings) std::printf("warning: %s\n", w.c_str());
    std::printf("wrote plan %s from %zu probe shards; next: kvt fit --partial --plan=%s ... "
                "on each shard, then kvt fit merge\n",
                out.c_str(), shards.size(), out.c_str());
    return 0;
  }
  if (phase != "final") {
    return Fail(absl::StrCat("cannot merge statistics of phase '", phase,
                             "' (expected probe or final shards)"));
  }
  // Shards accumulated with --per_head_objective=attention_weighted carry its arrays.
  const auto objective = merged->metadata.find("per_head_objective");
  solve->ridge.attention_weighted = solve->ridge.per_head &&
                                    objective != merged->metadata.end() &&
                                    objective->second == "attention_weighted";
  absl::StatusOr<fit::FitResult> result = fit::SolveAndWrite(*merged, *solve, out);
  if (!result.ok()) return Fail(result.status().ToString());
  PrintSummary(*result);
  return 0;
}

}  // namespace

int RunFit(const std::vector<std::string>& args) {
  if (!args.empty() && args[0] == "merge") {
    return RunMerge(std::vector<std::string>(args.begin() + 1, args.end()));
  }
  if (!args.empty()) {
    return Fail(absl::StrCat("unexpected argument '", args[0], "'\n", CommandUsage("fit")), 1);
  }
  if (absl::GetFlag(FLAGS_k) != -1) {
    return Fail("use --top_k (an integer or 'all') with kvt fit; --k belongs to kvt synth", 1);
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty() || absl::GetFlag(FLAGS_source_config).empty() ||
      absl::GetFlag(FLAGS_target_config).empty()) {
    return Fail(absl::StrCat("--source_config, --target_config and --out are required\n",
                             CommandUsage("fit")),
                1);
  }
  fit::FitOptions options;
  absl::StatusOr<fit::SolveOptions> solve = SolveOptionsFromFlags(&options.granularity_both);
  if (!solve.ok()) return Fail(std::string(solve.status().message()), 1);
  options.solve = *solve;
  absl::StatusOr<bool> local_probe = HeadLocalProbeFromFlags(options.solve.ridge.per_head);
  if (!local_probe.ok()) return Fail(std::string(local_probe.status().message()), 1);
  options.head_local_probe = *local_probe;
  const std::string top_k = absl::GetFlag(FLAGS_top_k);
  if (top_k == "all") {
    options.k = 0;
  } else if (!absl::SimpleAtoi(top_k, &options.k) || options.k < 1) {
    return Fail(absl::StrCat("--top_k must be a positive integer or 'all', got '", top_k, "'"), 1);
  }
  options.stride = absl::GetFlag(FLAGS_stride);
  if (options.stride < 1) return Fail("--stride must be >= 1", 1);
  options.window = absl::GetFlag(FLAGS_window);
  if (options.window < 1 || options.window > kMaxMapperWindow) {
    return Fail(absl::StrCat("--window must be between 1 and ", kMaxMapperWindow, ", got ",
                             options.window),
                1);
  }
  options.heldout_fraction = absl::GetFlag(FLAGS_heldout_fraction);
  if (!(options.heldout_fraction >= 0 && options.heldout_fraction < 1)) {
    return Fail("--heldout_fraction must be in [0, 1)", 1);
  }
  options.seed = absl::GetFlag(FLAGS_seed);
  const std::string kind = absl::GetFlag(FLAGS_kind);
  if (kind == "ridge") {
    options.kind = fit::FitKind::kRidge;
  } else if (kind == "mlp") {
    options.kind = fit::FitKind::kMlp;
  } else if (kind == "both") {
    options.kind = fit::FitKind::kBoth;
  } else {
    return Fail(absl::StrCat("--kind must be ridge, mlp or both, got '", kind, "'"), 1);
  }
  options.mlp.train.hidden = absl::GetFlag(FLAGS_mlp_hidden);
  options.mlp.train.epochs = absl::GetFlag(FLAGS_mlp_epochs);
  options.mlp.train.batch = absl::GetFlag(FLAGS_mlp_batch);
  options.mlp.train.learning_rate = absl::GetFlag(FLAGS_mlp_lr);
  options.mlp.train.seed = options.seed;
  options.mlp.train.max_observations = absl::GetFlag(FLAGS_mlp_max_observations);
  options.mlp.train.keep_best_epoch = absl::GetFlag(FLAGS_mlp_keep_best_epoch);
  if (options.mlp.train.max_observations < 0) {
    return Fail("--mlp_max_observations must be >= 0 (0: all)", 1);
  }
  const std::string granularity = absl::GetFlag(FLAGS_mlp_granularity);
  if (std::optional<MlpGranularity> parsed = ParseMlpGranularity(granularity)) {
    options.mlp.granularity = *parsed;
  } else {
    return Fail(absl::StrCat("--mlp_granularity must be per_layer or per_head, got '",
                             granularity, "'"), 1);
  }
  if (absl::Status valid = fit::ValidateMlpOptions(options.mlp.train); !valid.ok()) {
    return Fail(std::string(valid.message()), 1);
  }
  const std::string refine = absl::GetFlag(FLAGS_refine);
  if (refine != "none" && refine != "attention") {
    return Fail(absl::StrCat("--refine must be none or attention, got '", refine, "'"), 1);
  }
  options.refine.attention = refine == "attention";
  options.refine.steps = absl::GetFlag(FLAGS_refine_steps);
  options.refine.batch = absl::GetFlag(FLAGS_refine_batch);
  options.refine.queries = absl::GetFlag(FLAGS_refine_queries);
  const std::string queries_from = absl::GetFlag(FLAGS_refine_queries_from);
  if (queries_from != "handoff" && queries_from != "prefix") {
    return Fail(absl::StrCat("--refine_queries_from must be handoff or prefix, got '",
                             queries_from, "'"), 1);
  }
  options.refine.handoff = queries_from == "handoff";
  const int64_t cache_mb = absl::GetFlag(FLAGS_refine_cache_mb);
  if (cache_mb < 0 || cache_mb > (int64_t{1} << 40)) {
    return Fail(absl::StrCat("--refine_cache_mb must be in [0, 2^40], got ", cache_mb), 1);
  }
  options.refine.cache_bytes = cache_mb << 20;
  options.refine.learning_rate = absl::GetFlag(FLAGS_refine_lr);
  options.refine.mlp_steps = absl::GetFlag(FLAGS_refine_mlp_steps);
  options.refine.mlp_batch = absl::GetFlag(FLAGS_refine_mlp_batch);
  options.refine.mlp_queries = absl::GetFlag(FLAGS_refine_mlp_queries);
  options.refine.mlp_learning_rate = absl::GetFlag(FLAGS_refine_mlp_lr);
  options.refine.seed = options.seed;
  options.refine.unrefined_mlp_out = absl::GetFlag(FLAGS_unrefined_mlp_out);
  if ((options.granularity_both || options.solve.ridge.per_head) &&
      options.kind != fit::FitKind::kRidge && options.kind != fit::FitKind::kBoth) {
    return Fail("--granularity is the ridge's; --kind mlp has --mlp_granularity", 1);
  }
  if (options.granularity_both && options.kind != fit::FitKind::kRidge) {
    return Fail("--granularity both compares the ridge's granularities; with --kind both use "
                "--granularity per_layer or per_head", 1);
  }
  if (!options.refine.unrefined_mlp_out.empty() &&
      (!options.refine.attention || options.kind == fit::FitKind::kRidge)) {
    return Fail("--unrefined_mlp_out needs --kind mlp|both and --refine=attention", 1);
  }
  if (options.refine.attention) {
    if (absl::Status valid = fit::ValidateRefineOptions(options.refine); !valid.ok()) {
      return Fail(std::string(valid.message()), 1);
    }
  }
  options.corpus = absl::GetFlag(FLAGS_corpus);
  options.num_threads = absl::GetFlag(FLAGS_threads);
  options.chunk_bytes = int64_t{std::max(1, absl::GetFlag(FLAGS_chunk_mb))} << 20;

  absl::StatusOr<fit::FitModel> source =
      fit::LoadFitModel(absl::GetFlag(FLAGS_source_config), absl::GetFlag(FLAGS_source_model));
  if (!source.ok()) return Fail(source.status().ToString());
  absl::StatusOr<fit::FitModel> target =
      fit::LoadFitModel(absl::GetFlag(FLAGS_target_config), absl::GetFlag(FLAGS_target_model));
  if (!target.ok()) return Fail(target.status().ToString());
  options.source = *source;
  options.target = *target;

  absl::StatusOr<std::vector<fit::SequencePair>> pairs;
  if (!absl::GetFlag(FLAGS_pairs).empty()) {
    pairs = fit::PairsFromListFile(absl::GetFlag(FLAGS_pairs));
  } else if (!absl::GetFlag(FLAGS_source_dumps).empty() &&
             !absl::GetFlag(FLAGS_target_dumps).empty()) {
    pairs = fit::PairsFromDirs(absl::GetFlag(FLAGS_source_dumps),
                               absl::GetFlag(FLAGS_target_dumps));
  } else {
    return Fail(absl::StrCat("give --source_dumps and --target_dumps, or --pairs\n",
                             CommandUsage("fit")),
                1);
  }
  if (!pairs.ok()) return Fail(pairs.status().ToString());
  absl::StatusOr<fit::HeldoutSplit> split = fit::ParseHeldoutSplit(absl::GetFlag(FLAGS_heldout_split));
  if (!split.ok()) return Fail(std::string(split.status().message()), 1);
  options.heldout_split = *split;
  fit::AssignHeldout(options.heldout_fraction, options.seed, &*pairs, options.heldout_split);
  options.sequences = *pairs;
  if (absl::Status o = ObjectiveFromFlags(options.granularity_both, options.sequences,
                                          options.target.spec, &options.solve.ridge);
      !o.ok()) {
    return Fail(std::string(o.message()), absl::IsInvalidArgument(o) ? 1 : 2);
  }
  const std::string shard = absl::GetFlag(FLAGS_shard);
  if (!shard.empty()) {
    std::vector<std::string> parts = absl::StrSplit(shard, '/');
    int index = -1, count = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &index) ||
        !absl::SimpleAtoi(parts[1], &count) || count < 1 || index < 0 || index >= count) {
      return Fail(absl::StrCat("--shard must be i/n with 0 <= i < n, got '", shard, "'"), 1);
    }
    options.sequences = fit::SelectShard(options.sequences, index, count);
  }

  std::unique_ptr<fit::StatSet> plan;
  if (!absl::GetFlag(FLAGS_plan).empty()) {
    absl::StatusOr<fit::StatSet> read = fit::ReadStatSet(absl::GetFlag(FLAGS_plan));
    if (!read.ok()) return Fail(read.status().ToString());
    plan = std::make_unique<fit::StatSet>(std::move(*read));
  }

  if (absl::GetFlag(FLAGS_partial) && options.refine.attention) {
    return Fail("--refine=attention reads the sequences themselves, which `kvt fit merge` has "
                "not: fit in one run", 1);
  }
  if (absl::GetFlag(FLAGS_partial) && options.kind != fit::FitKind::kRidge) {
    return Fail("--partial shards the ridge statistics only; --kind mlp|both trains on the rows "
                "of one run", 1);
  }
  if (absl::GetFlag(FLAGS_partial)) {
    absl::StatusOr<fit::StatSet> stats =
        plan ? fit::AccumulateFinal(options, *plan) : fit::AccumulateProbe(options);
    if (!stats.ok()) return Fail(stats.status().ToString());
    stats->metadata["shard"] = shard;
    absl::Status written = fit::WriteStatSet(out, *stats);
    if (!written.ok()) return Fail(written.ToString());
    std::printf("wrote %s statistics of %zu sequences to %s\n", plan ? "final" : "probe",
                options.sequences.size(), out.c_str());
    return 0;
  }
  if (!shard.empty()) return Fail("--shard only makes sense with --partial", 1);
  if (options.granularity_both) return RunGranularityBoth(options, out, plan.get());
  if (options.kind == fit::FitKind::kBoth) {
    absl::StatusOr<fit::BothResult> both = fit::RunFitBoth(options, out, plan.get());
    if (!both.ok()) return Fail(both.status().ToString());
    PrintSummary(both->ridge);
    PrintSummary(both->mlp);
    if (both->mlp_unrefined.has_value()) PrintSummary(*both->mlp_unrefined);
    std::printf("held-out (%d sequences, %lld tokens)   attention-output cosine (without layer 0)"
                "   c_K     c_V\n",
                both->ridge_quality.sequences,
                static_cast<long long>(both->ridge_quality.tokens));
    for (const auto& [name, q] : {std::pair<const char*, const fit::HeldoutQuality*>{
                                      "ridge", &both->ridge_quality},
                                  {"mlp", &both->mlp_quality}}) {
      std::printf("  %-5s %.4f (%.4f)   %.3f   %.3f\n", name, q->attention_cosine,
                  q->attention_cosine_without_layer0, q->c_k, q->c_v);
    }
    std::printf("recommended: %s (%s): higher held-out attention-output cosine\n",
                both->recommended.c_str(),
                (both->recommended == "mlp" ? both->mlp : both->ridge).mapper_dir.c_str());
    std::printf("comparison: %s\n", both->report_json_path.c_str());
    return 0;
  }
  absl::StatusOr<fit::FitResult> result = fit::RunFit(options, out, plan.get());
  if (!result.ok()) return Fail(result.status().ToString());
  PrintSummary(*result);
  return 0;
}

}  // namespace cli
}  // namespace kvt
