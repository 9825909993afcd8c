#include "fit/fit.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "fit/fit_internal.h"
#include "fit/progress.h"
#include "fit/report.h"
#include "kernels/dtype.h"
#include "mapper_store/hf_config.h"
#include "mapper_store/mapper.h"
#include "nlohmann/json.hpp"
#include "quality/mapper_quality.h"

namespace kvt {
namespace fit {
namespace {

using nlohmann::json;

constexpr char kPhase[] = "kvt_fit_phase";
// Set in a plan (and the final statistics made from it) whose unmatched probe was head-local.
constexpr char kProbeKey[] = "probe";
constexpr char kHeadLocalProbe[] = "head-local";

json SequenceLog(const SequencePair& pair, int64_t tokens, int64_t observations) {
  return json{{"name", pair.name},
              {"tokens", tokens},
              {"observations", observations},
              {"heldout", pair.heldout}};
}

// What every shard of one fit must agree on (checked by StatSet::Add when merging).
StatSet Header(const FitOptions& options, const std::string& phase) {
  StatSet stats;
  stats.metadata[kPhase] = phase;
  stats.metadata["source_name"] = options.source.spec.name;
  stats.metadata["source_config"] = options.source.config_json;
  stats.metadata["target_name"] = options.target.spec.name;
  stats.metadata["target_config"] = options.target.config_json;
  stats.metadata["stride"] = absl::StrCat(options.stride);
  stats.metadata["heldout_fraction"] = absl::StrCat(options.heldout_fraction);
  stats.metadata["heldout_split"] = HeldoutSplitName(options.heldout_split);
  stats.metadata["seed"] = absl::StrCat(options.seed);
  stats.metadata["corpus"] = options.corpus;
  stats.metadata["tool"] = kFitToolVersion;
  stats.metadata["sequences"] = "[]";
  // Only a window fit records it, so token-wise shards read as before windows existed.
  if (options.window > 1) stats.metadata["window"] = absl::StrCat(options.window);
  return stats;
}

absl::StatusOr<FitShape> ShapeOf(const StatSet& stats) {
  absl::StatusOr<FitModel> source = FitModelFromJson(
      stats.metadata.at("source_config"), stats.metadata.at("source_name"), "source_config");
  if (!source.ok()) return source.status();
  absl::StatusOr<FitModel> target = FitModelFromJson(
      stats.metadata.at("target_config"), stats.metadata.at("target_name"), "target_config");
  if (!target.ok()) return target.status();
  FitShape shape{source->spec, target->spec};
  auto window = stats.metadata.find("window");
  if (window != stats.metadata.end() &&
      (!absl::SimpleAtoi(window->second, &shape.window) || shape.window < 1 ||
       shape.window > kMaxMapperWindow)) {
    return absl::InvalidArgumentError(
        absl::StrCat("statistics metadata 'window' = '", window->second, "' is malformed"));
  }
  return shape;
}

absl::Status NeedMetadata(const StatSet& stats, const std::vector<std::string>& keys,
                          const std::string& phase) {
  auto it = stats.metadata.find(kPhase);
  if (it == stats.metadata.end() || it->second != phase) {
    return absl::InvalidArgumentError(absl::StrCat(
        "statistics of phase '", it == stats.metadata.end() ? "(none)" : it->second,
        "' where phase '", phase, "' is needed"));
  }
  for (const std::string& key : keys) {
    if (stats.metadata.count(key) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("statistics lack metadata '", key, "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Reads `sequences` in order into feature-row buffers (one for training, one for held-out
// sequences unless `training_only`), handing a buffer to `consume` whenever it holds
// `chunk_rows` rows, and once more at the end. Records each sequence in `log`.
absl::Status StreamSequences(const FitOptions& options, const FitShape& shape,
                             const std::string& what, bool training_only,
                             const std::function<void(const FeatureRows&, bool)>& consume,
                             json* log) {
  const int64_t source_cols = shape.source_blocks() * shape.ds();
  const int64_t target_cols = shape.target.num_layers * shape.dt();
  const int64_t row_bytes = 2 * (source_cols + target_cols) * int64_t{sizeof(double)};
  const int64_t chunk_rows = std::max<int64_t>(64, options.chunk_bytes / row_bytes);
  FeatureRows buffers[2];
  for (FeatureRows& b : buffers) b.Reset(source_cols, target_cols);
  std::vector<const SequencePair*> todo;
  for (const SequencePair& pair : options.sequences) {
    if (!(training_only && pair.heldout)) todo.push_back(&pair);
  }
  std::unique_ptr<Progress> progress;
  if (options.solve.show_progress) {
    progress = std::make_unique<Progress>(what, todo.size(), "sequences", options.solve.log);
  }
  for (const SequencePair* pair : todo) {
    FeatureRows& buffer = buffers[pair->heldout ? 1 : 0];
    const int64_t before = buffer.rows;
    absl::StatusOr<int64_t> tokens =
        AppendSequence(*pair, shape.source, shape.target, options.stride, &buffer, shape.window);
    if (!tokens.ok()) return tokens.status();
    const int64_t kept = buffer.rows - before;
    log->push_back(SequenceLog(*pair, *tokens, kept));
    if (buffer.rows >= chunk_rows) {
      consume(buffer, pair->heldout);
      buffer.Reset(source_cols, target_cols);
    }
    if (progress) progress->Advance(1, kept);
  }
  for (int split = 0; split < 2; ++split) {
    if (buffers[split].rows > 0) consume(buffers[split], split == 1);
  }
  return absl::OkStatus();
}

namespace {

std::string UtcNow() {
  char buffer[32];
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  std::strftime(buffer, sizeof(buffer), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buffer;
}

}  // namespace

// Converts a row-major float64 array to `dtype` bytes.
std::vector<uint8_t> ToBytes(const std::vector<double>& values, DType dtype) {
  std::vector<float> floats(values.begin(), values.end());
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  FromFloat(dtype, floats.data(), bytes.data(), floats.size());
  return bytes;
}


absl::StatusOr<FitModel> FitModelFromJson(const std::string& json_text, const std::string& name,
                                          const std::string& label) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(json_text, label, name);
  if (!spec.ok()) return spec.status();
  return FitModel{*spec, json_text};
}

absl::StatusOr<FitModel> LoadFitModel(const std::string& path, const std::string& name) {
  const std::string file = IsDirectory(path) ? JoinPath(path, "config.json") : path;
  absl::StatusOr<std::string> text = ReadFileToString(file);
  if (!text.ok()) return text.status();
  return FitModelFromJson(*text, name, file);
}

void SetBlasThreads(int num_threads) {
  if (num_threads <= 0) num_threads = std::max(1u, std::thread::hardware_concurrency());
  openblas_set_num_threads(num_threads);
}

absl::StatusOr<StatSet> AccumulateProbe(const FitOptions& options) {
  SetBlasThreads(options.num_threads);
  const FitShape shape{options.source.spec, options.target.spec};
  ProbeAccumulator accumulator(shape);
  json log = json::array();
  absl::Status status = StreamSequences(
      options, shape, "probe", /*training_only=*/true,
      [&](const FeatureRows& rows, bool) { accumulator.Add(rows); }, &log);
  if (!status.ok()) return status;
  StatSet stats = Header(options, "probe");
  for (auto& [name, values] : accumulator.stats().arrays) stats.arrays[name] = std::move(values);
  stats.metadata["sequences"] = log.dump();
  return stats;
}

absl::StatusOr<StatSet> MakePlan(const StatSet& probe, std::vector<std::string>* warnings,
                                 bool head_local) {
  absl::Status need = NeedMetadata(probe, {"source_config", "target_config"}, "probe");
  if (!need.ok()) return need;
  absl::StatusOr<FitShape> shape = ShapeOf(probe);
  if (!shape.ok()) return shape.status();
  absl::StatusOr<ProbeTables> tables = SolveProbe(*shape, probe, warnings, head_local);
  if (!tables.ok()) return tables.status();
  StatSet plan;
  plan.metadata = probe.metadata;
  plan.metadata[kPhase] = "plan";
  if (head_local && !shape->matched()) plan.metadata[kProbeKey] = kHeadLocalProbe;
  plan.arrays["plan.r2_k"] = tables->r2_k;
  plan.arrays["plan.r2_v"] = tables->r2_v;
  plan.arrays["plan.probe_tokens"] = probe.at("probe.n");
  return plan;
}

namespace {

absl::StatusOr<ProbeTables> TablesOf(const StatSet& plan, const FitShape& shape) {
  for (const char* name : {"plan.r2_k", "plan.r2_v"}) {
    auto it = plan.arrays.find(name);
    if (it == plan.arrays.end() ||
        it->second.size() !=
            static_cast<size_t>(shape.source.num_layers) * shape.target.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("plan lacks a well-shaped '", name, "'"));
    }
  }
  ProbeTables tables;
  tables.source_layers = shape.source.num_layers;
  tables.target_layers = shape.target.num_layers;
  tables.r2_k = plan.at("plan.r2_k");
  tables.r2_v = plan.at("plan.r2_v");
  return tables;
}

}  // namespace

namespace {

// `--per_head_objective=attention_weighted`: one more pass over the training sequences, each
// read with its target's queries, adding the "aw.*" arrays (stats.h) to `stats`.
absl::Status AccumulateAttentionWeighted(const FitOptions& options, const FitShape& shape,
                                         const std::vector<std::vector<int>>& sigma,
                                         StatSet* stats) {
  HeadWeightedAccumulator accumulator(shape, sigma);
  std::unique_ptr<Progress> progress;
  if (options.solve.show_progress) {
    const int64_t training = std::count_if(options.sequences.begin(), options.sequences.end(),
                                           [](const SequencePair& p) { return !p.heldout; });
    progress = std::make_unique<Progress>("attention weights", training, "sequences",
                                          options.solve.log);
  }
  FeatureRows rows;
  for (const SequencePair& pair : options.sequences) {
    if (pair.heldout) continue;
    rows.Reset(shape.source_blocks() * shape.ds(), shape.target.num_layers * shape.dt());
    absl::StatusOr<int64_t> tokens = AppendSequence(pair, shape.source, shape.target,
                                                    options.stride, &rows, shape.window);
    if (!tokens.ok()) return tokens.status();
    absl::StatusOr<std::vector<double>> weights =
        AttentionMass(pair, shape.source, shape.target, options.stride);
    if (absl::IsNotFound(weights.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--per_head_objective=attention_weighted weights tokens by the target's own queries, "
          "and ", pair.target_path, " has none (dump the target with tools/dump_kv.py --queries)"));
    }
    if (!weights.ok()) return weights.status();
    accumulator.Add(rows, *weights);
    if (progress) progress->Advance(1, rows.rows);
  }
  for (auto& [name, values] : accumulator.stats().arrays) {
    stats->arrays[name] = std::move(values);
  }
  stats->metadata["per_head_objective"] = "attention_weighted";
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StatSet> AccumulateFinal(const FitOptions& options, const StatSet& plan) {
  absl::Status need = NeedMetadata(plan, {"source_config", "target_config"}, "plan");
  if (!need.ok()) return need;
  if (options.window < 1 || options.window > kMaxMapperWindow) {
    return absl::InvalidArgumentError(absl::StrCat("--window=", options.window,
                                                   " must be between 1 and ", kMaxMapperWindow));
  }
  const FitShape shape{options.source.spec, options.target.spec, options.window};
  // The plan must come from the same models, stride and split as these sequences.
  StatSet header = Header(options, "final");
  for (const char* key : {"source_name", "source_config", "target_name", "target_config",
                          "stride", "heldout_fraction", "seed"}) {
    if (plan.metadata.at(key) != header.metadata.at(key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the plan was made with a different ", key, " ('", plan.metadata.at(key),
          "') than this run ('", header.metadata.at(key), "')"));
    }
  }
  absl::StatusOr<ProbeTables> tables = TablesOf(plan, shape);
  if (!tables.ok()) return tables.status();
  // The probe ranks source layers; a window fit reads each chosen layer at every offset.
  std::vector<std::vector<int>> sigma = SelectLayers(*tables, options.k);
  for (std::vector<int>& s : sigma) s = WindowBlocks(s, shape.source.num_layers, shape.window);
  SetBlasThreads(options.num_threads);
  FinalAccumulator accumulator(shape, BlockPlan::FromSigma(sigma));
  json log = json::array();
  absl::Status status = StreamSequences(
      options, shape, "fit", /*training_only=*/false,
      [&](const FeatureRows& rows, bool heldout) { accumulator.Add(rows, heldout); }, &log);
  if (!status.ok()) return status;
  StatSet stats = std::move(header);
  for (auto& [name, values] : accumulator.stats().arrays) stats.arrays[name] = std::move(values);
  if (options.solve.ridge.attention_weighted) {
    absl::Status weighted = AccumulateAttentionWeighted(options, shape, sigma, &stats);
    if (!weighted.ok()) return weighted;
  }
  for (const char* name : {"plan.r2_k", "plan.r2_v", "plan.probe_tokens"}) {
    stats.arrays[name] = plan.at(name);
  }
  stats.metadata["sequences"] = log.dump();
  stats.metadata["k"] = options.k <= 0 || options.k >= shape.source.num_layers
                            ? "all"
                            : absl::StrCat(options.k);
  stats.metadata["sigma"] = json(sigma).dump();
  if (plan.metadata.count(kProbeKey)) stats.metadata[kProbeKey] = plan.metadata.at(kProbeKey);
  return stats;
}

absl::StatusOr<ParsedFinal> ParseFinal(const StatSet& stats) {
  absl::Status need = NeedMetadata(
      stats, {"sigma", "k", "sequences", "stride", "heldout_fraction", "seed"}, "final");
  if (!need.ok()) return need;
  absl::StatusOr<FitShape> shape = ShapeOf(stats);
  if (!shape.ok()) return shape.status();
  absl::StatusOr<ProbeTables> tables = TablesOf(stats, *shape);
  if (!tables.ok()) return tables.status();
  const json sigma_json = json::parse(stats.metadata.at("sigma"), nullptr, false);
  if (sigma_json.is_discarded() || !sigma_json.is_array() ||
      sigma_json.size() != static_cast<size_t>(shape->target.num_layers)) {
    return absl::InvalidArgumentError("statistics metadata 'sigma' is malformed");
  }
  ParsedFinal parsed{*shape, *tables, sigma_json.get<std::vector<std::vector<int>>>()};
  return parsed;
}

Manifest BaseManifest(const ParsedFinal& parsed, const SolveOptions& options, MapperKind kind) {
  Manifest manifest;
  manifest.kind = kind;
  manifest.source = parsed.shape.source;
  manifest.target = parsed.shape.target;
  if (kind == MapperKind::kRidge) {
    manifest.lambda = options.ridge.lambda;
    manifest.lambda_scale = options.ridge.scale;
    manifest.ridge_granularity =
        options.ridge.per_head ? RidgeGranularity::kPerHead : RidgeGranularity::kPerLayer;
  }
  manifest.weights_dtype = options.weight_dtype;
  manifest.created_by = kFitToolVersion;
  manifest.window = parsed.shape.window;
  for (const auto& s : parsed.sigma) {
    manifest.k = std::max<int>(manifest.k, s.size() / parsed.shape.window);
  }
  return manifest;
}

std::vector<float> RoundTrip(const std::vector<double>& values, DType dtype) {
  const std::vector<uint8_t> bytes = ToBytes(values, dtype);
  std::vector<float> floats(values.size());
  ToFloat(dtype, bytes.data(), floats.data(), floats.size());
  return floats;
}

namespace {

// A head-local fit's dense [blocks n_s d_s, n_t d_t] weights as stored: head h's rows
// (HeadSourceRows) x its d_t columns, heads stacked, [n_t, in_h, d_t]. Everything else is 0.
std::vector<double> HeadLocalWeights(const FitShape& shape, int64_t blocks,
                                     const std::vector<double>& dense) {
  const int64_t dt = shape.dt(), d_t = shape.target.head_dim;
  std::vector<double> stacked;
  for (int h = 0; h < shape.target.num_kv_heads; ++h) {
    for (int64_t row : HeadSourceRows(shape, blocks, h)) {
      stacked.insert(stacked.end(), dense.begin() + row * dt + h * d_t,
                     dense.begin() + row * dt + (h + 1) * d_t);
    }
  }
  return stacked;
}

}  // namespace

std::vector<std::vector<uint8_t>> RidgeStorage(const std::vector<std::vector<int>>& sigma,
                                               const std::vector<LayerFit>& fits, DType dtype,
                                               Manifest* manifest) {
  std::vector<std::vector<uint8_t>> storage;
  manifest->layers.clear();
  for (size_t l = 0; l < fits.size(); ++l) {
    const LayerFit& fit = fits[l];
    LayerEntry entry;
    entry.target_layer = static_cast<int>(l);
    entry.sigma_k = SigmaOfBlocks(sigma[l], manifest->window);
    entry.sigma_v = entry.sigma_k;
    entry.r2_k = fit.r2_k;
    entry.r2_v = fit.r2_v;
    entry.r2_k_heldout = fit.r2_k_heldout;
    entry.r2_v_heldout = fit.r2_v_heldout;
    manifest->layers.push_back(entry);
    const bool per_head = manifest->ridge_granularity == RidgeGranularity::kPerHead;
    const FitShape shape{manifest->source, manifest->target, manifest->window};
    for (const std::vector<double>* values : {&fit.w_k, &fit.b_k, &fit.w_v, &fit.b_v}) {
      const bool weight = values == &fit.w_k || values == &fit.w_v;
      storage.push_back(ToBytes(
          per_head && weight ? HeadLocalWeights(shape, sigma[l].size(), *values) : *values,
          dtype));
    }
  }
  return storage;
}

namespace {

// The report's line on the ridge's granularity.
std::string GranularityFact(const FitShape& shape, const RidgeOptions& ridge) {
  if (!ridge.per_head) return "per_layer (every target head from every source head of the layers)";
  const HeadSources heads = HeadLocalSources(shape.source, shape.target, 0);
  return absl::StrCat("per_head (head-local: each of the ", shape.target.num_kv_heads,
                      " target heads from its ", heads.count, " matching source head",
                      heads.count == 1 ? "" : "s", " of the layers); objective ",
                      ridge.attention_weighted
                          ? "attention-weighted (each token's residual weighted by the attention "
                            "mass the target's own queries give it)"
                          : "MSE");
}

}  // namespace

absl::StatusOr<FitResult> SolveAndWrite(const StatSet& stats, const SolveOptions& options,
                                        const std::string& out_dir,
                                        std::vector<std::string> warnings,
                                        const FitOptions* heldout) {
  absl::StatusOr<ParsedFinal> parsed = ParseFinal(stats);
  if (!parsed.ok()) return parsed.status();
  const FitShape* shape = &parsed->shape;
  const std::vector<std::vector<int>>& sigma = parsed->sigma;
  Manifest manifest = BaseManifest(*parsed, options, MapperKind::kRidge);

  for (std::string& w : DegenerateInputWarnings(*shape, stats, sigma)) {
    if (options.show_progress) std::fprintf(options.log, "kvt fit: warning: %s\n", w.c_str());
    warnings.push_back(std::move(w));
  }
  // Solve every layer first: the manifest (written first) carries each layer's R^2.
  std::vector<LayerFit> fits;
  {
    std::unique_ptr<Progress> progress;
    if (options.show_progress) {
      progress = std::make_unique<Progress>(
          options.ridge.per_head ? "solve per_head" : "solve per_layer",
          shape->target.num_layers, "layers", options.log);
    }
    for (int l = 0; l < shape->target.num_layers; ++l) {
      absl::StatusOr<LayerFit> fit = SolveLayer(*shape, stats, l, sigma[l], options.ridge);
      if (!fit.ok()) return fit.status();
      fits.push_back(std::move(*fit));
      if (progress) progress->Advance(1, 0);
    }
  }
  std::vector<std::pair<std::string, std::string>> facts = {{"granularity", GranularityFact(
      *shape, options.ridge)}};
  std::optional<RefinementSummary> refinement;
  if (heldout != nullptr && heldout->refine.attention) {
    refinement.emplace();
    absl::StatusOr<std::vector<std::pair<std::string, std::string>>> refined = RefineLayers(
        *heldout, stats, *parsed, manifest, options.weight_dtype, &fits, options.ridge.per_head,
        &*refinement);
    if (!refined.ok()) return refined.status();
    facts.insert(facts.end(), refined->begin(), refined->end());
  }
  std::vector<std::vector<uint8_t>> storage = RidgeStorage(sigma, fits, options.weight_dtype,
                                                           &manifest);
  absl::StatusOr<FitResult> result =
      WriteFitted(stats, *parsed, std::move(manifest), std::move(storage), options, out_dir,
                  std::move(warnings), facts, heldout);
  if (result.ok()) result->refinement = std::move(refinement);
  return result;
}

// Held-out figures into the manifest, with what they rest on. kvtd gates on the lower bound, so
// a fit with too few held-out sequences for one (or for a tight one) is told so loudly here.
void RecordHeldout(const HeldoutQuality& heldout, ManifestQuality* quality,
                   std::vector<std::string>* warnings) {
  quality->attention_cosine_heldout = heldout.attention_cosine_without_layer0;
  quality->attention_cosine_heldout_all_layers = heldout.attention_cosine;
  quality->attention_cosine_heldout_lower95 = heldout.attention_cosine_lower95;
  quality->kv_cosine_heldout = heldout.kv_cosine;
  quality->heldout_sequences = heldout.sequences;
  quality->heldout_tokens = heldout.tokens;
  if (heldout.sequences < kMinHeldoutSequences) {
    warnings->push_back(absl::StrCat(
        "the held-out quality rests on ", heldout.sequences, " sequence",
        heldout.sequences == 1 ? "" : "s", " (", heldout.tokens, " tokens); kvtd's quality gate ",
        heldout.attention_cosine_lower95 ? "compares the 95% lower bound with its floor, and "
                                           "with so few sequences that bound is loose"
                                         : "needs at least 2 held-out sequences and refuses "
                                           "this mapper",
        ": hold out at least ", kMinHeldoutSequences,
        " sequences (--heldout_fraction, or more calibration sequences)"));
  }
}

absl::StatusOr<FitResult> WriteFitted(const StatSet& stats, const ParsedFinal& parsed,
                                      Manifest manifest,
                                      std::vector<std::vector<uint8_t>> storage,
                                      const SolveOptions& options, const std::string& out_dir,
                                      std::vector<std::string> warnings,
                                      const std::vector<std::pair<std::string, std::string>>&
                                          kind_facts,
                                      const FitOptions* heldout_from) {
  const FitShape* shape = &parsed.shape;
  const ProbeTables* tables = &parsed.tables;
  std::vector<TensorRef> tensors;
  std::vector<TensorSpec> specs = MapperTensorSpecs(manifest);
  for (size_t i = 0; i < specs.size(); ++i) {
    tensors.push_back({specs[i], absl::Span<const uint8_t>(storage[i].data(), storage[i].size())});
  }

  // Per-source-layer feature statistics over every calibration token (both splits), for the
  // input-shift score of kvtd: stats.source.{j}.{k,v}.{mean,var}, fp32, K in content space.
  const int64_t ds = shape->ds();
  const double n_train = stats.at("train.n")[0], n_held = stats.at("heldout.n")[0];
  const double n_all = n_train + n_held;
  for (int j = 0; j < shape->source.num_layers; ++j) {
    for (int c = 0; c < 2; ++c) {
      std::vector<double> mean(ds), var(ds);
      for (int64_t i = 0; i < ds; ++i) {
        const int64_t at = j * ds + i;
        const double sum = stats.at(FinalName(false, c, "sum_x"))[at] +
                           stats.at(FinalName(true, c, "sum_x"))[at];
        const double sumsq = stats.at(FinalName(false, c, "sumsq_x"))[at] +
                             stats.at(FinalName(true, c, "sumsq_x"))[at];
        mean[i] = sum / n_all;
        var[i] = std::max(0.0, sumsq / n_all - mean[i] * mean[i]);
      }
      for (auto [what, values] : {std::pair<const char*, std::vector<double>*>{"mean", &mean},
                                  {"var", &var}}) {
        storage.push_back(ToBytes(*values, DType::kFP32));
        TensorSpec spec{absl::StrCat("stats.source.", j, ".", KindName(c), ".", what),
                        DType::kFP32,
                        {ds}};
        tensors.push_back({spec, absl::Span<const uint8_t>(storage.back().data(),
                                                           storage.back().size())});
      }
    }
  }
  // `storage` grew after the first spans were taken: re-point them all.
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].bytes = absl::Span<const uint8_t>(storage[i].data(), storage[i].size());
  }

  // Held-out quality of the mapper as served (these very bytes), before anything is written.
  manifest.quality = ManifestQuality();
  manifest.quality.r2_heldout = MeanHeldoutR2(manifest);
  std::optional<HeldoutQuality> heldout;
  if (heldout_from != nullptr) {
    absl::StatusOr<bool> have = HeldoutHasQueries(*heldout_from);
    if (!have.ok()) return have.status();
    if (*have) {
      absl::StatusOr<MapperView> view = MapperViewOf(manifest, tensors);
      if (!view.ok()) return view.status();
      absl::StatusOr<HeldoutQuality> measured = MeasureHeldout(*heldout_from, *view);
      if (!measured.ok()) return measured.status();
      heldout = std::move(*measured);
      for (size_t l = 0; l < manifest.layers.size(); ++l) {
        manifest.layers[l].attention_cosine_heldout = heldout->layer_attention_cosine[l];
      }
      RecordHeldout(*heldout, &manifest.quality, &warnings);
      if (options.show_progress) {
        std::fprintf(options.log,
                     "kvt fit: held-out attention-output cosine %.6f without layer 0 (95%% "
                     "lower bound %s), %.6f all layers (%d sequences, %lld tokens, %.2f s)\n",
                     heldout->attention_cosine_without_layer0,
                     heldout->attention_cosine_lower95
                         ? absl::StrFormat("%.6f", *heldout->attention_cosine_lower95).c_str()
                         : "none: one sequence",
                     heldout->attention_cosine, heldout->sequences,
                     static_cast<long long>(heldout->tokens), heldout->seconds);
      }
    }
  }

  // Calibration facts: the manifest's free-form map and the report's table.
  // The statistics may come from shard files on disk: parse without exceptions and check types.
  const json sequences =
      json::parse(stats.metadata.at("sequences"), /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (!sequences.is_array()) {
    return absl::InvalidArgumentError(
        "statistics metadata 'sequences' is not a JSON array (corrupt shard file?)");
  }
  int64_t heldout_sequences = 0, min_tokens = INT64_MAX, max_tokens = 0, total_tokens = 0;
  for (const json& s : sequences) {
    if (!s.is_object() || !s.contains("tokens") || !s["tokens"].is_number_integer() ||
        !s.contains("heldout") || !s["heldout"].is_boolean()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "statistics metadata 'sequences' entry lacks integer 'tokens' / boolean 'heldout': ",
          s.dump()));
    }
    const int64_t tokens = s["tokens"].get<int64_t>();
    heldout_sequences += s["heldout"].get<bool>() ? 1 : 0;
    min_tokens = std::min(min_tokens, tokens);
    max_tokens = std::max(max_tokens, tokens);
    total_tokens += tokens;
  }
  const std::string tokens_per_sequence = min_tokens == max_tokens
                                              ? absl::StrCat(max_tokens)
                                              : absl::StrCat(min_tokens, "..", max_tokens);
  int stride = 0;
  if (!absl::SimpleAtoi(stats.metadata.at("stride"), &stride) || stride < 1) {
    return absl::InvalidArgumentError(absl::StrCat("statistics metadata 'stride' is not a positive "
                                                   "integer: '", stats.metadata.at("stride"), "'"));
  }
  ReportData report;
  report.mapper_id = Basename(out_dir);
  report.probe = *tables;
  auto fact = [&](const std::string& key, const std::string& value) {
    report.facts.push_back({key, value});
  };
  const std::string corpus = stats.metadata.count("corpus") ? stats.metadata.at("corpus") : "";
  fact("dataset", corpus.empty() ? "(not given)" : corpus);
  fact("sequences", absl::StrCat(sequences.size(), " (", sequences.size() - heldout_sequences,
                                 " training, ", heldout_sequences, " held out)"));
  fact("tokens per sequence", tokens_per_sequence);
  fact("tokens in all", absl::StrCat(total_tokens));
  fact("stride", absl::StrCat(stride));
  fact("training observations", absl::StrCat(static_cast<int64_t>(n_train)));
  fact("held-out observations", absl::StrCat(static_cast<int64_t>(n_held)));
  const auto split = stats.metadata.find("heldout_split");
  fact("held-out split",
       split != stats.metadata.end() && split->second == "tail"
           ? absl::StrCat("by sequence: fraction ", stats.metadata.at("heldout_fraction"),
                          ", the list's last sequences (--heldout_split=tail)")
           : absl::StrCat("by sequence: fraction ", stats.metadata.at("heldout_fraction"),
                          ", seed ", stats.metadata.at("seed"),
                          " (hash of seed and dump file name)"));
  const bool local_probe = stats.metadata.count(kProbeKey) > 0;
  fact("probe", shape->matched() ? "head h on head h (matched KV shapes)"
                : local_probe    ? "each target head on its matching source heads (unmatched, "
                                   "head-local)"
                                 : "each target head on the whole source layer (unmatched)");
  fact("k", stats.metadata.at("k"));
  if (manifest.kind == MapperKind::kRidge) {
    fact("lambda", absl::StrCat(FormatDouble(options.ridge.lambda), " (",
                                LambdaScaleName(options.ridge.scale), " scale)"));
  }
  for (const auto& [key, value] : kind_facts) fact(key, value);
  if (heldout.has_value()) {
    fact("held-out attention-output cosine",
         absl::StrFormat("%.6f without layer 0, %.6f all layers (%d held-out sequences, %lld "
                         "tokens, target queries; CPU backend; %.2f s)",
                         heldout->attention_cosine_without_layer0, heldout->attention_cosine,
                         heldout->sequences, static_cast<long long>(heldout->tokens),
                         heldout->seconds));
  } else {
    fact("held-out attention-output cosine",
         heldout_from == nullptr
             ? "not measured (solved from statistics alone: no sequences to measure on)"
             : "not measured (no held-out target dump has queries: tools/dump_kv.py --queries)");
  }
  fact("date", UtcNow());
  fact("tool", kFitToolVersion);

  json calibration;
  calibration["dataset"] = corpus.empty() ? "unspecified" : corpus;
  calibration["sequences"] = sequences.size();
  calibration["sequences_heldout"] = heldout_sequences;
  if (min_tokens == max_tokens) {
    calibration["tokens"] = max_tokens;  // per sequence, before the stride
  } else {
    calibration["tokens"] = tokens_per_sequence;
  }
  calibration["tokens_total"] = total_tokens;
  calibration["stride"] = stride;
  calibration["observations"] = {{"train", static_cast<int64_t>(n_train)},
                                 {"heldout", static_cast<int64_t>(n_held)}};
  double heldout_fraction = 0;
  uint64_t split_seed = 0;
  if (!absl::SimpleAtod(stats.metadata.at("heldout_fraction"), &heldout_fraction) ||
      !absl::SimpleAtoi(stats.metadata.at("seed"), &split_seed)) {
    return absl::InvalidArgumentError(
        "statistics metadata 'heldout_fraction' / 'seed' are not numbers (corrupt shard file?)");
  }
  const auto split_rule = stats.metadata.find("heldout_split");
  const bool tail_split = split_rule != stats.metadata.end() && split_rule->second == "tail";
  calibration["heldout_split"] = {
      {"fraction", heldout_fraction},
      {"seed", split_seed},
      {"by", tail_split ? "sequence: the list's last sequences (--heldout_split=tail)"
                        : "sequence (hash of seed and dump file name)"}};
  calibration["probe"] = shape->matched() ? "head-matched"
                         : local_probe      ? "head-local"
                                            : "full-source-layer";
  calibration["k_requested"] = stats.metadata.at("k");
  json means;
  for (auto [name, field] : {std::pair<const char*, R2Field>{"k", R2Field::kK},
                             {"v", R2Field::kV},
                             {"k_heldout", R2Field::kKHeldout},
                             {"v_heldout", R2Field::kVHeldout}}) {
    for (bool skip : {false, true}) {
      std::optional<double> mean = MeanR2(manifest, field, skip);
      if (mean.has_value()) {
        means[absl::StrCat(name, skip ? "_without_layer0" : "")] = std::round(*mean * 1e4) / 1e4;
      }
    }
  }
  calibration["r2_mean"] = means;
  if (heldout.has_value()) {
    calibration["attention_cosine_heldout"] = {
        {"sequences", heldout->sequences},
        {"tokens", heldout->tokens},
        {"c_k", std::round(heldout->c_k * 1e4) / 1e4},
        {"c_v", std::round(heldout->c_v * 1e4) / 1e4},
        {"backend", "cpu"}};
  }
  calibration["date"] = UtcNow();
  calibration["tool"] = kFitToolVersion;
  if (!warnings.empty()) calibration["warnings"] = warnings;
  // JSON is YAML: the manifest keeps this map as written.
  manifest.calibration_yaml = calibration.dump();

  WriteOptions write_options;
  write_options.overwrite = options.overwrite;
  absl::Status written = WriteMapperDir(out_dir, manifest, tensors, write_options);
  if (!written.ok()) return written;

  report.manifest = manifest;
  report.warnings = warnings;
  FitResult result;
  result.mapper_dir = out_dir;
  // Beside the mapper files; SHA256SUMS does not list it and the loader ignores it.
  result.report_path = JoinPath(out_dir, kReportFileName);
  absl::Status report_written = WriteStringToFile(result.report_path, RenderReport(report));
  if (!report_written.ok()) return report_written;
  result.manifest = std::move(manifest);
  result.heldout = std::move(heldout);
  result.probe = *tables;
  result.warnings = std::move(warnings);
  return result;
}

absl::StatusOr<FitResult> RunFit(const FitOptions& options, const std::string& out_dir,
                                 const StatSet* plan_in) {
  if (options.kind == FitKind::kBoth) {
    return absl::InvalidArgumentError("RunFit fits one kind; --kind both is RunFitBoth");
  }
  if (options.granularity_both) {
    return absl::InvalidArgumentError(
        "RunFit fits one granularity; --granularity both is RunFitGranularityBoth");
  }
  if (options.solve.ridge.per_head && options.kind != FitKind::kMlp) {
    absl::Status heads = CheckHeadMatching(FitShape{options.source.spec, options.target.spec});
    if (!heads.ok()) return heads;
  }
  if (options.kind == FitKind::kMlp) {
    absl::Status valid = ValidateMlpOptions(options.mlp.train);
    if (!valid.ok()) return valid;
  }
  std::vector<std::string> warnings;
  absl::StatusOr<StatSet> plan = PlanOrProbe(options, plan_in, &warnings);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<StatSet> final_stats = AccumulateFinal(options, *plan);
  if (!final_stats.ok()) return final_stats.status();
  if (options.kind == FitKind::kMlp) {
    return TrainAndWriteMlp(options, *final_stats, out_dir, std::move(warnings));
  }
  return SolveAndWrite(*final_stats, options.solve, out_dir, std::move(warnings), &options);
}

absl::StatusOr<StatSet> MergeStatFiles(const std::vector<std::string>& paths) {
  if (paths.empty()) return absl::InvalidArgumentError("no shard files to merge");
  absl::StatusOr<StatSet> merged = ReadStatSet(paths[0]);
  if (!merged.ok()) return merged.status();
  for (size_t i = 1; i < paths.size(); ++i) {
    absl::StatusOr<StatSet> shard = ReadStatSet(paths[i]);
    if (!shard.ok()) return shard.status();
    absl::Status added = merged->Add(*shard, paths[i]);
    if (!added.ok()) return added;
  }
  return merged;
}

}  // namespace fit
}  // namespace kvt
