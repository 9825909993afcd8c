// `kvt fit --granularity both`: the ridge per target layer and head-local (per_head) from the
// same statistics, compared on the held-out attention-output cosine as served.
#include <chrono>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "fit/fit.h"
#include "fit/fit_internal.h"
#include "nlohmann/json.hpp"
#include "quality/mean_interval.h"

namespace kvt {
namespace fit {
namespace {

using nlohmann::json;

// Solves and writes one granularity; `seconds` gets its wall time.
absl::StatusOr<FitResult> SolveGranularity(const StatSet& final_stats, const FitOptions& options,
                                           bool per_head, const std::string& out_dir,
                                           const std::vector<std::string>& warnings,
                                           double* seconds) {
  const auto start = std::chrono::steady_clock::now();
  FitOptions one = options;
  one.solve.ridge.per_head = per_head;
  absl::StatusOr<FitResult> result =
      SolveAndWrite(final_stats, one.solve, out_dir, warnings, &one);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (result.ok() && !result->heldout.has_value()) {
    return absl::InternalError(absl::StrCat("kvt fit --granularity both: ", out_dir,
                                            " was written without its held-out quality"));
  }
  return result;
}

// Fills the difference, its bounds and the recommendation (fit.h says the rule).
void Recommend(GranularityResult* r) {
  const std::vector<double>& layer = r->per_layer.heldout->sequence_attention_cosine;
  const std::vector<double>& head = r->per_head.heldout->sequence_attention_cosine;
  std::vector<double> layer_minus_head(layer.size());
  for (size_t i = 0; i < layer.size(); ++i) layer_minus_head[i] = layer[i] - head[i];
  const MeanInterval loss = MeanWithLowerBound(layer_minus_head);
  r->difference = -loss.mean;
  if (loss.lower95.has_value()) {
    r->difference_upper95 = -*loss.lower95;
    std::vector<double> head_minus_layer(layer_minus_head);
    for (double& x : head_minus_layer) x = -x;
    r->difference_lower95 = MeanWithLowerBound(head_minus_layer).lower95;
    r->recommended = *loss.lower95 > 0 ? "per_layer" : "per_head";
  } else {
    r->recommended = loss.mean > 1e-4 ? "per_layer" : "per_head";
  }
}

json ReportJson(const GranularityResult& r, const FitOptions& options) {
  auto round = [](double x) { return std::round(x * 1e6) / 1e6; };
  json difference{{"mean", round(r.difference)}};
  if (r.difference_lower95) difference["lower95"] = round(*r.difference_lower95);
  if (r.difference_upper95) difference["upper95"] = round(*r.difference_upper95);
  json per_layer = QualityJson(*r.per_layer.heldout, r.per_layer);
  json per_head = QualityJson(*r.per_head.heldout, r.per_head);
  per_layer["seconds"] = std::round(r.per_layer_seconds * 100) / 100;
  per_head["seconds"] = std::round(r.per_head_seconds * 100) / 100;
  for (auto [j, fit] : {std::pair<json*, const FitResult*>{&per_layer, &r.per_layer},
                        {&per_head, &r.per_head}}) {
    if (fit->heldout->attention_cosine_lower95) {
      (*j)["attention_cosine_without_layer0_lower95"] =
          round(*fit->heldout->attention_cosine_lower95);
    }
    (*j)["granularity"] = fit == &r.per_layer ? "per_layer" : "per_head";
  }
  return json{
      {"recommended", r.recommended},
      {"recommended_mapper",
       (r.recommended == "per_head" ? r.per_head : r.per_layer).mapper_dir},
      {"criterion",
       "held-out attention-output cosine without layer 0, paired over held-out sequences: "
       "per_head (the cheaper map) unless per_layer is better beyond the one-sided 95% bound "
       "of the difference (with under 2 sequences: higher mean, per_head on a tie within 1e-4)"},
      {"refined", options.refine.attention},
      {"heldout_sequences", r.per_layer.heldout->sequences},
      {"heldout_tokens", r.per_layer.heldout->tokens},
      {"per_head_minus_per_layer", difference},
      {"per_layer", per_layer},
      {"per_head", per_head}};
}

}  // namespace

absl::StatusOr<GranularityResult> RunFitGranularityBoth(const FitOptions& options,
                                                        const std::string& out_dir,
                                                        const StatSet* plan_in) {
  if (options.kind != FitKind::kRidge) {
    return absl::InvalidArgumentError(
        "--granularity both compares ridge granularities: it needs --kind ridge");
  }
  absl::Status heads = CheckHeadMatching(FitShape{options.source.spec, options.target.spec});
  if (!heads.ok()) return heads;
  absl::Status comparable =
      CheckComparable(options, out_dir, "--granularity both", {"per_layer", "per_head"});
  if (!comparable.ok()) return comparable;
  std::vector<std::string> warnings;
  absl::StatusOr<StatSet> plan = PlanOrProbe(options, plan_in, &warnings);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<StatSet> final_stats = AccumulateFinal(options, *plan);
  if (!final_stats.ok()) return final_stats.status();
  GranularityResult r;
  absl::StatusOr<FitResult> layer =
      SolveGranularity(*final_stats, options, false, JoinPath(out_dir, "per_layer"), warnings,
                       &r.per_layer_seconds);
  if (!layer.ok()) return layer.status();
  r.per_layer = std::move(*layer);
  absl::StatusOr<FitResult> head =
      SolveGranularity(*final_stats, options, true, JoinPath(out_dir, "per_head"), warnings,
                       &r.per_head_seconds);
  if (!head.ok()) return head.status();
  r.per_head = std::move(*head);
  Recommend(&r);
  r.report_json_path = JoinPath(out_dir, kCompareFileName);
  absl::Status written =
      WriteStringToFile(r.report_json_path, ReportJson(r, options).dump(1) + "\n");
  if (!written.ok()) return written;
  return r;
}

}  // namespace fit
}  // namespace kvt
