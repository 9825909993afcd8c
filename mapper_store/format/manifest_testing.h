// Test fixtures for manifests: the quality records tests of the gates build.
#pragma once

#include <string>

#include "mapper_store/format/manifest.h"

namespace kvt {

// A quality.benefit entry of 64 windows of 384 + 96 tokens, its interval reaching 0.1 above
// `recovered`.
inline BenefitRecord TestBenefitRecord(const std::string& text, double recovered,
                                       double lower95) {
  BenefitRecord record;
  record.text = text;
  record.windows = 64;
  record.context_tokens = 384;
  record.continuation_tokens = 96;
  record.recovered = recovered;
  record.lower95 = lower95;
  record.upper95 = recovered + 0.1;
  record.kl = 0.1;
  return record;
}

}  // namespace kvt
