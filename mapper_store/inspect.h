// The human-readable report of `kvt inspect DIR`: manifest summary, sizes, and per target layer
// the source-layer lists and fit R^2.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "mapper_store/format/manifest.h"
#include "mapper_store/mapper.h"

namespace kvt {

// Report from a manifest alone (sizes computed from its shapes). `id` heads the report.
std::string InspectManifest(const Manifest& manifest, const std::string& id);
// Report of a loaded (hence validated and checksum-verified) mapper.
std::string InspectMapper(const LoadedMapper& mapper);
// Loads `dir` and reports on it; the loader's error if it does not load.
absl::StatusOr<std::string> InspectMapperDir(const std::string& dir,
                                             const LoadOptions& options = {});

// One quality.benefit entry on a line: "python-docs-heldout: recovered 0.64 [0.5, 0.86], KL 0.12
// nats/token (64 windows, 384 + 96 tokens)".
std::string DescribeBenefit(const BenefitRecord& record);

// "2.00 GiB", "512 B", "1.50 KiB".
std::string HumanBytes(uint64_t bytes);
// "1.07 B", "12.3 M", "4.1 K", "17".
std::string HumanCount(int64_t count);

}  // namespace kvt
