// Importer of the vllm-project/semantic-router `src/training/kv_mapper` artifact (manifest.json +
// weights.safetensors + SHA256SUMS, tensors target.{L}.{k,v}.{W,b}) into a kvt mapper directory.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"
#include "mapper_store/format/manifest.h"

namespace kvt {

inline constexpr char kSemanticRouterManifestFile[] = "manifest.json";
inline constexpr char kSemanticRouterWeightsFile[] = "weights.safetensors";

// compatibility.variant. full_head: every target head reads every source head of the selected
// layers. per_head: target head h reads source head h of each selected layer only.
enum class SemanticRouterVariant { kFullHead, kPerHead };

// manifest.json as artifact.py's Manifest / CompatibilitySpec write it (schema_version 1).
struct SemanticRouterManifest {
  int schema_version = 1;
  std::string mapper_id;
  // compatibility.*
  std::string source_model, source_revision, target_model, target_revision;
  SemanticRouterVariant variant = SemanticRouterVariant::kFullHead;
  std::string precision;  // the deployment's KV dtype, e.g. "fp16"; the weights are float32
  int source_tp = 1, target_tp = 1;
  std::string head_order;  // "contiguous"
  int num_kv_heads = 0;    // one KV shape for both models: the format has no second one
  int head_dim = 0;
  int topk = 0;
  double ridge_alpha = 0;  // added to the centred, un-normalised X^T X (kvt lambda_scale: sum)
  bool centered_inputs = false;
  bool rope_stripped_on_keys = false;
  // source_layers_per_target.{k,v}: entry l lists target layer l's source layers in stored order
  // (the order of W's row blocks).
  std::vector<std::vector<int>> sources_k, sources_v;
  std::string calibration_json;   // the free-form calibration object, compact JSON ("{}" if none)
  std::string evaluation_report;  // empty when null or absent
};

// Parses manifest.json text. Errors are INVALID_ARGUMENT "<label>: <field> ..." naming the field
// (e.g. "compatibility.variant 'foo' is not supported"); nothing throws.
absl::StatusOr<SemanticRouterManifest> ParseSemanticRouterManifest(
    absl::string_view json_text, absl::string_view label = kSemanticRouterManifestFile);

struct SemanticRouterImportOptions {
  // Each model's Hugging Face config.json (or the directory holding it): layers, KV shape and
  // RoPE, which the semantic-router artifact does not store (its keys are pre-RoPE).
  std::string source_config, target_config;
  // Used when the config path is empty: num_kv_heads / head_dim 0 take the manifest's; the
  // target's num_layers 0 takes the manifest's target layer count. The source's num_layers and
  // both RoPE settings must be given.
  ModelSpec source_spec, target_spec;
  // The model names requests will use; empty takes compatibility.source_model / target_model.
  std::string source_name, target_name;
  // dtype of the written weights (the artifact's float32 is exact; bf16 halves the size).
  DType weights_dtype = DType::kFP32;
  bool overwrite = false;  // replace an existing mapper directory at the destination
};

struct SemanticRouterImportResult {
  SemanticRouterManifest original;
  Manifest manifest;  // what was written
};

// Reads `in_dir` (SHA256SUMS verified first: NOT_FOUND if missing, DATA_LOSS "checksum mismatch
// for <file>", FAILED_PRECONDITION if an entry is missing), parses manifest.json, reads the
// weights, checks every tensor name, dtype (F32), shape and value (finite; per_head: zero outside
// the head blocks) against the manifest and the two models (INVALID_ARGUMENT naming the tensor or
// field; UNIMPLEMENTED for artifacts kvt cannot represent, e.g. keys fitted post-RoPE), converts
// to a ridge mapper (the row and column conventions are kvt's already; per_head is expanded to
// the equivalent dense matrix) and writes it to `out_dir` with WriteMapperDir.
absl::StatusOr<SemanticRouterImportResult> ImportSemanticRouterMapper(
    const std::string& in_dir, const std::string& out_dir,
    const SemanticRouterImportOptions& options);

}  // namespace kvt
