// `kvt record-benefit`: a measured context benefit (`python -m kvt.qualify`'s JSON) merged into
// a mapper's manifest (quality.benefit), rewriting only manifest.yaml and SHA256SUMS.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "mapper_store/format/manifest.h"

namespace kvt {

// The entries of a benefit file, `{"benefit": [{"text": ..., "windows": ..., "context_tokens":
// ..., "continuation_tokens": ..., "recovered": ..., "lower95": ..., "upper95": ..., "kl": ...},
// ...]}`: every key required, no others, each entry valid (ValidateBenefitRecord), each text
// once. INVALID_ARGUMENT "<label>: ..." naming the field ("benefit[1].lower95 ...").
absl::StatusOr<std::vector<BenefitRecord>> ParseBenefitJson(absl::string_view text,
                                                            absl::string_view label);

// `existing` with each of `incoming` in place of the entry of the same text, or appended.
std::vector<BenefitRecord> MergeBenefit(std::vector<BenefitRecord> existing,
                                        const std::vector<BenefitRecord>& incoming);

// Loads the mapper directory `dir` with its checksums verified, merges the benefit file at
// `benefit_path` into its manifest and rewrites manifest.yaml and SHA256SUMS
// (RewriteMapperManifest); returns the merged list. On any error the directory is untouched.
absl::StatusOr<std::vector<BenefitRecord>> RecordBenefit(const std::string& dir,
                                                         const std::string& benefit_path);

}  // namespace kvt
