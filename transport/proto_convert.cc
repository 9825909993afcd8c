#include "transport/proto_convert.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvt {

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP16:
      return DType::kFP16;
    case v1::DTYPE_FP32:
      return DType::kFP32;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be DTYPE_BF16, DTYPE_FP16 or DTYPE_FP32, got ", static_cast<int>(dtype)));
  }
}

v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kFP16:
      return v1::DTYPE_FP16;
    case DType::kFP32:
      return v1::DTYPE_FP32;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<Layout> LayoutFromProto(v1::Layout layout, absl::string_view field) {
  switch (layout) {
    case v1::LAYOUT_HND:
      return Layout::kHND;
    case v1::LAYOUT_NHD:
      return Layout::kNHD;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be LAYOUT_HND or LAYOUT_NHD, got ", static_cast<int>(layout)));
  }
}

v1::Layout LayoutToProto(Layout layout) {
  return layout == Layout::kHND ? v1::LAYOUT_HND : v1::LAYOUT_NHD;
}

}  // namespace kvt
