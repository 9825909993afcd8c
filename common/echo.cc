#include "common/echo.h"

#include "absl/strings/str_cat.h"

namespace kvt {

std::string Echo(absl::string_view value, size_t max_bytes) {
  if (value.size() <= max_bytes) return std::string(value);
  size_t cut = max_bytes;
  // Back off continuation bytes (10xxxxxx) so that no character is split.
  while (cut > 0 && (static_cast<unsigned char>(value[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat(value.substr(0, cut), "...(", value.size(), " bytes)");
}

}  // namespace kvt
