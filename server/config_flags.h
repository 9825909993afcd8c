// kvtd's command-line overrides of kvtd.yaml keys: one flag per schema key that names one.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/config.h"

namespace kvt {

// Sets every key whose override flag was given (its value differs from the flag's default: ""
// for strings, -1 for numbers, false for switches, so a flag never given changes nothing), read
// like the key in kvtd.yaml, then validates the result. Errors name the flag and the key.
absl::Status ApplyKvtdFlagOverrides(KvtdConfig* config);

// The --help text of the override flag `flag`, from the schema (KvtdConfigKeys()).
std::string KvtdFlagHelp(absl::string_view flag);

}  // namespace kvt
