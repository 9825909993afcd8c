#include "kernels/types.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvt {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16:
      return 2;
    case DType::kFP32:
      return 4;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "bf16" || lower == "bfloat16") return DType::kBF16;
  if (lower == "fp16" || lower == "float16" || lower == "f16" || lower == "half") {
    return DType::kFP16;
  }
  if (lower == "fp32" || lower == "float32" || lower == "f32" || lower == "float") {
    return DType::kFP32;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", name, "' (expected bf16, fp16 or fp32)"));
}

const char* LayoutName(Layout layout) { return layout == Layout::kHND ? "HND" : "NHD"; }

absl::StatusOr<Layout> ParseLayout(absl::string_view name) {
  const std::string upper = absl::AsciiStrToUpper(name);
  if (upper == "HND") return Layout::kHND;
  if (upper == "NHD") return Layout::kNHD;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported layout '", name, "' (expected HND or NHD)"));
}

}  // namespace kvt
