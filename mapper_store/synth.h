// Deterministic random ("synthetic") mappers for tests, benchmarks and the demo: real shapes and
// RoPE of the paper's model pairs, or custom small shapes, with scale-preserving random weights.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"
#include "mapper_store/format/manifest.h"
#include "mapper_store/mapper.h"

namespace kvt {

struct SynthOptions {
  ModelSpec source;
  ModelSpec target;
  // Source layers per target layer; 0 means all of them ("k = all").
  int k = 0;
  DType dtype = DType::kBF16;
  uint64_t seed = 0;
  // Weights are N(0, (weight_scale / sqrt(fan_in))^2), fan_in = len(sigma) * n_s * d_s, so an
  // input with unit-variance features gives outputs of about unit variance: translated caches
  // keep the scale of real ones.
  double weight_scale = 1.0;
  // Biases are N(0, bias_scale^2): small, but not zero, so bias handling is exercised.
  double bias_scale = 0.01;
  // Set: an MLP mapper (kind: mlp) with this hidden width and granularity instead of ridge.
  // fc1 weights are N(0, (weight_scale / sqrt(fan_in))^2) like ridge's W; fc2 and fc3 get
  // sqrt(2) times that (fan_in = H), which makes up for the half of the second moment each ReLU
  // removes, so hidden activations and outputs stay O(1) for unit-variance inputs.
  std::optional<MlpConfig> mlp;
  // Ridge only: per_head writes a head-local mapper ([n_t, window |sigma| g d_s, d_t] per target
  // layer and K|V; fan_in = window |sigma| g d_s).
  RidgeGranularity ridge_granularity = RidgeGranularity::kPerLayer;
  // Use one list for K and V (as the paper does) instead of independent draws.
  bool shared_sigma = false;
  // > 1: a window mapper (manifest `window`): fan_in counts every offset's blocks.
  int window = 1;
  std::string created_by = "kvt synth 0.1";
};

// Shapes and RoPE of the models the paper uses, by Hugging Face name ("Qwen/Qwen3-14B", ...).
absl::StatusOr<ModelSpec> KnownModelSpec(absl::string_view model_name);
std::vector<std::string> KnownModelNames();

// Presets: "qwen3-14b-to-32b" (k=8), "qwen3-8b-to-32b" (k=12), "qwen3-32b-to-14b" (k=8),
// "llama3.1-8b-to-70b" (k=20), "ministral-3b-to-8b" (k=all), all bf16; and "demo-tiny"
// (4 layers -> 6 layers, 2 heads x 32, k=2, fp32) for the demo and quick checks. The paper-pair
// presets write GBs (qwen3-14b-to-32b: 1.07 B parameters, 2.1 GB in bf16).
std::vector<std::string> SynthPresetNames();
absl::StatusOr<SynthOptions> SynthPreset(absl::string_view preset);

// The manifest a synthetic mapper gets: synthetic: true, sigma lists drawn from the seed, the
// generator settings under `calibration`. INVALID_ARGUMENT for bad shapes / k / scales.
absl::StatusOr<Manifest> SynthManifest(const SynthOptions& options);

// Fills tensor `index` of MapperTensorSpecs(SynthManifest(options)). Deterministic: the bytes
// depend only on options (seed included), not on call order, so tensors can be made lazily.
absl::Status FillSynthTensor(const SynthOptions& options, const Manifest& manifest, size_t index,
                             absl::Span<uint8_t> dst);

// Generates and writes a synthetic mapper directory (one tensor in memory at a time).
// Same options -> byte-identical files.
absl::Status WriteSynthMapper(const std::string& dir, const SynthOptions& options,
                              const WriteOptions& write_options = {});

// A mapper held in memory only: the manifest, every tensor's bytes (MapperTensorSpecs order) and
// the view into them, valid while this object lives. Not copyable (the view points inside).
struct InMemoryMapper {
  InMemoryMapper() = default;
  InMemoryMapper(const InMemoryMapper&) = delete;
  InMemoryMapper& operator=(const InMemoryMapper&) = delete;

  Manifest manifest;
  std::vector<std::vector<uint8_t>> tensors;
  MapperView view;
};

// The synthetic mapper WriteSynthMapper would write, without a directory (same bytes), e.g. for
// kvtd's start-up self-check. Errors as SynthManifest.
absl::StatusOr<std::unique_ptr<InMemoryMapper>> MakeSynthMapperInMemory(
    const SynthOptions& options);

}  // namespace kvt
