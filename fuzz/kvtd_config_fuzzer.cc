// Fuzz target: ParseKvtdConfig (kvtd.yaml). Bad input is an error; an accepted config passes
// ValidateKvtdConfig, the same range checks the command-line flags go through.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "common/logging.h"
#include "fuzz/fuzz_check.h"
#include "server/config.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvt::SetMinLogLevel(kvt::LogLevel::kError);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvt::KvtdConfig> config = kvt::ParseKvtdConfig(text, "kvtd.yaml");
  if (!config.ok()) {
    FUZZ_CHECK(!config.status().message().empty());
    return 0;
  }
  FUZZ_CHECK(kvt::ValidateKvtdConfig(*config).ok());
  return 0;
}
