// Conversions between the kvt.v1 wire enums and the engine's types, with errors that name the
// request field, shared by the server and the client library.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/types.h"
#include "proto/kvt/v1/common.pb.h"

namespace kvt {

// `field` names the request field in the error, e.g. "header.dtype".
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, absl::string_view field);
v1::DType DTypeToProto(DType dtype);
absl::StatusOr<Layout> LayoutFromProto(v1::Layout layout, absl::string_view field);
v1::Layout LayoutToProto(Layout layout);

}  // namespace kvt
