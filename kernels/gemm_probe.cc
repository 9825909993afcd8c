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

// The operands of one shape on both engines; values are small and non-zero (no subnormals).
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
  std::unique_ptr<PackedBf16Weights> packed;
};

}  // namespace

std::string GemmProbeResult::Summary() const {
  std::vector<std::string> dims;
  for (const GemmShape& shape : shapes) dims.push_back(absl::StrCat(shape.k, "x", shape.n));
  const std::string onednn =
      onednn_bf16.available ? absl::StrFormat("%.1f GFLOP/s", onednn_bf16.gflops)
                            : std::string("unavailable");
  return absl::StrFormat("onednn_bf16 %s vs sgemm %.1f GFLOP/s on %d shape%s x %d rows (%s)",
                         onednn, sgemm.gflops, static_cast<int>(shapes.size()),
                         shapes.size() == 1 ? "" : "s", rows, absl::StrJoin(dims, ", "));
}

GemmProbeResult ProbeGemmEngines(const GemmProbeOptions& options) {
  GemmProbeResult result;
  result.shapes = ShapesToTime(options);
  result.rows = std::max<int64_t>(1, options.rows);
  const int64_t m = result.rows;
  ScopedOmpThreads one(1);
  result.onednn_bf16.available = OnednnBf16MatmulAvailable();
  result.sgemm.available = true;
  double flops = 0;
  const absl::Duration per_shape = options.budget / static_cast<int>(result.shapes.size());
  for (const GemmShape& shape : result.shapes) {
    flops += 2.0 * m * shape.k * shape.n;
    ShapeOperands ops(shape, m);
    bool onednn = result.onednn_bf16.available;
    if (onednn) {
      absl::StatusOr<std::unique_ptr<PackedBf16Weights>> packed =
          PackBf16Weights(DType::kFP32, ops.w32.data(), shape.k, shape.n);
      onednn = packed.ok();
      if (onednn) ops.packed = *std::move(packed);
    }
    const auto run_sgemm = [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m),
                  static_cast<int>(shape.n), static_cast<int>(shape.k), 1.0f, ops.x32.data(),
                  static_cast<int>(shape.k), ops.w32.data(), static_cast<int>(shape.n), 0.0f,
                  ops.y32.data(), static_cast<int>(shape.n));
    };
    const auto run_onednn = [&] {
      return Bf16Matmul(m, ops.x16.data(), shape.k, *ops.packed, nullptr, false, false,
                        ops.y32.data(), shape.n).ok();
    };
    // Untimed first calls: primitive creation, page faults of the output.
    run_sgemm();
    if (onednn) onednn = run_onednn();
    double best_sgemm = std::numeric_limits<double>::infinity();
    double best_onednn = onednn ? best_sgemm : 0;
    const absl::Time deadline = absl::Now() + per_shape;
    for (int call = 0; call < 2 || absl::Now() < deadline; ++call) {
      absl::Time start = absl::Now();
      run_sgemm();
      best_sgemm = std::min(best_sgemm, SecondsOf(start));
      ++result.sgemm.calls;
      if (!onednn) continue;
      start = absl::Now();
      onednn = run_onednn();
      best_onednn = std::min(best_onednn, SecondsOf(start));
      ++result.onednn_bf16.calls;
    }
    result.sgemm.seconds += best_sgemm;
    result.onednn_bf16.seconds += best_onednn;
    result.onednn_bf16.available = result.onednn_bf16.available && onednn;
  }
  result.sgemm.gflops = flops / result.sgemm.seconds / 1e9;
  if (result.onednn_bf16.available) {
    result.onednn_bf16.gflops = flops / result.onednn_bf16.seconds / 1e9;
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
