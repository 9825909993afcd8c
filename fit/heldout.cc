// The held-out quality `kvt fit` records in a mapper's manifest: the fitted mapper as kvtd
// serves it (the written weight bytes, the CPU backend) translates each held-out sequence's
// source cache, and quality/kv_quality compares the target's causal attention over the result
// with its attention over its own cache, with its own queries (SPEC 5). One sequence at a time.
#include <algorithm>
#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "fit/fit.h"
#include "fit/fit_internal.h"
#include "fit/progress.h"
#include "kernels/backend.h"
#include "kernels/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/rope.h"
#include "mapper_store/mapper.h"
#include "quality/kv_quality.h"
#include "quality/mean_interval.h"

namespace kvt {
namespace fit {

absl::StatusOr<MapperView> MapperViewOf(const Manifest& manifest,
                                        const std::vector<TensorRef>& tensors) {
  // The loader's checks and view (mapper_store/mapper.cc), over the tensors in memory.
  std::vector<TensorSpec> specs;
  for (const TensorRef& t : tensors) specs.push_back(t.spec);
  if (absl::Status s = ValidateMapperTensors(manifest, specs); !s.ok()) {
    return absl::InternalError(absl::StrCat("held-out evaluation: ", s.message()));
  }
  return BuildMapperView(manifest, [&tensors](const std::string& name) {
    for (const TensorRef& t : tensors) {
      if (t.spec.name == name) return TensorWeightView(t.spec, t.bytes.data());
    }
    return WeightView();  // not reached: validated above
  });
}

absl::StatusOr<bool> HeldoutHasQueries(const FitOptions& options) {
  for (const SequencePair& pair : options.sequences) {
    if (!pair.heldout) continue;
    absl::StatusOr<DumpQueries> q = ReadDumpQueries(pair.target_path, options.target.spec);
    if (q.ok()) return true;
    if (!absl::IsNotFound(q.status())) return q.status();
  }
  return false;
}

absl::StatusOr<HeldoutQuality> MeasureHeldout(const FitOptions& options,
                                              const MapperView& mapper) {
  const ModelSpec& target = options.target.spec;
  absl::StatusOr<Rope> rope = Rope::Create(target.rope, target.head_dim);
  if (!rope.ok()) return rope.status();
  // The CPU backend sets OpenBLAS to one thread process-wide; set it back so that the quality
  // GEMMs (and the backend, which then runs its pieces serially) use the fit's threads.
  CpuBackendOptions backend_options;
  backend_options.num_threads = options.num_threads;
  std::unique_ptr<Backend> backend = NewCpuBackend(backend_options);
  SetBlasThreads(options.num_threads);
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend->Prepare(mapper);
  if (!prepared.ok()) return prepared.status();

  const int L = target.num_layers, n_t = target.num_kv_heads, d = target.head_dim;
  int todo = 0;
  for (const SequencePair& pair : options.sequences) todo += pair.heldout ? 1 : 0;
  std::unique_ptr<Progress> progress;
  if (options.solve.show_progress) {
    progress = std::make_unique<Progress>("held-out quality", todo, "sequences", options.solve.log);
  }
  const auto start = std::chrono::steady_clock::now();
  HeldoutQuality total;
  total.layer_attention_cosine.assign(L, 0.0);
  for (const SequencePair& pair : options.sequences) {
    if (!pair.heldout) continue;
    absl::StatusOr<DumpQueries> queries = ReadDumpQueries(pair.target_path, target);
    if (absl::IsNotFound(queries.status())) {
      if (progress) progress->Advance(1, 0);
      continue;
    }
    if (!queries.ok()) return queries.status();
    absl::StatusOr<PairCaches> caches = ReadPairCaches(pair, options.source.spec, target);
    if (!caches.ok()) return caches.status();
    const int64_t T = caches->source.num_tokens;
    if (T != queries->num_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(pair.target_path, ": ", queries->num_tokens,
                                                     " query tokens but ", T, " KV tokens"));
    }
    const Positions positions{0, caches->positions.data()};
    const CacheView source = caches->source.view();
    // Translated into the target dump's dtype: the cache the target model would decode from.
    const DType out_dtype = caches->target.dtype;
    const int64_t layer_elements = int64_t{n_t} * T * d;
    std::vector<char> out_k(layer_elements * DTypeSize(out_dtype)),
        out_v(layer_elements * DTypeSize(out_dtype));
    std::vector<float> mapped_k(layer_elements), mapped_v(layer_elements),
        true_k(layer_elements), true_v(layer_elements);
    std::vector<LayerQuality> layers;
    for (int l = 0; l < L; ++l) {
      MutableCacheView result;
      result.dtype = out_dtype;
      result.layout = Layout::kHND;
      result.num_kv_heads = n_t;
      result.head_dim = d;
      result.num_tokens = T;
      result.k.assign(L, nullptr);
      result.v.assign(L, nullptr);
      result.k[l] = out_k.data();
      result.v[l] = out_v.data();
      absl::Status translated =
          backend->TranslateLayer(**prepared, l, source, positions, TranslateOptions(), &result);
      if (!translated.ok()) {
        return absl::Status(translated.code(), absl::StrCat(pair.source_path, " target layer ", l,
                                                            ": ", translated.message()));
      }
      ToTokenMajorFloat(out_dtype, Layout::kHND, n_t, T, d, out_k.data(), mapped_k.data());
      ToTokenMajorFloat(out_dtype, Layout::kHND, n_t, T, d, out_v.data(), mapped_v.data());
      ToTokenMajorFloat(caches->target.dtype, Layout::kHND, n_t, T, d,
                        caches->target.k[l].data(), true_k.data());
      ToTokenMajorFloat(caches->target.dtype, Layout::kHND, n_t, T, d,
                        caches->target.v[l].data(), true_v.data());
      LayerQualityInputs inputs;
      inputs.num_tokens = T;
      inputs.num_kv_heads = n_t;
      inputs.head_dim = d;
      inputs.num_query_heads = queries->num_query_heads;
      inputs.k_mapped = mapped_k.data();
      inputs.v_mapped = mapped_v.data();
      inputs.k_true = true_k.data();
      inputs.v_true = true_v.data();
      inputs.queries = queries->layers[l].data();
      absl::StatusOr<LayerQuality> quality = ComputeLayerQuality(inputs, *rope, positions);
      if (!quality.ok()) {
        return absl::Status(quality.status().code(),
                            absl::StrCat(pair.target_path, " layer ", l, ": ",
                                         quality.status().message()));
      }
      total.layer_attention_cosine[l] += quality->attention_cosine.value_or(0);
      layers.push_back(*quality);
    }
    const QualitySummary summary = SummarizeQuality(layers);
    total.sequences += 1;
    total.tokens += T;
    total.attention_cosine += summary.all.attention_cosine.value_or(0);
    const double sequence_cosine =
        (L > 1 ? summary.without_layer0 : summary.all).attention_cosine.value_or(0);
    total.attention_cosine_without_layer0 += sequence_cosine;
    total.sequence_attention_cosine.push_back(sequence_cosine);
    total.kv_cosine += KvCosineOverLayers(layers);
    total.c_k += summary.all.c_k.value_or(0);
    total.c_v += summary.all.c_v.value_or(0);
    total.r2_k += summary.all.r2_k;
    total.r2_v += summary.all.r2_v;
    if (progress) progress->Advance(1, T);
  }
  if (progress) progress->Finish();
  if (total.sequences == 0) {
    return absl::FailedPreconditionError(
        "no held-out sequence has target queries: dump the target with tools/dump_kv.py "
        "--queries and keep --heldout_fraction > 0");
  }
  for (double* v : {&total.attention_cosine, &total.attention_cosine_without_layer0, &total.c_k,
                    &total.c_v, &total.r2_k, &total.r2_v, &total.kv_cosine}) {
    *v /= total.sequences;
  }
  for (double& v : total.layer_attention_cosine) v /= total.sequences;
  total.attention_cosine_lower95 = MeanWithLowerBound(total.sequence_attention_cosine).lower95;
  total.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return total;
}

}  // namespace fit
}  // namespace kvt
