// The backend conformance suite: one table of random translation cases (every RoPE type and
// style, shape, sigma length, dtype, layout, position and token chunk; ridge and MLP mappers)
// that every Backend must match the float64 reference on, within SPEC 3's tolerances. A backend
// test instantiates BackendConformanceTest with a ConformanceBackend that translates and checks
// one case its own way (the CPU backend on each GEMM path, CUDA through device, host and mixed
// caches). Both backends execute the one TranslationPlan (kernels/translation_plan.h), whose
// stages translation_plan_test checks; this suite checks how each executor runs them.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/testing/reference.h"
#include "kernels/types.h"

namespace kvt {
namespace testing {

struct ConformanceCase {
  RandomMapperSpec spec;
  DType in_dtype = DType::kFP32;
  DType out_dtype = DType::kFP32;
  Layout in_layout = Layout::kHND;
  Layout out_layout = Layout::kHND;
  int64_t tokens = 37;
  uint64_t offset = 0;
  bool explicit_positions = false;
  int64_t chunk = 0;            // TranslateOptions::token_chunk
  int64_t workspace_bytes = 0;  // backends with a workspace; 0: the backend default
  // > 0: replaces SPEC 3's tolerance where a backend's GEMMs read bf16 (the CPU's oneDNN path,
  // CUDA with bf16 caches and weights); see MlpBothGranularitiesFp32AndBf16 for the narrow
  // hidden layers that need it.
  double bf16_gemm_tolerance = 0;
  // > 0: the same for a backend whose GEMMs read fp16 (CUDA when cache, weights and output are
  // all fp16); see MlpMixedDtypesConvertWeights.
  double fp16_gemm_tolerance = 0;
};

std::string Describe(const ConformanceCase& c);

// The spec of an MLP mapper (kind: mlp), otherwise RandomMapperSpec's defaults.
RandomMapperSpec MlpSpec(bool per_head, int hidden);

// A case's random inputs: mapper, source cache and positions, drawn from `seed`.
struct ConformanceInputs {
  RandomMapper mapper;
  OwnedCache source;
  std::vector<uint64_t> explicit_positions;  // Positions points into it when the case asks
  Positions positions;
  TranslateOptions options;

  // A poisoned (NaN) target cache of the case's output shape, dtype and layout.
  OwnedCache NewTarget(const ConformanceCase& c) const;
};

ConformanceInputs MakeConformanceInputs(const ConformanceCase& c, uint64_t seed);

// Every layer and kind of `target` against the float64 reference, within `tolerance`.
void ExpectMatchesReference(const char* what, const ConformanceInputs& inputs,
                            const MutableCacheView& target, double tolerance);

// One backend under the suite.
struct ConformanceBackend {
  std::string name;  // the instantiation's parameter name
  // The caches' dtype in cases about something else (fp32 on the CPU, bf16 on CUDA).
  DType cache_dtype = DType::kFP32;
  // Whether the backend has a workspace that ConformanceCase::workspace_bytes sizes (a case
  // runs once more with a small one, forcing token chunks and layer groups).
  bool has_workspace = false;
  // Null, or whether the backend can run here at all: an error fails each test before its first
  // case (CUDA without a device).
  std::function<absl::Status()> ready;
  // Translates `c` on inputs drawn from MakeConformanceInputs(c, seed) and checks the result
  // (gtest assertions). The suite has put Describe(c) and the seed on the trace.
  std::function<void(const ConformanceCase& c, uint64_t seed)> check;
};

class BackendConformanceTest : public ::testing::TestWithParam<ConformanceBackend> {
 protected:
  void SetUp() override;
  // A case with the backend's cache dtype on both sides.
  ConformanceCase NewCase() const;
  // Seeds, traces and checks `c` through the backend.
  void CheckCase(const ConformanceCase& c) const;
};

// gtest prints a parameter by its name.
void PrintTo(const ConformanceBackend& backend, std::ostream* os);

// For INSTANTIATE_TEST_SUITE_P: the parameter's name.
std::string ConformanceBackendName(const ::testing::TestParamInfo<ConformanceBackend>& info);

}  // namespace testing
}  // namespace kvt
