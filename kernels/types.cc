#include "kernels/types.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kernels/checked_math.h"

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

BlockStrides PagedLayout::Strides(int kind) const {
  if (engine_order) return engine_order->kv[kind];
  BlockStrides s;
  s.offset = kind * num_blocks * BlockStride();  // V blocks follow all K blocks
  s.dim_stride = 1;
  if (block_layout == Layout::kNHD) {
    s.slot_stride = num_kv_heads * head_dim;
    s.head_stride = head_dim;
  } else {
    s.head_stride = block_size * head_dim;
    s.slot_stride = head_dim;
  }
  return s;
}

namespace {

// Largest element offset of `kind` inside a block; nullopt on a negative stride or overflow.
std::optional<int64_t> LastElement(const PagedLayout& p, int kind) {
  const BlockStrides s = p.Strides(kind);
  if (s.offset < 0 || s.slot_stride < 0 || s.head_stride < 0 || s.dim_stride < 0) {
    return std::nullopt;
  }
  std::optional<int64_t> last = s.offset;
  const std::pair<int64_t, int64_t> terms[] = {{p.block_size - 1, s.slot_stride},
                                               {p.num_kv_heads - 1, s.head_stride},
                                               {p.head_dim - 1, s.dim_stride}};
  for (const auto& [count, stride] : terms) {
    const std::optional<int64_t> term = CheckedMul(count, stride);
    if (!term || !last) return std::nullopt;
    last = CheckedAdd(*last, *term);
  }
  return last;
}

bool SizesPositive(const PagedLayout& p) {
  return p.num_blocks > 0 && p.block_size > 0 && p.num_kv_heads > 0 && p.head_dim > 0 &&
         p.element_size > 0;
}

}  // namespace

std::optional<int64_t> PagedLayout::LayerExtent() const {
  if (!SizesPositive(*this)) return std::nullopt;
  if (!engine_order) {
    return CheckedProduct({2, num_blocks, block_size, num_kv_heads, head_dim, element_size});
  }
  if (engine_order->block_stride < 0) return std::nullopt;
  const std::optional<int64_t> k = LastElement(*this, 0);
  const std::optional<int64_t> v = LastElement(*this, 1);
  const std::optional<int64_t> blocks = CheckedMul(num_blocks - 1, engine_order->block_stride);
  if (!k || !v || !blocks) return std::nullopt;
  const std::optional<int64_t> last = CheckedAdd(*blocks, std::max(*k, *v));
  if (!last) return std::nullopt;
  const std::optional<int64_t> elements = CheckedAdd(*last, 1);
  if (!elements) return std::nullopt;
  return CheckedMul(*elements, element_size);
}

std::optional<int64_t> PagedLayout::RequiredBytes(int num_layers) const {
  const std::optional<int64_t> extent = LayerExtent();
  if (!extent || num_layers < 0) return std::nullopt;
  if (!engine_order) return CheckedMul(num_layers, *extent);
  if (static_cast<int64_t>(engine_order->layer_offsets.size()) < num_layers) return std::nullopt;
  int64_t end = 0;
  for (int l = 0; l < num_layers; ++l) {
    const int64_t at = engine_order->layer_offsets[static_cast<size_t>(l)];
    const std::optional<int64_t> layer_end = at < 0 ? std::nullopt : CheckedAdd(at, *extent);
    if (!layer_end) return std::nullopt;
    end = std::max(end, *layer_end);
  }
  return end;
}

absl::Status CheckPagedBounds(const PagedLayout& paged, int num_layers, int64_t range_bytes,
                              const std::string& field, const std::string& range_field) {
  const std::pair<const char*, int64_t> sizes[] = {{"num_blocks", paged.num_blocks},
                                                   {"block_size", paged.block_size},
                                                   {"num_kv_heads", paged.num_kv_heads},
                                                   {"head_dim", paged.head_dim},
                                                   {"element_size", paged.element_size}};
  for (const auto& [name, value] : sizes) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", name, " must be > 0, got ",
                                                     value));
    }
  }
  if (num_layers <= 0 || range_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", num_layers, " layers in ",
                                                   range_bytes, " bytes"));
  }
  const std::optional<int64_t> extent = paged.LayerExtent();
  if (!extent) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": num_blocks=", paged.num_blocks, " x block_size=", paged.block_size,
        (paged.engine_order ? " with its engine order's strides" : ""),
        " makes a layer larger than 2^63 bytes (or a stride is negative)"));
  }
  if (!paged.engine_order) {
    const std::optional<int64_t> required = paged.RequiredBytes(num_layers);
    if (!required || *required != range_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          range_field, ".byte_size=", range_bytes, " but the paged cache is ",
          required ? absl::StrCat(*required) : std::string("over 2^63"),
          " bytes (per layer a (2, num_blocks, block_size, num_kv_heads, head_dim) tensor)"));
    }
    return absl::OkStatus();
  }
  const std::vector<int64_t>& offsets = paged.engine_order->layer_offsets;
  if (static_cast<int64_t>(offsets.size()) != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".layer_offsets has ", offsets.size(),
                                                   " entries; the model has ", num_layers,
                                                   " layers"));
  }
  for (int l = 0; l < num_layers; ++l) {
    const int64_t at = offsets[static_cast<size_t>(l)];
    // Elements are read and written in place through typed pointers: a layer that starts
    // between two elements would make every access misaligned.
    if (paged.element_size <= 0 || at % paged.element_size != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".layer_offsets[", l, "]=", at, " is not a multiple of the element size (",
          paged.element_size, " bytes)"));
    }
    if (at < 0 || at > range_bytes || *extent > range_bytes - at) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".layer_offsets[", l, "]=", at, ": the layer's ", *extent,
          " bytes end past the region range of ", range_bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckEngineBlockOrder(const PagedLayout& paged, int num_layers, int64_t range_bytes,
                                   const std::string& field) {
  const EngineBlockOrder& order = *paged.engine_order;
  if (static_cast<int64_t>(order.layer_offsets.size()) != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".layer_offsets has ",
                                                   order.layer_offsets.size(), " entries; the model has ",
                                                   num_layers, " layers"));
  }
  // Every value is bounded first, so that the bitmap below stays small.
  constexpr int64_t kMaxElements = int64_t{1} << 40;
  const int64_t block_elements = 2 * paged.block_size * paged.num_kv_heads * paged.head_dim;
  if (paged.block_size <= 0 || paged.num_blocks <= 0 || paged.block_size > (1 << 16) ||
      paged.num_blocks > kMaxElements || block_elements > (int64_t{1} << 22)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": num_blocks=", paged.num_blocks, " x block_size=", paged.block_size,
        " is outside what an engine order supports (block_size <= 65536, ",
        "2 * block_size * heads * head_dim <= 4194304 elements)"));
  }
  const std::pair<const char*, int64_t> values[] = {
      {"block_stride", order.block_stride},
      {"k.offset", order.kv[0].offset},       {"k.slot_stride", order.kv[0].slot_stride},
      {"k.head_stride", order.kv[0].head_stride}, {"k.dim_stride", order.kv[0].dim_stride},
      {"v.offset", order.kv[1].offset},       {"v.slot_stride", order.kv[1].slot_stride},
      {"v.head_stride", order.kv[1].head_stride}, {"v.dim_stride", order.kv[1].dim_stride}};
  for (const auto& [name, value] : values) {
    if (value < 0 || value > kMaxElements) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".", name, "=", value, " is outside [0, 2^40] elements"));
    }
  }
  if (int64_t{1} << 56 <= static_cast<__int128>(paged.num_blocks) * order.block_stride) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".block_stride=", order.block_stride,
                                                   " overflows over ", paged.num_blocks, " blocks"));
  }
  if (absl::Status bounds = CheckPagedBounds(paged, num_layers, range_bytes, field, field);
      !bounds.ok()) {
    return bounds;
  }
  // No two elements of one block on the same bytes: mark each in a bitmap of the block's span.
  const int64_t first = std::min(paged.Strides(0).offset, paged.Strides(1).offset);
  const int64_t last = std::max(*LastElement(paged, 0), *LastElement(paged, 1));
  if (last - first >= (int64_t{1} << 26)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": one block spans ", last - first + 1,
        " elements; an engine order's block must span at most 2^26"));
  }
  std::vector<bool> used(static_cast<size_t>(last - first + 1), false);
  for (int kind = 0; kind < 2; ++kind) {
    for (int64_t slot = 0; slot < paged.block_size; ++slot) {
      for (int64_t head = 0; head < paged.num_kv_heads; ++head) {
        for (int64_t dim = 0; dim < paged.head_dim; ++dim) {
          const int64_t at = paged.ElementOffset(kind, 0, slot, head, dim) / paged.element_size;
          if (used[static_cast<size_t>(at - first)]) {
            return absl::InvalidArgumentError(absl::StrCat(
                field, ": ", kind == 0 ? "k" : "v", " element (slot ", slot, ", head ", head,
                ", dim ", dim, ") lands on another element of the block"));
          }
          used[static_cast<size_t>(at - first)] = true;
        }
      }
    }
  }
  if (paged.num_blocks > 1 && order.block_stride < last - first + 1) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".block_stride=", order.block_stride,
                                                   " is shorter than one block's span of ",
                                                   last - first + 1, " elements"));
  }
  // Layers on disjoint byte ranges (CheckPagedBounds put each inside the range).
  const int64_t extent = *paged.LayerExtent();
  std::vector<std::pair<int64_t, int>> starts;
  for (int l = 0; l < num_layers; ++l) {
    starts.emplace_back(order.layer_offsets[static_cast<size_t>(l)], l);
  }
  std::sort(starts.begin(), starts.end());
  for (size_t i = 1; i < starts.size(); ++i) {
    if (starts[i].first < starts[i - 1].first + extent) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".layer_offsets[", starts[i].second, "]=", starts[i].first, " overlaps layer ",
          starts[i - 1].second, " (", extent, " bytes from ", starts[i - 1].first, ")"));
    }
  }
  return absl::OkStatus();
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
  for (int64_t i = 0; i < needed; ++i) {
    if (table[i] >= paged.num_blocks) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".block_table[", i, "]=", table[i],
                                                     " is outside num_blocks=",
                                                     paged.num_blocks));
    }
  }
  if (!distinct) return absl::OkStatus();
  // Sized by the entries used (which arrived on the wire), never by num_blocks: a few bytes of
  // table must not make kvtd allocate per declared block.
  std::vector<std::pair<uint32_t, int64_t>> uses;
  uses.reserve(static_cast<size_t>(needed));
  for (int64_t i = 0; i < needed; ++i) uses.emplace_back(table[i], i);
  std::sort(uses.begin(), uses.end());
  // The earliest entry that repeats a block, and that block's first use.
  int64_t repeat = -1, seen = -1;
  size_t group = 0;  // first use of the block at uses[i]
  for (size_t i = 1; i < uses.size(); ++i) {
    if (uses[i].first != uses[group].first) {
      group = i;
    } else if (repeat < 0 || uses[i].second < repeat) {
      repeat = uses[i].second;
      seen = uses[group].second;
    }
  }
  if (repeat >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".block_table[", repeat, "]=", table[repeat], " repeats block_table[", seen,
        "]: two token ranges would be written to one block"));
  }
  return absl::OkStatus();
}

}  // namespace kvt
