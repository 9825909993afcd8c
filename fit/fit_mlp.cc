// `kvt fit --kind mlp` (MLP chains on the ridge path's features, sigma and split) and `--kind
// both` (both mappers, compared on the held-out attention-output cosine).
#include <algorithm>
#include <cmath>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "fit/fit.h"
#include "fit/fit_internal.h"
#include "fit/progress.h"
#include "fit/refine.h"
#include "fit/report.h"
#include "kernels/backend.h"
#include "kernels/rope.h"
#include "nlohmann/json.hpp"
#include "quality/kv_quality.h"

namespace kvt {
namespace fit {
namespace {

using nlohmann::json;

// One split's feature rows as float32 (the MLP trains in fp32; half the memory of FeatureRows).
struct FloatRows {
  int64_t rows = 0, source_cols = 0, target_cols = 0;
  std::vector<float> source[2], target[2];  // [kind]
  void Append(const FeatureRows& in) {
    source_cols = in.source_cols;
    target_cols = in.target_cols;
    rows += in.rows;
    for (int c = 0; c < 2; ++c) {
      const std::vector<double>& s = c == 0 ? in.source_k : in.source_v;
      const std::vector<double>& t = c == 0 ? in.target_k : in.target_v;
      source[c].insert(source[c].end(), s.begin(), s.begin() + in.rows * in.source_cols);
      target[c].insert(target[c].end(), t.begin(), t.begin() + in.rows * in.target_cols);
    }
  }
};

// x [rows, len(sigma) ds]: the sigma source layers' columns, in sigma's order (the mapper layout).
template <typename T>
std::vector<float> GatherSource(const T* source, int64_t rows, int64_t source_cols, int64_t ds,
                                const std::vector<int>& sigma) {
  const int64_t in = static_cast<int64_t>(sigma.size()) * ds;
  std::vector<float> x(rows * in);
  for (int64_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < sigma.size(); ++i) {
      const T* src = source + r * source_cols + sigma[i] * ds;
      std::copy(src, src + ds, &x[r * in + i * ds]);
    }
  }
  return x;
}

// Columns [first, first + count) of a [rows, cols] matrix.
template <typename T>
std::vector<float> Columns(const T* m, int64_t rows, int64_t cols, int64_t first, int64_t count) {
  std::vector<float> out(rows * count);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(m + r * cols + first, m + r * cols + first + count, &out[r * count]);
  }
  return out;
}

uint64_t MixSeed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = seed;
  for (uint64_t v : {a, b, c}) {
    x ^= v + 0x9e3779b97f4a7c15ull + (x << 6) + (x >> 2);
    x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
  }
  return x;
}

// The chain as the written dtype holds it.
MlpWeights Rounded(const MlpWeights& w, DType dtype) {
  MlpWeights r = w;
  for (std::vector<float>* v : {&r.a1, &r.c1, &r.a2, &r.c2, &r.a3, &r.c3}) {
    *v = RoundTrip(std::vector<double>(v->begin(), v->end()), dtype);
  }
  return r;
}

// Head-averaged R^2 of predictions against truth [rows, heads * d], around the truth's own
// column means (as the ridge path's R^2).
std::optional<double> R2Of(const std::vector<float>& pred, const std::vector<float>& truth,
                           int64_t rows, int heads, int d) {
  const int64_t cols = static_cast<int64_t>(heads) * d;
  std::vector<double> sse(cols, 0.0), sst(cols, 0.0), mean(cols, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) mean[c] += truth[r * cols + c];
  }
  for (double& m : mean) m /= rows;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double e = static_cast<double>(pred[r * cols + c]) - truth[r * cols + c];
      const double t = truth[r * cols + c] - mean[c];
      sse[c] += e * e;
      sst[c] += t * t;
    }
  }
  return HeadAveragedR2(sse, sst, 0, heads, d);
}

void AppendFloats(const std::vector<float>& values, DType dtype,
                  std::vector<std::vector<uint8_t>>* storage) {
  storage->push_back(ToBytes(std::vector<double>(values.begin(), values.end()), dtype));
}

double Mean(const std::vector<double>& values) {
  double sum = 0;
  for (double v : values) sum += v;
  return values.empty() ? 0.0 : sum / values.size();
}

// The report's line on the held-out rows' loss over the epochs (means over chains, standardised
// scale): where it was lowest, whether that was before the last epoch (overfitting the rows;
// with --mlp_keep_best_epoch those chains return that epoch), and what the chains returned.
std::string HeldoutByEpoch(const std::vector<int>& lowest, const std::vector<double>& at_lowest,
                           const std::vector<double>& at_returned,
                           const std::vector<double>& at_last, const MlpOptions& t) {
  const int64_t earlier =
      std::count_if(lowest.begin(), lowest.end(), [&](int e) { return e < t.epochs; });
  return absl::StrFormat(
      "lowest before the last epoch on %d of %d chains (epochs %d-%d of %d); %.4f there, %.4f "
      "after the last epoch; returned: %s (%.4f)",
      earlier, lowest.size(), *std::min_element(lowest.begin(), lowest.end()),
      *std::max_element(lowest.begin(), lowest.end()), t.epochs, Mean(at_lowest),
      Mean(at_last),
      t.keep_best_epoch ? "each chain's lowest (--mlp_keep_best_epoch)" : "the last epoch",
      Mean(at_returned));
}

}  // namespace

absl::StatusOr<FitResult> TrainAndWriteMlp(const FitOptions& options, const StatSet& final_stats,
                                           const std::string& out_dir,
                                           std::vector<std::string> warnings,
                                           FitResult* unrefined) {
  absl::Status valid = ValidateMlpOptions(options.mlp.train);
  if (!valid.ok()) return valid;
  absl::StatusOr<ParsedFinal> parsed = ParseFinal(final_stats);
  if (!parsed.ok()) return parsed.status();
  const FitShape& shape = parsed->shape;
  SetBlasThreads(options.num_threads);

  // Third pass: the feature rows themselves (the MLP is not a function of sums).
  FloatRows split[2];
  json log = json::array();
  absl::Status streamed = StreamSequences(
      options, shape, "mlp rows", /*training_only=*/false,
      [&](const FeatureRows& rows, bool heldout) { split[heldout ? 1 : 0].Append(rows); }, &log);
  if (!streamed.ok()) return streamed;
  if (split[0].rows == 0) {
    return absl::FailedPreconditionError("kvt fit --kind mlp: no training tokens");
  }

  const bool per_head = options.mlp.granularity == MlpGranularity::kPerHead;
  const int n_t = shape.target.num_kv_heads, d_t = shape.target.head_dim;
  const int heads = per_head ? n_t : 1;
  const int64_t dt = shape.dt(), ds = shape.ds(), out_h = per_head ? d_t : dt;
  const int64_t H = options.mlp.train.hidden;
  const DType dtype = options.solve.weight_dtype;
  const int L = shape.target.num_layers;
  std::vector<double> first_loss, last_loss;
  // Per chain: the epoch of the lowest held-out loss, that loss, and the held-out loss of the
  // epoch returned and of the last epoch.
  std::vector<int> lowest_epoch;
  std::vector<double> heldout_lowest, heldout_returned, heldout_last;
  std::unique_ptr<Progress> progress;
  if (options.solve.show_progress) {
    progress = std::make_unique<Progress>("mlp", int64_t{L} * 2 * heads, "chains",
                                          options.solve.log);
  }
  // Every chain first (float32, as trained): the refinement needs all layers' before any is
  // rounded to the weight dtype and written.
  std::vector<MlpMaps> chains(L);
  for (int l = 0; l < L; ++l) {
    const std::vector<int>& sigma = parsed->sigma[l];
    const int64_t in = static_cast<int64_t>(sigma.size()) * ds;
    for (int c = 0; c < 2; ++c) {
      const std::vector<float> x = GatherSource(split[0].source[c].data(), split[0].rows,
                                                split[0].source_cols, ds, sigma);
      const std::vector<float> y = Columns(split[0].target[c].data(), split[0].rows,
                                           split[0].target_cols, int64_t{l} * dt, dt);
      // The held-out sequences' rows score each epoch (MlpOptions::keep_best_epoch).
      const std::vector<float> xv =
          split[1].rows > 0 ? GatherSource(split[1].source[c].data(), split[1].rows,
                                           split[1].source_cols, ds, sigma)
                            : std::vector<float>();
      const std::vector<float> yv =
          split[1].rows > 0 ? Columns(split[1].target[c].data(), split[1].rows,
                                      split[1].target_cols, int64_t{l} * dt, dt)
                            : std::vector<float>();
      for (int h = 0; h < heads; ++h) {
        MlpOptions train = options.mlp.train;
        train.seed = MixSeed(options.mlp.train.seed, l, c, h);
        const std::vector<float> yh =
            per_head ? Columns(y.data(), split[0].rows, dt, int64_t{h} * d_t, d_t) : y;
        const std::vector<float> yvh =
            per_head && split[1].rows > 0
                ? Columns(yv.data(), split[1].rows, dt, int64_t{h} * d_t, d_t)
                : yv;
        const MlpValidation validation{&xv, &yvh, split[1].rows};
        MlpTrainLog train_log;
        absl::StatusOr<MlpWeights> chain =
            TrainMlp(x, yh, split[0].rows, in, out_h, train, &train_log, &validation);
        if (!chain.ok()) {
          return absl::Status(chain.status().code(),
                              absl::StrCat("target layer ", l, " ", KindName(c),
                                           per_head ? absl::StrCat(" head ", h) : "", ": ",
                                           chain.status().message()));
        }
        first_loss.push_back(train_log.epoch_loss.front());
        last_loss.push_back(train_log.epoch_loss.back());
        if (!train_log.validation_loss.empty()) {
          const std::vector<double>& curve = train_log.validation_loss;
          const int lowest = static_cast<int>(
              std::min_element(curve.begin(), curve.end()) - curve.begin());
          lowest_epoch.push_back(lowest + 1);
          heldout_lowest.push_back(curve[lowest]);
          heldout_returned.push_back(curve[train_log.returned_epoch - 1]);
          heldout_last.push_back(curve.back());
        }
        (c == 0 ? chains[l].k : chains[l].v).push_back(std::move(*chain));
        if (progress) progress->Advance(1, train_log.rows_used);
      }
    }
  }
  if (progress) progress->Finish();
  double mean_first = 0, mean_last = 0;
  for (size_t i = 0; i < first_loss.size(); ++i) {
    mean_first += first_loss[i] / first_loss.size();
    mean_last += last_loss[i] / last_loss.size();
  }
  const MlpOptions& t = options.mlp.train;
  std::vector<std::pair<std::string, std::string>> facts = {
      {"kind", absl::StrCat("mlp: relu(relu(x A1 + c1) A2 + c2) A3 + c3, hidden ", H, ", ",
                            MlpGranularityName(options.mlp.granularity))},
      {"training", absl::StrCat("Adam on MSE, lr ", t.learning_rate, ", ", t.epochs,
                                " epochs, batch ", t.batch, ", seed ", t.seed,
                                ", max observations ",
                                t.max_observations > 0 ? absl::StrCat(t.max_observations)
                                                       : std::string("all"),
                                "; standardised inputs/outputs folded into fc1/fc3")},
      {"training loss", absl::StrFormat("first epoch %.4f, last epoch %.4f (mean over chains, "
                                        "standardised scale)",
                                        mean_first, mean_last)},
  };
  if (!lowest_epoch.empty()) {
    facts.push_back({"held-out loss by epoch",
                     HeldoutByEpoch(lowest_epoch, heldout_lowest, heldout_returned, heldout_last,
                                    t)});
  }

  // The chains as the weight dtype holds them, the manifest's layers and the mapping tensors'
  // bytes (canonical order: fc1.weight, fc1.bias, fc2..., fc3...; per_head stacks the heads);
  // with `r2`, each layer's R^2 on both splits from the rounded chains' predictions.
  auto served = [&](const std::vector<MlpMaps>& layers, bool r2, Manifest* manifest) {
    *manifest = BaseManifest(*parsed, options.solve, MapperKind::kMlp);
    manifest->mlp = MlpConfig{H, options.mlp.granularity};
    std::vector<std::vector<uint8_t>> storage;
    for (int l = 0; l < L; ++l) {
      const std::vector<int>& sigma = parsed->sigma[l];
      LayerEntry entry;
      entry.target_layer = l;
      entry.sigma_k = SigmaOfBlocks(sigma, manifest->window);
      entry.sigma_v = entry.sigma_k;
      for (int c = 0; c < 2; ++c) {
        std::vector<MlpWeights> rounded;
        for (const MlpWeights& w : c == 0 ? layers[l].k : layers[l].v) {
          rounded.push_back(Rounded(w, dtype));
        }
        if (r2) {
          for (int s = 0; s < 2; ++s) {
            if (split[s].rows == 0) continue;
            const std::vector<float> x = GatherSource(split[s].source[c].data(), split[s].rows,
                                                      split[s].source_cols, ds, sigma);
            const std::vector<float> y = Columns(split[s].target[c].data(), split[s].rows,
                                                 split[s].target_cols, int64_t{l} * dt, dt);
            std::vector<float> pred(split[s].rows * dt), part(split[s].rows * out_h);
            for (int h = 0; h < heads; ++h) {
              MlpForward(rounded[h], x.data(), split[s].rows, part.data());
              for (int64_t r = 0; r < split[s].rows; ++r) {
                std::copy(&part[r * out_h], &part[r * out_h] + out_h,
                          &pred[r * dt + int64_t{h} * out_h]);
              }
            }
            const std::optional<double> value = R2Of(pred, y, split[s].rows, n_t, d_t);
            if (s == 0) {
              (c == 0 ? entry.r2_k : entry.r2_v) = value;
            } else {
              (c == 0 ? entry.r2_k_heldout : entry.r2_v_heldout) = value;
            }
          }
        }
        for (int fc = 0; fc < 3; ++fc) {
          for (int bias = 0; bias < 2; ++bias) {
            std::vector<float> values;
            for (const MlpWeights& w : rounded) {
              const std::vector<float>* part[3][2] = {
                  {&w.a1, &w.c1}, {&w.a2, &w.c2}, {&w.a3, &w.c3}};
              values.insert(values.end(), part[fc][bias]->begin(), part[fc][bias]->end());
            }
            AppendFloats(values, dtype, &storage);
          }
        }
      }
      manifest->layers.push_back(entry);
    }
    return storage;
  };

  std::optional<RefinementSummary> refinement;
  if (options.refine.attention) {
    // The MSE-trained start as served, then (optionally) written as a mapper of its own.
    Manifest start;
    std::vector<std::vector<uint8_t>> storage =
        served(chains, /*r2=*/!options.refine.unrefined_mlp_out.empty(), &start);
    std::optional<HeldoutQuality> before;
    if (!options.refine.unrefined_mlp_out.empty()) {
      std::vector<std::pair<std::string, std::string>> start_facts = facts;
      start_facts.push_back({"refinement", absl::StrCat("none: the MSE-trained start of the "
                                                        "attention-refined MLP written to ",
                                                        out_dir)});
      absl::StatusOr<FitResult> written =
          WriteFitted(final_stats, *parsed, std::move(start), std::move(storage), options.solve,
                      options.refine.unrefined_mlp_out, warnings, start_facts, &options);
      if (!written.ok()) return written.status();
      before = written->heldout;
      if (unrefined != nullptr) *unrefined = std::move(*written);
    } else {
      absl::StatusOr<std::optional<HeldoutQuality>> measured =
          MeasureInMemory(options, start, storage, "MSE-trained MLP");
      if (!measured.ok()) return measured.status();
      before = *measured;
    }
    absl::StatusOr<RefineLog> log = RefineMlp(options, *parsed, &chains);
    if (!log.ok()) return log.status();
    if (options.solve.show_progress) {
      std::fprintf(options.solve.log,
                   "kvt fit: refined the MLP %d steps in %.2f s: loss %.5f -> %.5f (relative "
                   "attention-output error, training batches)\n",
                   options.refine.mlp_steps, log->seconds, log->loss.front(),
                   log->loss.back());
    }
    for (auto& fact : RefineFacts(options.refine.ForMlp(), *log, before ? &*before : nullptr,
                                  "the MSE-trained MLP")) {
      facts.push_back(std::move(fact));
    }
    refinement = SummaryOf(options.refine.ForMlp(), *log);
  }
  Manifest manifest;
  std::vector<std::vector<uint8_t>> storage = served(chains, /*r2=*/true, &manifest);
  // The training rows are done with: free them before the held-out evaluation reads sequences.
  for (FloatRows& rows : split) rows = FloatRows();
  chains.clear();
  absl::StatusOr<FitResult> result =
      WriteFitted(final_stats, *parsed, std::move(manifest), std::move(storage), options.solve,
                  out_dir, std::move(warnings), facts, &options);
  if (result.ok()) result->refinement = std::move(refinement);
  return result;
}

nlohmann::json QualityJson(const HeldoutQuality& q, const FitResult& fit) {
  auto round = [](double x) { return std::round(x * 1e6) / 1e6; };
  json j{{"mapper", fit.mapper_dir},
         {"attention_cosine", round(q.attention_cosine)},
         {"attention_cosine_without_layer0", round(q.attention_cosine_without_layer0)},
         {"c_k", round(q.c_k)},
         {"c_v", round(q.c_v)},
         {"r2_k", round(q.r2_k)},
         {"r2_v", round(q.r2_v)}};
  // Per held-out sequence (the same sequences in every mapper of one fit, in order), so that
  // two fits on the same split compare paired.
  json sequences = json::array();
  for (double c : q.sequence_attention_cosine) sequences.push_back(round(c));
  j["sequence_attention_cosine_without_layer0"] = std::move(sequences);
  for (auto [name, field] : {std::pair<const char*, R2Field>{"r2_k_heldout_mean", R2Field::kKHeldout},
                             {"r2_v_heldout_mean", R2Field::kVHeldout}}) {
    std::optional<double> mean = MeanR2(fit.manifest, field, /*skip_layer0=*/false);
    if (mean.has_value()) j[name] = round(*mean);
  }
  if (fit.refinement.has_value()) {
    const RefinementSummary& r = *fit.refinement;
    json refinement{{"steps", r.steps},
                    {"batch", r.batch},
                    {"queries", r.queries},
                    {"learning_rate", r.learning_rate},
                    {"queries_from", r.handoff ? "handoff" : "prefix"},
                    {"seconds", std::round(r.seconds * 100) / 100},
                    {"kept_start", r.kept_start}};
    if (r.heldout_before) refinement["heldout_loss_before"] = *r.heldout_before;
    if (r.heldout_after) refinement["heldout_loss_after"] = *r.heldout_after;
    j["refinement"] = std::move(refinement);
  }
  return j;
}

absl::Status CheckComparable(const FitOptions& options, const std::string& out_dir,
                             const std::string& what, const std::vector<std::string>& subdirs) {
  const bool have_heldout =
      std::any_of(options.sequences.begin(), options.sequences.end(),
                  [](const SequencePair& pair) { return pair.heldout; });
  absl::StatusOr<bool> have_queries = HeldoutHasQueries(options);
  if (!have_queries.ok()) return have_queries.status();
  if (!have_heldout) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kvt fit ", what, " compares on held-out sequences, and none is held out "
        "(raise --heldout_fraction or add sequences)"));
  }
  if (!*have_queries) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kvt fit ", what, " recommends from the held-out attention-output cosine, which needs "
        "the target's queries: no held-out target dump has 'queries.0' (dump the target with "
        "tools/dump_kv.py --queries)"));
  }
  if (IsDirectory(out_dir) && !options.solve.overwrite) {
    // The mapper directories below refuse on their own; say it once, up front.
    for (const std::string& sub : subdirs) {
      if (IsDirectory(JoinPath(out_dir, sub))) {
        return absl::AlreadyExistsError(
            absl::StrCat(JoinPath(out_dir, sub), " exists (use --overwrite)"));
      }
    }
  }
  return MakeDirs(out_dir);
}

absl::StatusOr<StatSet> PlanOrProbe(const FitOptions& options, const StatSet* plan,
                                    std::vector<std::string>* warnings) {
  if (plan != nullptr) return *plan;
  absl::StatusOr<StatSet> probe = AccumulateProbe(options);
  if (!probe.ok()) return probe.status();
  return MakePlan(*probe, warnings, options.head_local_probe);
}

absl::StatusOr<BothResult> RunFitBoth(const FitOptions& options, const std::string& out_dir,
                                      const StatSet* plan_in) {
  // Before hours of work: the comparison needs held-out sequences with target queries.
  absl::Status comparable = CheckComparable(options, out_dir, "--kind both", {"ridge", "mlp"});
  if (!comparable.ok()) return comparable;
  std::vector<std::string> warnings;
  absl::StatusOr<StatSet> plan = PlanOrProbe(options, plan_in, &warnings);
  if (!plan.ok()) return plan.status();
  plan_in = &*plan;
  absl::StatusOr<StatSet> final_stats = AccumulateFinal(options, *plan_in);
  if (!final_stats.ok()) return final_stats.status();
  BothResult both;
  absl::StatusOr<FitResult> ridge =
      SolveAndWrite(*final_stats, options.solve, JoinPath(out_dir, "ridge"), warnings, &options);
  if (!ridge.ok()) return ridge.status();
  both.ridge = std::move(*ridge);
  FitResult unrefined;
  absl::StatusOr<FitResult> mlp =
      TrainAndWriteMlp(options, *final_stats, JoinPath(out_dir, "mlp"), warnings, &unrefined);
  if (!mlp.ok()) return mlp.status();
  both.mlp = std::move(*mlp);
  if (options.refine.attention && !options.refine.unrefined_mlp_out.empty()) {
    both.mlp_unrefined = std::move(unrefined);
  }
  // Each mapper was measured as served before it was written (the numbers in its manifest).
  if (!both.ridge.heldout.has_value() || !both.mlp.heldout.has_value()) {
    return absl::InternalError("kvt fit --kind both: a mapper was written without its held-out "
                               "quality");
  }
  both.ridge_quality = *both.ridge.heldout;
  both.mlp_quality = *both.mlp.heldout;
  const HeldoutQuality* rq = &both.ridge_quality;
  const HeldoutQuality* mq = &both.mlp_quality;
  both.recommended =
      mq->attention_cosine > rq->attention_cosine + 1e-4 ? "mlp" : "ridge";
  json report{
      {"recommended", both.recommended},
      {"recommended_mapper", both.recommended == "mlp" ? both.mlp.mapper_dir
                                                       : both.ridge.mapper_dir},
      {"criterion",
       "held-out attention-output cosine, mean over target layers and held-out sequences "
       "(higher wins; ridge on a tie within 1e-4)"},
      {"refined", options.refine.attention},
      {"heldout_sequences", rq->sequences},
      {"heldout_tokens", rq->tokens},
      {"ridge", QualityJson(*rq, both.ridge)},
      {"mlp", QualityJson(*mq, both.mlp)}};
  if (both.mlp_unrefined.has_value() && both.mlp_unrefined->heldout.has_value()) {
    report["mlp_unrefined"] = QualityJson(*both.mlp_unrefined->heldout, *both.mlp_unrefined);
  }
  both.report_json_path = JoinPath(out_dir, kCompareFileName);
  absl::Status written = WriteStringToFile(both.report_json_path, report.dump(1) + "\n");
  if (!written.ok()) return written;
  return both;
}

}  // namespace fit
}  // namespace kvt
