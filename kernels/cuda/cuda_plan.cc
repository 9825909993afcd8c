#include "kernels/cuda/cuda_plan.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvt {
namespace cuda {

namespace {

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

}  // namespace

absl::StatusOr<DeviceLayout> DeviceLayoutOf(const MapperView& mapper) {
  if (mapper.window < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("mapper.window=", mapper.window, " must be >= 1"));
  }
  DeviceLayout layout;
  layout.kind = mapper.kind;
  layout.window = mapper.window;
  const bool mlp = mapper.kind == MapKind::kMlp;
  bool first = true;
  const auto agree = [&](DType dtype) {
    if (first) layout.weight_dtype = dtype;
    if (dtype != layout.weight_dtype) layout.weight_dtype = DType::kFP32;
    first = false;
  };
  for (const LayerMapView& layer : mapper.layers) {
    if (mlp) {
      for (const MlpView* chain : {&layer.mlp_k, &layer.mlp_v}) {
        for (const WeightView* w : {&chain->a1, &chain->a2, &chain->a3}) agree(w->dtype);
      }
    } else {
      agree(layer.w_k.dtype);
      agree(layer.w_v.dtype);
    }
    layout.max_blocks = std::max<int>(
        layout.max_blocks, static_cast<int>(std::max(layer.sigma_k.size(), layer.sigma_v.size())));
  }
  for (const LayerMapView& layer : mapper.layers) {
    if (static_cast<int>(layer.sigma_k.size()) != layout.max_blocks ||
        static_cast<int>(layer.sigma_v.size()) != layout.max_blocks) {
      layout.padded = true;
    }
  }
  layout.input_width = static_cast<int64_t>(layout.window) * layout.max_blocks *
                       mapper.source.num_kv_heads * mapper.source.head_dim;
  layout.target_width = static_cast<int64_t>(mapper.target.num_kv_heads) * mapper.target.head_dim;
  if (mapper.head_local) {
    if (absl::Status s = CheckHeadLocalHeads(mapper.source, mapper.target); !s.ok()) return s;
    layout.ridge_heads = mapper.target.num_kv_heads;
    layout.group = HeadLocalSources(mapper.source, mapper.target, 0).count;
    layout.chain_width = static_cast<int64_t>(layout.window) * layout.max_blocks * layout.group *
                         mapper.source.head_dim;
    layout.head_out = mapper.target.head_dim;
  }
  if (mlp && !mapper.layers.empty()) {
    const MlpView& head = mapper.layers[0].mlp_k;
    layout.heads = head.heads;
    layout.hidden = head.hidden;
    layout.head_out = head.heads > 0 ? layout.target_width / head.heads : 0;
    for (size_t l = 0; l < mapper.layers.size(); ++l) {
      const char* names[2] = {"mlp_k", "mlp_v"};
      const MlpView* chains[2] = {&mapper.layers[l].mlp_k, &mapper.layers[l].mlp_v};
      for (int kind = 0; kind < 2; ++kind) {
        if (chains[kind]->heads != layout.heads || chains[kind]->hidden != layout.hidden) {
          return absl::InvalidArgumentError(absl::StrCat(
              "layers[", l, "].", names[kind], " has heads=", chains[kind]->heads,
              " hidden=", chains[kind]->hidden, " but layers[0].mlp_k has heads=", layout.heads,
              " hidden=", layout.hidden,
              ": the cuda backend needs one granularity and hidden width for the whole mapper"));
        }
      }
    }
  }
  for (const auto& [name, value] :
       {std::pair<const char*, int64_t>{"input width window * |sigma| * n_s * d_s",
                                        layout.input_width},
        {"target width n_t * d_t", layout.target_width},
        {"MLP hidden width heads * hidden", layout.hidden_width()},
        {"per_head gathered width n_t * window * |sigma| * g * d_s", layout.gathered_width()}}) {
    if (value > kIntMax) {
      return absl::InvalidArgumentError(absl::StrCat(name, " = ", value,
                                                     " exceeds cuBLAS's int dimensions"));
    }
  }
  return layout;
}

void InterleaveHeads(const void* src, size_t element_bytes, int heads, int64_t rows, int64_t cols,
                     void* dst) {
  const char* from = static_cast<const char*>(src);
  char* to = static_cast<char*>(dst);
  const size_t run = static_cast<size_t>(cols) * element_bytes;
  for (int h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(to + (r * heads + h) * run, from + (h * rows + r) * run, run);
    }
  }
}

InputRowCopies InputRowCopiesOf(const DeviceLayout& layout, int64_t rows, int64_t row_bytes) {
  InputRowCopies copies;
  if (layout.window == 1 || rows == layout.stage0_rows()) {
    copies.bytes = rows * row_bytes;
    copies.device_stride = copies.bytes;
    return copies;
  }
  copies.count = layout.window;
  copies.bytes = rows / layout.window * row_bytes;
  copies.device_stride = layout.offset_width() * row_bytes;
  return copies;
}

DType GemmDType(DType input, DType weights, DType output) {
  return input == weights && input == output ? input : DType::kFP32;
}

std::array<StridedGemm, 3> MlpGemms(const DeviceLayout& layout, int64_t tokens, int64_t pairs) {
  const int t = static_cast<int>(tokens);
  const int in = static_cast<int>(layout.input_width);
  const int h = static_cast<int>(layout.hidden);
  const int width = static_cast<int>(layout.hidden_width());
  const int out = static_cast<int>(layout.head_out);
  const int chains = static_cast<int>(pairs * layout.heads);
  std::array<StridedGemm, 3> gemms;
  gemms[0] = {width, t, in, width, in, width, layout.a1_elements(), tokens * in,
              tokens * width, static_cast<int>(pairs)};
  gemms[1] = {h, t, h, h, h, h, layout.hidden * layout.hidden, tokens * h, tokens * h, chains};
  gemms[2] = {out, t, h, out, h, out, layout.hidden * layout.head_out, tokens * h,
              tokens * out, chains};
  return gemms;
}

StridedGemm RidgeHeadGemm(const DeviceLayout& layout, int64_t tokens, int64_t pairs) {
  const int t = static_cast<int>(tokens);
  const int in = static_cast<int>(layout.chain_width);
  const int out = static_cast<int>(layout.head_out);
  return {out,          t, in, out, in, out, layout.chain_width * layout.head_out,
          tokens * in,  tokens * out, static_cast<int>(pairs * layout.ridge_heads)};
}

absl::StatusOr<StepPlan> PlanSteps(const StepShape& shape, int64_t token_chunk,
                                   int64_t budget_bytes) {
  if (shape.num_tokens < 0 || shape.num_layers <= 0 || shape.input_width <= 0 ||
      shape.target_width <= 0 || shape.hidden_width < 0 || shape.weight_elements < 0 ||
      shape.window < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step shape: num_tokens=", shape.num_tokens, " num_layers=", shape.num_layers,
        " input_width=", shape.input_width, " target_width=", shape.target_width,
        " hidden_width=", shape.hidden_width, " weight_elements=", shape.weight_elements,
        " window=", shape.window, " must be non-negative / positive"));
  }
  StepPlan plan;
  if (shape.num_tokens == 0) return plan;
  const int64_t g = static_cast<int64_t>(DTypeSize(shape.gemm_dtype));
  const int64_t k = shape.input_width, n = shape.target_width, h = shape.hidden_width;
  // The fp32 GEMM output buffer holds each GEMM's result in turn (MLP: hidden, hidden, output).
  const int64_t y_width = std::max(n, h);
  const int64_t weight_elements = shape.weight_elements > 0 ? shape.weight_elements : k * n;
  // Device bytes of one step: layers * (tokens * per_layer_token + per_layer) +
  // tokens * per_token + fixed.
  const int64_t per_layer_token =
      2 * (k * g + y_width * 4 + h * g) + shape.staged_target_bytes_per_layer_token;
  const int64_t per_layer = shape.convert_weights ? 2 * weight_elements * 4 : 0;
  const int64_t source_table_per_token = 2 * 4 * static_cast<int64_t>(shape.rope_half_source);
  const int64_t per_token =
      source_table_per_token + 2 * 4 * static_cast<int64_t>(shape.rope_half_target) +
      shape.staged_source_bytes_per_token;
  // The window's earlier tokens: source tables and staged source rows, whatever the chunk.
  const int64_t fixed = static_cast<int64_t>(shape.window - 1) *
                        (source_table_per_token + shape.staged_source_bytes_per_token);
  const auto bytes = [&](int64_t layers, int64_t tokens) {
    return layers * (tokens * per_layer_token + per_layer) + tokens * per_token + fixed;
  };
  if (bytes(1, 1) > budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda workspace budget of ", budget_bytes, " bytes is below the ", bytes(1, 1),
        " bytes one token of one target layer needs (input width ", k, ", target width ", n,
        "); raise the CUDA backend's workspace_bytes"));
  }
  int64_t tokens = std::min(shape.num_tokens,
                            (budget_bytes - per_layer - fixed) / (per_layer_token + per_token));
  if (token_chunk > 0) tokens = std::min(tokens, token_chunk);
  tokens = std::min(tokens, kIntMax);  // cuBLAS's n
  // Multiples of 64 tokens keep the GEMM tiles whole, where the budget leaves room for one.
  if (tokens < shape.num_tokens && tokens >= 64) tokens -= tokens % 64;
  plan.num_chunks = static_cast<int>((shape.num_tokens + tokens - 1) / tokens);
  plan.chunk_tokens = (shape.num_tokens + plan.num_chunks - 1) / plan.num_chunks;

  int64_t layers = (budget_bytes - plan.chunk_tokens * per_token - fixed) /
                   (plan.chunk_tokens * per_layer_token + per_layer);
  layers = std::clamp<int64_t>(layers, 1, shape.num_layers);
  plan.num_groups = static_cast<int>((shape.num_layers + layers - 1) / layers);
  plan.layers_per_group = (shape.num_layers + plan.num_groups - 1) / plan.num_groups;

  const int64_t t = plan.chunk_tokens, l = plan.layers_per_group;
  plan.x_bytes = l * 2 * t * k * g;
  plan.y_bytes = l * 2 * t * y_width * 4;
  plan.hidden_bytes = l * 2 * t * h * g;
  plan.weights32_bytes = l * per_layer;
  const int64_t window_tokens = t + shape.window - 1;
  plan.table_bytes = window_tokens * source_table_per_token +
                     t * 2 * 4 * static_cast<int64_t>(shape.rope_half_target);
  plan.staged_source_bytes = window_tokens * shape.staged_source_bytes_per_token;
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
