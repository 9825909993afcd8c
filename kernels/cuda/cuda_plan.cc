#include "kernels/cuda/cuda_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvt {
namespace cuda {

DType GemmDType(DType input, DType weights, DType output) {
  return input == weights && input == output ? input : DType::kFP32;
}

absl::StatusOr<StepPlan> PlanSteps(const StepShape& shape, int64_t token_chunk,
                                   int64_t budget_bytes) {
  if (shape.num_tokens < 0 || shape.num_layers <= 0 || shape.input_width <= 0 ||
      shape.target_width <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step shape: num_tokens=", shape.num_tokens, " num_layers=", shape.num_layers,
        " input_width=", shape.input_width, " target_width=", shape.target_width,
        " must be non-negative / positive"));
  }
  StepPlan plan;
  if (shape.num_tokens == 0) return plan;
  const int64_t g = static_cast<int64_t>(DTypeSize(shape.gemm_dtype));
  const int64_t k = shape.input_width, n = shape.target_width;
  // Device bytes of one step: layers * (tokens * per_layer_token + per_layer) +
  // tokens * per_token.
  const int64_t per_layer_token =
      2 * (k * g + n * 4) + shape.staged_target_bytes_per_layer_token;
  const int64_t per_layer = shape.convert_weights ? 2 * k * n * 4 : 0;
  const int64_t per_token =
      2 * 4 * static_cast<int64_t>(shape.rope_half_source + shape.rope_half_target) +
      shape.staged_source_bytes_per_token;
  const auto bytes = [&](int64_t layers, int64_t tokens) {
    return layers * (tokens * per_layer_token + per_layer) + tokens * per_token;
  };
  if (bytes(1, 1) > budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda workspace budget of ", budget_bytes, " bytes is below the ", bytes(1, 1),
        " bytes one token of one target layer needs (input width ", k, ", target width ", n,
        "); raise the CUDA backend's workspace_bytes"));
  }
  int64_t tokens = std::min(shape.num_tokens,
                            (budget_bytes - per_layer) / (per_layer_token + per_token));
  if (token_chunk > 0) tokens = std::min(tokens, token_chunk);
  // Multiples of 64 tokens keep the GEMM tiles whole, where the budget leaves room for one.
  if (tokens < shape.num_tokens && tokens >= 64) tokens -= tokens % 64;
  plan.num_chunks = static_cast<int>((shape.num_tokens + tokens - 1) / tokens);
  plan.chunk_tokens = (shape.num_tokens + plan.num_chunks - 1) / plan.num_chunks;

  int64_t layers = (budget_bytes - plan.chunk_tokens * per_token) /
                   (plan.chunk_tokens * per_layer_token + per_layer);
  layers = std::clamp<int64_t>(layers, 1, shape.num_layers);
  plan.num_groups = static_cast<int>((shape.num_layers + layers - 1) / layers);
  plan.layers_per_group = (shape.num_layers + plan.num_groups - 1) / plan.num_groups;

  const int64_t t = plan.chunk_tokens, l = plan.layers_per_group;
  plan.x_bytes = l * 2 * t * k * g;
  plan.y_bytes = l * 2 * t * n * 4;
  plan.weights32_bytes = l * per_layer;
  plan.table_bytes = t * 2 * 4 * static_cast<int64_t>(shape.rope_half_source +
                                                      shape.rope_half_target);
  plan.staged_source_bytes = t * shape.staged_source_bytes_per_token;
  plan.staged_target_bytes = l * t * shape.staged_target_bytes_per_layer_token;
  return plan;
}

absl::Status CudaCallStatus(const char* call, CudaFailure failure, int code,
                            const std::string& code_name, const std::string& description) {
  std::string message = absl::StrCat(call, " failed: ", code_name, " (", code, ")");
  if (!description.empty() && description != code_name) absl::StrAppend(&message, ": ", description);
  switch (failure) {
    case CudaFailure::kOutOfMemory:
      return absl::ResourceExhaustedError(
          absl::StrCat(message, "; GPU memory is exhausted (lower the workspace or free "
                                "device-resident mappers)"));
    case CudaFailure::kNoDevice:
      return absl::FailedPreconditionError(message);
    case CudaFailure::kNotSupported:
      return absl::UnimplementedError(message);
    case CudaFailure::kInvalidValue:
    case CudaFailure::kOther:
      return absl::InternalError(message);
  }
  return absl::InternalError(message);
}

}  // namespace cuda
}  // namespace kvt
