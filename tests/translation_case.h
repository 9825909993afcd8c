// One TranslateKV case checked end to end against the float64 reference: a fresh random source
// cache in the case's dtype and layout, positions by offset or explicit, the request through a
// real client, and the result's shape, dtype, layout, mapper and error checked (the service and
// MLP-serving tests run their case tables through it).
#pragma once

#include <cstdint>
#include <string>

#include "client/client.h"
#include "kernels/types.h"
#include "mapper_store/mapper.h"

namespace kvt {
namespace testing {

struct TranslationCase {
  std::string mapper;  // mapper id in the store (the request names the pair, not the id)
  DType dtype;
  Layout layout;
  DType output_dtype;
  Layout output_layout;
  int64_t tokens;
  uint64_t offset;
  bool explicit_positions;  // seeded random positions instead of offset + i
};

std::string Describe(const TranslationCase& c);

// Translates through `client` and expects the result to match the float64 reference of
// `mapper` within `tolerance` (SPEC 3 relative error).
void ExpectTranslationMatchesReference(Client& client, const LoadedMapper& mapper,
                                       const TranslationCase& c, uint64_t seed,
                                       double tolerance);

}  // namespace testing
}  // namespace kvt
