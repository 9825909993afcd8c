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

// The paged layout of a region side (ref.paged() set) for a model of `num_layers` layers of
// `heads` x `head_dim` elements of `element_size` bytes and a request of `num_tokens` tokens:
// block table (distinct on `output`), engine order and ref.byte_size checked, errors naming
// `field` (e.g. "header.output.region"). `block_layout` is the request's layout, which orders a
// block in the standard order.
absl::StatusOr<PagedLayout> PagedLayoutFromProto(const v1::RegionRef& ref, Layout block_layout,
                                                 int num_layers, int64_t heads, int64_t head_dim,
                                                 int64_t element_size, int64_t num_tokens,
                                                 bool output, const std::string& field);

}  // namespace kvt
