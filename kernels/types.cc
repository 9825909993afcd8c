#include "kernels/types.h"

#include <vector>

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

absl::Status CheckBlockTable(const PagedLayout& paged, const uint32_t* table, int64_t table_size,
                             int64_t num_tokens, bool distinct, const std::string& field) {
  if (paged.block_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".block_size must be > 0"));
  }
  if (paged.num_blocks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".num_blocks must be > 0"));
  }
  const int64_t needed = paged.BlocksFor(num_tokens);
  if (table_size < needed) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".block_table has ", table_size, " entries; ", num_tokens, " tokens in blocks of ",
        paged.block_size, " need ", needed));
  }
  std::vector<int64_t> first_use(distinct ? static_cast<size_t>(paged.num_blocks) : 0, -1);
  for (int64_t i = 0; i < needed; ++i) {
    if (table[i] >= paged.num_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".block_table[", i, "]=", table[i],
                                                     " is outside num_blocks=",
                                                     paged.num_blocks));
    }
    if (distinct) {
      int64_t& seen = first_use[table[i]];
      if (seen >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".block_table[", i, "]=", table[i], " repeats block_table[", seen,
            "]: two token ranges would be written to one block"));
      }
      seen = i;
    }
  }
  return absl::OkStatus();
}

}  // namespace kvt
