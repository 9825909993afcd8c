// Test helper of //deploy:k8s_test: parses a kvtd.yaml with kvtd's own loader (unknown keys and
// bad values are errors, exactly as at kvtd start) and prints every key as JSON, nested like the
// file (rendered from the config schema, so a new key shows up without a change here).
// Usage: kvtd_config_json FILE
#include <cstdio>
#include <string>

#include "server/config.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: kvtd_config_json KVTD_YAML\n");
    return 1;
  }
  absl::StatusOr<kvt::KvtdConfig> config = kvt::LoadKvtdConfigFile(argv[1]);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", kvt::KvtdConfigToJson(*config).c_str());
  return 0;
}
