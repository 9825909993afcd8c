#include "transport/proto_convert.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

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

namespace {

absl::StatusOr<PagedLayout> CheckTable(PagedLayout pages, const v1::PagedBlocks& paged,
                                       int64_t end, bool output, const std::string& field) {
  if (absl::Status table = CheckBlockTable(pages, paged.block_table().data(),
                                           paged.block_table_size(), end, output, field);
      !table.ok()) {
    return table;
  }
  return pages;
}

}  // namespace

absl::StatusOr<PagedLayout> PagedLayoutFromProto(const v1::RegionRef& ref, Layout block_layout,
                                                 int num_layers, int64_t heads, int64_t head_dim,
                                                 int64_t element_size, int64_t num_tokens,
                                                 bool output, const std::string& field) {
  const v1::PagedBlocks& paged = ref.paged();
  const std::string paged_field = field + ".paged";
  PagedLayout pages{block_layout, paged.num_blocks(), paged.block_size(), heads, head_dim,
                    element_size};
  if (!output && (paged.first_token() != 0 || paged.end_token() != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(paged_field, ".first_token and .end_token are for output regions only"));
  }
  // An output writes tokens [first_token, end); the table need cover only them.
  const int64_t end = paged.end_token() ? paged.end_token() : num_tokens;
  if (end > num_tokens || paged.first_token() >= end) {
    return absl::InvalidArgumentError(absl::StrCat(
        paged_field, ": first_token=", paged.first_token(), ", end_token=", paged.end_token(),
        " do not name a non-empty token range inside the request's ", num_tokens, " tokens"));
  }
  // Above this no byte offset fits an int64 once added to the rest.
  constexpr uint64_t kMaxBytes = uint64_t{1} << 60;
  if (ref.byte_size() > kMaxBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".byte_size=", ref.byte_size(), " is beyond 2^60"));
  }
  // The geometry is bounded by the region before the block table is looked at, so nothing is
  // sized from num_blocks until it is known to fit.
  if (!paged.has_engine_order()) {
    if (absl::Status bounds = CheckPagedBounds(
            pages, num_layers, static_cast<int64_t>(ref.byte_size()), paged_field, field);
        !bounds.ok()) {
      return bounds;
    }
    return CheckTable(pages, paged, end, output, paged_field);
  }
  const v1::EngineBlockOrder& wire = paged.engine_order();
  EngineBlockOrder order;
  for (const uint64_t offset : wire.layer_offsets()) {
    order.layer_offsets.push_back(static_cast<int64_t>(std::min(offset, kMaxBytes + 1)));
  }
  const auto clamp = [](uint64_t v) { return static_cast<int64_t>(std::min(v, uint64_t{1} << 41)); };
  order.block_stride = clamp(wire.block_stride());
  const v1::BlockStrides* kinds[2] = {&wire.k(), &wire.v()};
  for (int kind = 0; kind < 2; ++kind) {
    order.kv[kind] = BlockStrides{clamp(kinds[kind]->offset()), clamp(kinds[kind]->slot_stride()),
                                  clamp(kinds[kind]->head_stride()),
                                  clamp(kinds[kind]->dim_stride())};
  }
  pages.engine_order = std::move(order);
  if (absl::Status checked =
          CheckEngineBlockOrder(pages, num_layers, static_cast<int64_t>(ref.byte_size()),
                                paged_field + ".engine_order");
      !checked.ok()) {
    return checked;
  }
  return CheckTable(pages, paged, end, output, paged_field);
}

}  // namespace kvt
