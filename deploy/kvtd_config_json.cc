// Test helper of //deploy:k8s_test: parses a kvtd.yaml with kvtd's own loader (unknown keys and
// bad values are errors, exactly as at kvtd start) and prints the settings the
// Kubernetes manifests depend on as JSON. Usage: kvtd_config_json FILE
#include <cstdio>
#include <string>

#include "nlohmann/json.hpp"
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
  const kvt::KvtdConfig& c = *config;
  nlohmann::json out = {
      {"listen_address", c.server.listen_address},
      {"unix_socket", c.server.unix_socket},
      {"mapper_store_path", c.mapper_store.path},
      {"host_budget_bytes", c.mapper_store.host_budget_bytes},
      {"device_budget_bytes", c.mapper_store.device_budget_bytes},
      {"reload_interval_seconds", c.mapper_store.reload_interval_seconds},
      {"backend", c.backend.type},
      {"max_request_bytes", c.limits.max_request_bytes},
      {"max_inflight_requests", c.limits.max_inflight_requests},
      {"max_inflight_bytes", c.limits.max_inflight_bytes},
      {"allow_non_finite", c.limits.allow_non_finite},
      {"drain_grace_seconds", c.shutdown.drain_grace_seconds},
      {"deadline_seconds", c.shutdown.deadline_seconds},
      {"metrics_listen_address", c.metrics.listen_address},
      {"allow_client_regions", c.shared_memory.allow_client_regions},
      {"tls", !c.security.tls_cert_file.empty()},
      {"auth_token_file", c.security.auth_token_file},
      {"prefix_cache_enabled", c.prefix_cache.enabled},
      {"prefix_cache_max_bytes", c.prefix_cache.max_bytes},
      {"prefix_cache_block_tokens", c.prefix_cache.block_tokens},
  };
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
