// Fuzz target: ParseManifest (mapper manifest.yaml). An accepted manifest must validate, emit, and
// read back to the same text (ParseManifest(EmitManifest(m)) == m).
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "fuzz/fuzz_check.h"
#include "mapper_store/format/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvt::Manifest> manifest = kvt::ParseManifest(text, "manifest.yaml");
  if (!manifest.ok()) {
    FUZZ_CHECK(!manifest.status().message().empty());
    return 0;
  }
  FUZZ_CHECK(kvt::ValidateManifest(*manifest).ok());
  absl::StatusOr<std::string> emitted = kvt::EmitManifest(*manifest);
  FUZZ_CHECK(emitted.ok());
  absl::StatusOr<kvt::Manifest> reparsed = kvt::ParseManifest(*emitted, "manifest.yaml");
  FUZZ_CHECK(reparsed.ok());
  absl::StatusOr<std::string> emitted_again = kvt::EmitManifest(*reparsed);
  FUZZ_CHECK(emitted_again.ok());
  FUZZ_CHECK(*emitted_again == *emitted);
  return 0;
}
