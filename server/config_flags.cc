#include "server/config_flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

// One line per schema key with a flag (KvtdConfigKey::flag); the schema holds its key and help.
// absl flags must be defined at compile time, so the list cannot be generated from the schema:
// config_flags_test fails when the two disagree. The type is the key's; the default means "not
// given" (see ApplyKvtdFlagOverrides).
#define KVTD_OVERRIDE_FLAG(type, name, not_given) \
  ABSL_FLAG(type, name, not_given, kvt::KvtdFlagHelp(#name))

KVTD_OVERRIDE_FLAG(std::string, listen_address, "");
KVTD_OVERRIDE_FLAG(std::string, unix_socket, "");
KVTD_OVERRIDE_FLAG(std::string, mapper_store, "");
KVTD_OVERRIDE_FLAG(std::string, backend, "");
KVTD_OVERRIDE_FLAG(int64_t, cpu_threads, -1);
KVTD_OVERRIDE_FLAG(std::string, cpu_gemm, "");
KVTD_OVERRIDE_FLAG(int64_t, max_tokens, -1);
KVTD_OVERRIDE_FLAG(int64_t, max_inflight_requests, -1);
KVTD_OVERRIDE_FLAG(bool, allow_non_finite, false);
KVTD_OVERRIDE_FLAG(double, drain_grace_seconds, -1);
KVTD_OVERRIDE_FLAG(double, shutdown_deadline_seconds, -1);
KVTD_OVERRIDE_FLAG(std::string, log_level, "");
KVTD_OVERRIDE_FLAG(std::string, tls_cert_file, "");
KVTD_OVERRIDE_FLAG(std::string, tls_key_file, "");
KVTD_OVERRIDE_FLAG(std::string, tls_client_ca_file, "");
KVTD_OVERRIDE_FLAG(std::string, auth_token_file, "");
KVTD_OVERRIDE_FLAG(std::string, metrics_listen_address, "");

namespace kvt {

std::string KvtdFlagHelp(absl::string_view flag) {
  for (const KvtdConfigKey& key : KvtdConfigKeys()) {
    if (key.flag == flag) return key.flag_help;
  }
  return absl::StrCat("(no kvtd.yaml key names --", flag, ")");
}

absl::Status ApplyKvtdFlagOverrides(KvtdConfig* config) {
  for (const KvtdConfigKey& key : KvtdConfigKeys()) {
    if (key.flag.empty()) continue;
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(key.flag);
    if (flag == nullptr) {
      return absl::InternalError(absl::StrCat("key '", key.path, "' names flag --", key.flag,
                                              ", which server/config_flags.cc does not define"));
    }
    // Compared as text, as absl prints both: the sentinel given explicitly (--cpu_threads=-1)
    // counts as not given, as it always has.
    const std::string value = flag->CurrentValue();
    if (value == flag->DefaultValue()) continue;
    const std::string source = absl::StrCat("--", key.flag, "=", value);
    if (absl::Status status = SetKvtdConfigKey(key.path, value, source, config); !status.ok()) {
      return status;
    }
  }
  absl::Status valid = ValidateKvtdConfig(*config);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("after flag overrides: ", valid.message()));
  }
  return absl::OkStatus();
}

}  // namespace kvt
