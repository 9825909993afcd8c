#include "server/backend_self_check.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "kernels/dtype.h"
#include "kernels/reference.h"
#include "mapper_store/format/manifest.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

// Small, but with every feature a request can have: unmatched shapes (2 x 32 -> 3 x 16), k = 2
// of 3 source layers in a drawn order, neox source RoPE and interleaved (gptj) target RoPE with
// different theta, positions past 4096, a token count that is not a multiple of the chunk, both
// cache layouts, both MLP granularities.
constexpr int kSourceLayers = 3, kSourceHeads = 2, kSourceHeadDim = 32;
constexpr int kTargetLayers = 2, kTargetHeads = 3, kTargetHeadDim = 16;
constexpr int kSigma = 2;
constexpr int64_t kMlpHidden = 32;
constexpr int64_t kTokens = 37;
constexpr int64_t kTokenChunk = 16;
constexpr uint64_t kFirstPosition = 4093;
constexpr uint64_t kSeed = 0x5e1fc4ec;

SynthOptions CaseOptions(const SelfCheckCase& test, uint64_t seed) {
  SynthOptions options;
  options.source = NeoxModelSpec("kvt-self-check-source", kSourceLayers, kSourceHeads,
                                 kSourceHeadDim, 10000.0);
  options.target = NeoxModelSpec("kvt-self-check-target", kTargetLayers, kTargetHeads,
                                 kTargetHeadDim, 1000000.0);
  options.target.rope.style = RopeStyle::kGptj;
  options.k = kSigma;
  options.dtype = test.dtype;
  options.seed = seed;
  options.bias_scale = 0.5;  // large enough that a dropped bias shows at bf16 precision
  options.created_by = "kvtd self-check";
  if (test.kind == MapKind::kMlp) {
    MlpConfig mlp;
    mlp.hidden = kMlpHidden;
    mlp.granularity =
        test.dtype == DType::kFP32 ? MlpGranularity::kPerHead : MlpGranularity::kPerLayer;
    options.mlp = mlp;
  }
  return options;
}

// One model's cache, owning its bytes.
struct Cache {
  std::vector<std::vector<uint8_t>> k, v;
  CacheView view;
  MutableCacheView mutable_view;
};

Cache MakeCache(int layers, int heads, int head_dim, DType dtype, Layout layout,
                std::mt19937_64* rng) {
  Cache cache;
  const int64_t count = kTokens * heads * head_dim;
  cache.k.assign(layers, std::vector<uint8_t>(count * DTypeSize(dtype), 0xff));
  cache.v = cache.k;
  std::normal_distribution<double> normal(0.0, 1.0);
  for (auto* view : {&cache.view}) {
    view->dtype = dtype, view->layout = layout, view->num_kv_heads = heads;
    view->head_dim = head_dim, view->num_tokens = kTokens;
  }
  cache.mutable_view.dtype = dtype, cache.mutable_view.layout = layout;
  cache.mutable_view.num_kv_heads = heads, cache.mutable_view.head_dim = head_dim;
  cache.mutable_view.num_tokens = kTokens;
  for (int l = 0; l < layers; ++l) {
    if (rng != nullptr) {  // a source: N(0, 1) entries; an output stays 0xff (NaN) until written
      for (int64_t i = 0; i < count; ++i) {
        StoreFromDouble(dtype, cache.k[l].data(), i, normal(*rng));
        StoreFromDouble(dtype, cache.v[l].data(), i, normal(*rng));
      }
    }
    cache.view.k.push_back(cache.k[l].data());
    cache.view.v.push_back(cache.v[l].data());
    cache.mutable_view.k.push_back(cache.k[l].data());
    cache.mutable_view.v.push_back(cache.v[l].data());
  }
  return cache;
}

absl::Status Annotate(const char* what, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

// The request path's calls: streamed preparation, then one TranslateLayer per target layer in
// chunks of kTokenChunk tokens.
absl::Status Translate(Backend& backend, const MapperView& mapper, const CacheView& source,
                       const Positions& positions, MutableCacheView* target) {
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend.BeginPrepare(mapper);
  if (!prepared.ok()) return Annotate("BeginPrepare", prepared.status());
  for (int l = 0; l < mapper.target.num_layers; ++l) {
    absl::Status status = backend.PrepareLayer(**prepared, l);
    if (!status.ok()) return Annotate(absl::StrCat("PrepareLayer(", l, ")").c_str(), status);
  }
  TranslateOptions options;
  options.token_chunk = kTokenChunk;
  for (int l = 0; l < mapper.target.num_layers; ++l) {
    absl::Status status = backend.TranslateLayer(**prepared, l, source, positions, options, target);
    if (!status.ok()) return Annotate(absl::StrCat("TranslateLayer(", l, ")").c_str(), status);
  }
  return absl::OkStatus();
}

double MaxError(const MapperView& mapper, const MutableCacheView& actual,
                const std::function<std::vector<double>(int, reference::Kind)>& expected) {
  double error = 0;
  for (int l = 0; l < mapper.target.num_layers; ++l) {
    for (reference::Kind kind : {reference::Kind::kK, reference::Kind::kV}) {
      error = std::max(error,
                       reference::MaxRelError(reference::ReadLayer(actual, l, kind),
                                              expected(l, kind)));
    }
  }
  return error;
}

void RunCase(Backend& backend, Backend* cpu, uint64_t seed, SelfCheckCaseResult* result) {
  const SelfCheckCase& test = result->test;
  absl::StatusOr<std::unique_ptr<InMemoryMapper>> mapper =
      MakeSynthMapperInMemory(CaseOptions(test, seed));
  if (!mapper.ok()) {
    result->status = Annotate("synthetic mapper", mapper.status());
    return;
  }
  const MapperView& view = (*mapper)->view;
  if (absl::Status valid = CheckMapperView(view); !valid.ok()) {
    result->status = Annotate("synthetic mapper", valid);
    return;
  }
  const Layout layout = (test.kind == MapKind::kRidge) == (test.dtype == DType::kFP32)
                            ? Layout::kHND
                            : Layout::kNHD;
  std::mt19937_64 rng(seed);
  const Cache source =
      MakeCache(kSourceLayers, kSourceHeads, kSourceHeadDim, test.dtype, layout, &rng);
  Cache target = MakeCache(kTargetLayers, kTargetHeads, kTargetHeadDim, test.dtype, layout, nullptr);
  Positions positions;
  positions.offset = kFirstPosition;

  result->status = Translate(backend, view, source.view, positions, &target.mutable_view);
  if (!result->status.ok()) return;
  result->error_vs_reference =
      MaxError(view, target.mutable_view, [&](int l, reference::Kind kind) {
        return reference::ReferenceTranslate(view, l, kind, source.view, positions);
      });
  if (cpu == nullptr) return;
  Cache on_cpu = MakeCache(kTargetLayers, kTargetHeads, kTargetHeadDim, test.dtype, layout, nullptr);
  if (absl::Status status = Translate(*cpu, view, source.view, positions, &on_cpu.mutable_view);
      !status.ok()) {
    result->status = Annotate("the CPU backend (for comparison)", status);
    return;
  }
  result->error_vs_cpu = MaxError(view, target.mutable_view, [&](int l, reference::Kind kind) {
    return reference::ReadLayer(on_cpu.mutable_view, l, kind);
  });
}

std::string Sci(double value) { return absl::StrFormat("%.2e", value); }

}  // namespace

std::string SelfCheckCase::name() const {
  return absl::StrCat(kind == MapKind::kMlp ? "mlp" : "ridge", "/", DTypeName(dtype));
}

std::vector<SelfCheckCase> DefaultSelfCheckCases() {
  return {{MapKind::kRidge, DType::kFP32},
          {MapKind::kRidge, DType::kBF16},
          {MapKind::kMlp, DType::kFP32},
          {MapKind::kMlp, DType::kBF16}};
}

bool SelfCheckCaseResult::passed() const {
  // Written as "not greater" would let NaN through; these comparisons are false for NaN.
  return status.ok() && error_vs_reference <= tolerance &&
         (!error_vs_cpu.has_value() || *error_vs_cpu <= cpu_tolerance);
}

std::string SelfCheckCaseResult::Describe() const {
  const std::string name = test.name();
  if (!status.ok()) return absl::StrCat(name, ": ", status.ToString());
  std::vector<std::string> failures;
  if (!(error_vs_reference <= tolerance)) {
    failures.push_back(absl::StrCat("max relative error ", Sci(error_vs_reference),
                                    " vs the float64 reference exceeds the SPEC 3 tolerance ",
                                    Sci(tolerance)));
  }
  if (error_vs_cpu.has_value() && !(*error_vs_cpu <= cpu_tolerance)) {
    failures.push_back(absl::StrCat("max relative error ", Sci(*error_vs_cpu),
                                    " vs the CPU backend exceeds ", Sci(cpu_tolerance)));
  }
  if (!failures.empty()) return absl::StrCat(name, ": ", absl::StrJoin(failures, "; "));
  std::string text = absl::StrCat(name, " ok (max rel. error ", Sci(error_vs_reference),
                                  " vs float64");
  if (error_vs_cpu.has_value()) absl::StrAppend(&text, ", ", Sci(*error_vs_cpu), " vs cpu");
  absl::StrAppend(&text, "; tolerance ", Sci(tolerance), ")");
  return text;
}

bool SelfCheckReport::passed() const {
  if (cases.empty()) return false;
  for (const SelfCheckCaseResult& c : cases) {
    if (!c.passed()) return false;
  }
  return true;
}

std::string SelfCheckReport::result() const {
  if (passed()) return "pass";
  for (const SelfCheckCaseResult& c : cases) {
    if (!c.status.ok()) return "error";
  }
  return "mismatch";
}

std::string SelfCheckReport::Summary() const {
  std::vector<std::string> parts;
  for (const SelfCheckCaseResult& c : cases) {
    if (passed() || !c.passed()) parts.push_back(c.Describe());
  }
  if (cases.empty()) parts.push_back("no cases ran");
  return absl::StrCat(device, " self-check ", passed() ? "passed: " : "failed: ", cases.size(),
                      " cases in ", absl::StrFormat("%.1f", seconds * 1e3), " ms (",
                      absl::StrJoin(parts, "; "), ")");
}

void LogSelfCheck(const SelfCheckReport& report) {
  LogLine(report.passed() ? LogLevel::kInfo : LogLevel::kWarning,
          report.passed() ? "backend self-check passed" : "backend self-check failed")
      .With("backend", report.backend)
      .With("device", report.device)
      .With("result", report.result())
      .With("ms", report.seconds * 1e3)
      .With("summary", report.Summary());
}

SelfCheckReport RunBackendSelfCheck(Backend& backend, Backend* cpu,
                                    const std::vector<SelfCheckCase>& cases) {
  const auto begin = std::chrono::steady_clock::now();
  SelfCheckReport report;
  report.backend = backend.name();
  report.device = backend.device();
  for (size_t i = 0; i < cases.size(); ++i) {
    SelfCheckCaseResult result;
    result.test = cases[i];
    result.tolerance = reference::TranslationTolerance(cases[i].dtype);
    result.cpu_tolerance = 2 * result.tolerance;
    const auto case_begin = std::chrono::steady_clock::now();
    try {
      RunCase(backend, cpu == &backend ? nullptr : cpu, kSeed + i, &result);
    } catch (const std::exception& e) {
      result.status = absl::InternalError(absl::StrCat("exception: ", e.what()));
    }
    result.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - case_begin).count();
    report.cases.push_back(std::move(result));
  }
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return report;
}

}  // namespace kvt
