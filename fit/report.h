// The self-contained HTML report of `kvt fit`: probe R^2 heatmaps (source layer x target layer,
// K_stripped and V, as inline SVG like the paper's Figure 2), per-layer tables, calibration facts.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fit/solve.h"
#include "mapper_store/format/manifest.h"

namespace kvt {
namespace fit {

struct ReportData {
  std::string mapper_id;
  Manifest manifest;  // names, k, lambda, per-layer sigma and R^2
  ProbeTables probe;
  std::vector<std::pair<std::string, std::string>> facts;  // calibration facts, in order
  std::vector<std::string> warnings;
};

// Mean over target layers of one per-layer R^2 (r2_k, r2_v, r2_k_heldout or r2_v_heldout),
// optionally without target layer 0 (SPEC 5: layer 0 is a function of the current token and
// inflates every average). Layers without the value are skipped; nullopt if none has it.
enum class R2Field { kK, kV, kKHeldout, kVHeldout };
std::optional<double> MeanR2(const Manifest& manifest, R2Field field, bool skip_layer0);

// The whole page: no external scripts, styles or images.
std::string RenderReport(const ReportData& data);

}  // namespace fit
}  // namespace kvt
