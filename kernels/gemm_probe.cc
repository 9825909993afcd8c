#include "kernels/gemm_probe.h"

#include <cblas.h>

#include <algorithm>
#include <limits>
#include <map>
#include <utility>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/mutex.h"
#include "kernels/blas_core.h"
#include "kernels/dtype.h"
#include "kernels/onednn_matmul.h"

namespace kvt {
namespace {

// The largest `max_shapes` distinct shapes by k * n.
std::vector<GemmShape> ShapesToTime(const GemmProbeOptions& options) {
  std::vector<GemmShape> shapes;
  for (const GemmShape& shape : options.shapes) {
    if (shape.k <= 0 || shape.n <= 0) continue;
    if (std::find(shapes.begin(), shapes.end(), shape) == shapes.end()) shapes.push_back(shape);
  }
  if (shapes.empty()) shapes.push_back(kDefaultProbeShape);
  std::stable_sort(shapes.begin(), shapes.end(), [](const GemmShape& a, const GemmShape& b) {
    return a.k * a.n > b.k * b.n;
  });
  if (static_cast<int>(shapes.size()) > std::max(1, options.max_shapes)) {
    shapes.resize(std::max(1, options.max_shapes));
  }
  return shapes;
}

struct ProbeCache {
  using Key = std::pair<std::vector<std::pair<int64_t, int64_t>>, int64_t>;  // shapes, rows
  Mutex mu;
  std::map<Key, GemmProbeResult> results ABSL_GUARDED_BY(mu);
};

ProbeCache& TheProbeCache() {
  static ProbeCache* cache = new ProbeCache();
  return *cache;
}

double SecondsOf(const absl::Time start) { return absl::ToDoubleSeconds(absl::Now() - start); }

// The operands of one shape on every engine; values are small and non-zero (no subnormals).
struct ShapeOperands {
  ShapeOperands(const GemmShape& shape, int64_t rows)
      : x32(static_cast<size_t>(rows * shape.k)),
        w32(static_cast<size_t>(shape.k * shape.n)),
        y32(static_cast<size_t>(rows * shape.n)),
        x16(x32.size()) {
    for (size_t i = 0; i < x32.size(); ++i) x32[i] = 0.01f * static_cast<float>(i % 13);
    for (size_t i = 0; i < w32.size(); ++i) w32[i] = 0.02f * static_cast<float>(i % 7) - 0.05f;
    FromFloat(DType::kBF16, x32.data(), x16.data(), static_cast<int64_t>(x32.size()));
  }
  std::vector<float> x32, w32, y32;
  std::vector<uint16_t> x16;
  std::array<std::unique_ptr<PackedWeights>, kNumGemmEngines> packed;
};

// One call of `engine` on `ops`; false when the engine failed (it is then dropped).
bool RunEngine(GemmEngine engine, const GemmShape& shape, int64_t m, ShapeOperands& ops) {
  const PackedWeights* packed = ops.packed[static_cast<int>(engine)].get();
  switch (engine) {
    case GemmEngine::kSgemm:
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m),
                  static_cast<int>(shape.n), static_cast<int>(shape.k), 1.0f, ops.x32.data(),
                  static_cast<int>(shape.k), ops.w32.data(), static_cast<int>(shape.n), 0.0f,
                  ops.y32.data(), static_cast<int>(shape.n));
      return true;
    case GemmEngine::kOnednnBf16:
      return Bf16Matmul(m, ops.x16.data(), shape.k, *packed, nullptr, false, false,
                        ops.y32.data(), shape.n).ok();
    case GemmEngine::kOnednnF32:
      return F32Matmul(m, ops.x32.data(), shape.k, *packed, nullptr, false, ops.y32.data(),
                       shape.n).ok();
  }
  return false;
}

// Packs the oneDNN engines' weights; an engine that cannot pack is unavailable.
void PackFor(const GemmShape& shape, std::array<bool, kNumGemmEngines>* live,
             ShapeOperands* ops) {
  for (GemmEngine engine : {GemmEngine::kOnednnBf16, GemmEngine::kOnednnF32}) {
    const int e = static_cast<int>(engine);
    if (!(*live)[e]) continue;
    absl::StatusOr<std::unique_ptr<PackedWeights>> packed =
        PackWeights(engine == GemmEngine::kOnednnBf16 ? DType::kBF16 : DType::kFP32,
                    DType::kFP32, ops->w32.data(), shape.k, shape.n);
    (*live)[e] = packed.ok();
    if (packed.ok()) ops->packed[e] = *std::move(packed);
  }
}

}  // namespace

const char* GemmEngineName(GemmEngine engine) {
  switch (engine) {
    case GemmEngine::kOnednnBf16:
      return "onednn_bf16";
    case GemmEngine::kOnednnF32:
      return "onednn_f32";
    case GemmEngine::kSgemm:
      return "sgemm";
  }
  return "?";
}

bool IsFp32Engine(GemmEngine engine) { return engine != GemmEngine::kOnednnBf16; }

GemmEngine GemmProbeResult::Fastest(bool fp32_only) const {
  GemmEngine best = GemmEngine::kSgemm;
  for (int e = 0; e < kNumGemmEngines; ++e) {
    const GemmEngine engine = static_cast<GemmEngine>(e);
    if (!engines[e].available || (fp32_only && !IsFp32Engine(engine))) continue;
    if (engines[e].seconds < timing(best).seconds) best = engine;
  }
  const double sgemm = timing(GemmEngine::kSgemm).seconds;
  return sgemm < timing(best).seconds * kGemmSwitchMargin ? GemmEngine::kSgemm : best;
}

std::string GemmProbeResult::Summary() const {
  std::vector<std::string> dims, rates;
  for (const GemmShape& shape : shapes) dims.push_back(absl::StrCat(shape.k, "x", shape.n));
  for (int e = 0; e < kNumGemmEngines; ++e) {
    const std::string name = GemmEngineName(static_cast<GemmEngine>(e));
    rates.push_back(engines[e].available ? absl::StrFormat("%s %.1f", name, engines[e].gflops)
                                         : absl::StrCat(name, " unavailable"));
  }
  // sgemm's rate depends on the kernels OpenBLAS picked ("Prescott" on a CPU it does not know).
  const std::string core = OpenblasCoreName();
  return absl::StrFormat("%s GFLOP/s on %d shape%s x %d rows (%s); sgemm on OpenBLAS core %s",
                         absl::StrJoin(rates, ", "), static_cast<int>(shapes.size()),
                         shapes.size() == 1 ? "" : "s", rows, absl::StrJoin(dims, ", "),
                         core.empty() ? "?" : core);
}

GemmProbeResult ProbeGemmEngines(const GemmProbeOptions& options) {
  GemmProbeResult result;
  result.shapes = ShapesToTime(options);
  result.rows = std::max<int64_t>(1, options.rows);
  const int64_t m = result.rows;
  ScopedOmpThreads one(1);
  std::array<bool, kNumGemmEngines> live = {};
  live[static_cast<int>(GemmEngine::kOnednnBf16)] = OnednnBf16MatmulAvailable();
  live[static_cast<int>(GemmEngine::kOnednnF32)] = true;
  live[static_cast<int>(GemmEngine::kSgemm)] = true;
  double flops = 0;
  const absl::Duration per_shape = options.budget / static_cast<int>(result.shapes.size());
  for (const GemmShape& shape : result.shapes) {
    flops += 2.0 * m * shape.k * shape.n;
    ShapeOperands ops(shape, m);
    PackFor(shape, &live, &ops);
    std::array<double, kNumGemmEngines> best;
    best.fill(std::numeric_limits<double>::infinity());
    for (int e = 0; e < kNumGemmEngines; ++e) {  // untimed: primitive creation, page faults
      if (live[e]) live[e] = RunEngine(static_cast<GemmEngine>(e), shape, m, ops);
    }
    const absl::Time deadline = absl::Now() + per_shape;
    for (int call = 0; call < 2 || absl::Now() < deadline; ++call) {
      for (int e = 0; e < kNumGemmEngines; ++e) {  // interleaved: load hits every engine alike
        if (!live[e]) continue;
        const absl::Time start = absl::Now();
        live[e] = RunEngine(static_cast<GemmEngine>(e), shape, m, ops);
        best[e] = std::min(best[e], SecondsOf(start));
        ++result.engines[e].calls;
      }
    }
    for (int e = 0; e < kNumGemmEngines; ++e) result.engines[e].seconds += best[e];
  }
  for (int e = 0; e < kNumGemmEngines; ++e) {
    GemmEngineTiming& timing = result.engines[e];
    timing.available = live[e];
    timing.gflops = timing.available ? flops / timing.seconds / 1e9 : 0;
  }
  return result;
}

GemmProbeResult ProbeGemmEnginesOnce(const GemmProbeOptions& options) {
  ProbeCache& cache = TheProbeCache();
  ProbeCache::Key key;
  for (const GemmShape& shape : ShapesToTime(options)) key.first.emplace_back(shape.k, shape.n);
  key.second = options.rows;
  // Held while probing: two backends built at once must not time each other's load.
  MutexLock lock(&cache.mu);
  auto it = cache.results.find(key);
  if (it == cache.results.end()) it = cache.results.emplace(key, ProbeGemmEngines(options)).first;
  return it->second;
}

}  // namespace kvt
