#include "server/config.h"

#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/strict_reader.h"
#include "yaml-cpp/yaml.h"

namespace kvt {
namespace {

using strict::YamlReader;

// One section of the file: its keys and how each is stored (`key` is the full path).
using Setter = std::function<absl::Status(const std::string& key, const YAML::Node&)>;

template <typename Map>
std::vector<std::string> KeysOf(const Map& map) {
  std::vector<std::string> keys;
  for (const auto& entry : map) keys.push_back(entry.first);
  return keys;
}

absl::Status ReadSection(const YamlReader& reader, const std::string& section,
                         const YAML::Node& node, const std::map<std::string, Setter>& setters) {
  if (absl::Status status = reader.CheckMap(node, section, KeysOf(setters)); !status.ok()) {
    return status;
  }
  for (const auto& entry : node) {
    const std::string key = entry.first.Scalar();
    absl::Status status = setters.at(key)(strict::Path(section, key), entry.second);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// metrics.prefill_cost: a map from target model name to {a, b, c}; every coefficient required.
absl::Status ReadPrefillCosts(const YamlReader& reader, const std::string& key,
                              const YAML::Node& node,
                              std::map<std::string, KvtdConfig::Metrics::PrefillCost>* out) {
  if (!node.IsMap()) {
    return reader.WrongType(node, key,
                            "a map from target model name to {a: ms, b: ms/token, c: ms/token^2}");
  }
  if (absl::Status status = reader.CheckFreeMap(node, key); !status.ok()) return status;
  for (const auto& model : node) {
    const std::string name = model.first.Scalar();
    const std::string model_key = strict::Path(key, name);
    if (absl::Status s = reader.CheckMap(model.second, model_key, {"a", "b", "c"}); !s.ok()) {
      return s;
    }
    KvtdConfig::Metrics::PrefillCost cost;
    for (const auto& [coefficient, value] :
         {std::pair<const char*, double*>{"a", &cost.a}, {"b", &cost.b}, {"c", &cost.c}}) {
      if (absl::Status s =
              reader.RequiredScalar(model.second, model_key, coefficient, "a number", value);
          !s.ok()) {
        return s;
      }
    }
    (*out)[name] = cost;
  }
  return absl::OkStatus();
}

// prefix_cache.pair_min_quality: a map from "source->target" to a quality floor.
absl::Status ReadPairFloors(const YamlReader& reader, const std::string& key,
                            const YAML::Node& node, std::map<std::string, double>* out) {
  if (!node.IsMap()) {
    return reader.WrongType(node, key,
                            "a map from \"source->target\" (model names) to a quality floor");
  }
  if (absl::Status status = reader.CheckFreeMap(node, key); !status.ok()) return status;
  for (const auto& pair : node) {
    const std::string name = pair.first.Scalar();
    const std::string pair_key = strict::Path(key, name);
    if (name.find("->") == std::string::npos) {
      return reader.Error(pair.first, absl::StrCat("key '", pair_key,
                                                   "' must name a pair as \"source->target\" "
                                                   "(model names as in mapper manifests)"));
    }
    absl::StatusOr<double> floor = reader.Scalar<double>(pair.second, pair_key, "a number");
    if (!floor.ok()) return floor.status();
    (*out)[name] = *floor;
  }
  return absl::OkStatus();
}

// A setter storing the scalar as T; `type` says what is expected ("an integer").
template <typename T>
Setter Store(const YamlReader& reader, T* out, const char* type) {
  return [&reader, out, type](const std::string& key, const YAML::Node& node) -> absl::Status {
    absl::StatusOr<T> value = reader.Scalar<T>(node, key, type);
    if (!value.ok()) return value.status();
    *out = *std::move(value);
    return absl::OkStatus();
  };
}

}  // namespace

absl::StatusOr<KvtdConfig> ParseKvtdConfig(absl::string_view yaml_text,
                                           absl::string_view source_name) {
  KvtdConfig config;
  const YamlReader reader(source_name);
  absl::StatusOr<YAML::Node> loaded = reader.Load(yaml_text);
  if (!loaded.ok()) return loaded.status();
  const YAML::Node& root = *loaded;
  if (root.IsNull()) return config;  // empty file: all defaults
  if (!root.IsMap()) return reader.Error(root, "top level must be a map of sections");
  auto str = [&reader](std::string* out) { return Store(reader, out, "a string"); };
  auto i64 = [&reader](int64_t* out) { return Store(reader, out, "an integer"); };
  auto f64 = [&reader](double* out) { return Store(reader, out, "a number"); };
  auto flag = [&reader](bool* out) { return Store(reader, out, "true or false"); };

  const std::map<std::string, std::map<std::string, Setter>> sections = {
      {"server",
       {{"listen_address", str(&config.server.listen_address)},
        {"unix_socket", str(&config.server.unix_socket)},
        {"max_message_bytes", i64(&config.server.max_message_bytes)},
        {"max_sync_threads", i64(&config.server.max_sync_threads)}}},
      {"mapper_store",
       {{"path", str(&config.mapper_store.path)},
        {"host_budget_bytes", i64(&config.mapper_store.host_budget_bytes)},
        {"device_budget_bytes", i64(&config.mapper_store.device_budget_bytes)},
        {"reload_interval_seconds", f64(&config.mapper_store.reload_interval_seconds)},
        {"acquire_timeout_seconds", f64(&config.mapper_store.acquire_timeout_seconds)},
        {"load_on_scan", flag(&config.mapper_store.load_on_scan)},
        {"preload",
         [&reader, &config](const std::string& key, const YAML::Node& node) -> absl::Status {
           absl::StatusOr<std::vector<std::string>> ids =
               reader.ScalarList<std::string>(node, key, "a list of mapper ids", "a mapper id");
           if (!ids.ok()) return ids.status();
           config.mapper_store.preload = *std::move(ids);
           return absl::OkStatus();
         }}}},
      {"backend",
       {{"type", str(&config.backend.type)},
        {"cpu_threads", i64(&config.backend.cpu_threads)},
        {"token_chunk", i64(&config.backend.token_chunk)},
        {"cpu_gemm", str(&config.backend.cpu_gemm)}}},
      {"limits",
       {{"max_tokens", i64(&config.limits.max_tokens)},
        {"max_request_bytes", i64(&config.limits.max_request_bytes)},
        {"max_inflight_requests", i64(&config.limits.max_inflight_requests)},
        {"max_inflight_bytes", i64(&config.limits.max_inflight_bytes)},
        {"response_chunk_bytes", i64(&config.limits.response_chunk_bytes)},
        {"allow_non_finite", flag(&config.limits.allow_non_finite)}}},
      {"shutdown",
       {{"drain_grace_seconds", f64(&config.shutdown.drain_grace_seconds)},
        {"deadline_seconds", f64(&config.shutdown.deadline_seconds)}}},
      {"logging",
       {{"level",
         [&reader, &config](const std::string& key, const YAML::Node& node) -> absl::Status {
           absl::StatusOr<std::string> name = reader.Scalar<std::string>(node, key, "a string");
           if (!name.ok()) return name.status();
           if (!ParseLogLevel(*name, &config.logging.level)) {
             return reader.Error(node, absl::StrCat("key '", key,
                                                    "' must be one of debug, info, warning, "
                                                    "error; got '", *name, "'"));
           }
           return absl::OkStatus();
         }}}},
      {"shared_memory",
       {{"allow_client_regions", flag(&config.shared_memory.allow_client_regions)}}},
      {"transport",
       {{"pipeline_min_tokens", i64(&config.transport.pipeline_min_tokens)},
        {"async_scatter_min_bytes", i64(&config.transport.async_scatter_min_bytes)}}},
      {"prefix_cache",
       {{"enabled", flag(&config.prefix_cache.enabled)},
        {"max_bytes", i64(&config.prefix_cache.max_bytes)},
        {"ttl_seconds", f64(&config.prefix_cache.ttl_seconds)},
        {"block_tokens", i64(&config.prefix_cache.block_tokens)},
        {"lease_seconds", f64(&config.prefix_cache.lease_seconds)},
        {"min_mapper_quality", f64(&config.prefix_cache.min_mapper_quality)},
        {"min_r2_heldout", f64(&config.prefix_cache.min_r2_heldout)},
        {"max_input_shift", f64(&config.prefix_cache.max_input_shift)},
        {"pair_min_quality", [&reader, &config](const std::string& key, const YAML::Node& node) {
           return ReadPairFloors(reader, key, node, &config.prefix_cache.pair_min_quality);
         }}}},
      {"security",
       {{"tls_cert_file", str(&config.security.tls_cert_file)},
        {"tls_key_file", str(&config.security.tls_key_file)},
        {"tls_client_ca_file", str(&config.security.tls_client_ca_file)},
        {"auth_token_file", str(&config.security.auth_token_file)}}},
      {"metrics",
       {{"listen_address", str(&config.metrics.listen_address)},
        {"prefill_cost", [&reader, &config](const std::string& key, const YAML::Node& node) {
           return ReadPrefillCosts(reader, key, node, &config.metrics.prefill_cost);
         }}}},
  };

  if (absl::Status status = reader.CheckMap(root, "", KeysOf(sections)); !status.ok()) {
    return status;
  }
  for (const auto& entry : root) {
    const std::string section = entry.first.Scalar();
    absl::Status status = ReadSection(reader, section, entry.second, sections.at(section));
    if (!status.ok()) return status;
  }
  absl::Status status = ValidateKvtdConfig(config);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": ", status.message()));
  }
  return config;
}

absl::StatusOr<KvtdConfig> LoadKvtdConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open config file '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseKvtdConfig(buffer.str(), path);
}

absl::Status ValidateKvtdConfig(const KvtdConfig& config) {
  auto bad = [](absl::string_view key, auto value, absl::string_view rule) {
    return absl::InvalidArgumentError(
        absl::StrCat("key '", key, "' = ", value, " is invalid: ", rule));
  };
  if (config.server.listen_address.empty() && config.server.unix_socket.empty()) {
    return absl::InvalidArgumentError(
        "key 'server.listen_address' is empty and no 'server.unix_socket' is set: nothing to "
        "listen on");
  }
  if (!config.server.listen_address.empty() &&
      config.server.listen_address.rfind(':') == std::string::npos) {
    return bad("server.listen_address", config.server.listen_address, "expected host:port");
  }
  // sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
  if (config.server.unix_socket.size() > 107) {
    return bad("server.unix_socket", config.server.unix_socket,
               "a unix socket path may have at most 107 characters");
  }
  if (config.server.max_message_bytes < (1 << 20) || config.server.max_message_bytes > (1ll << 31) - 1) {
    return bad("server.max_message_bytes", config.server.max_message_bytes,
               "must be in [1 MiB, 2 GiB)");
  }
  if (config.server.max_sync_threads < 4) {
    return bad("server.max_sync_threads", config.server.max_sync_threads, "must be >= 4");
  }
  if (config.mapper_store.host_budget_bytes < 0) {
    return bad("mapper_store.host_budget_bytes", config.mapper_store.host_budget_bytes,
               "must be >= 0 (0: 80% of physical memory)");
  }
  if (config.mapper_store.device_budget_bytes < 0) {
    return bad("mapper_store.device_budget_bytes", config.mapper_store.device_budget_bytes,
               "must be >= 0 (0: automatic)");
  }
  if (config.mapper_store.reload_interval_seconds < 0) {
    return bad("mapper_store.reload_interval_seconds",
               config.mapper_store.reload_interval_seconds, "must be >= 0 (0: off)");
  }
  if (config.mapper_store.acquire_timeout_seconds < 0) {
    return bad("mapper_store.acquire_timeout_seconds",
               config.mapper_store.acquire_timeout_seconds, "must be >= 0");
  }
  for (const std::string& id : config.mapper_store.preload) {
    if (id.empty() || id.find('/') != std::string::npos || id[0] == '.') {
      return bad("mapper_store.preload", absl::StrCat("'", id, "'"),
                 "entries are mapper ids (directory names in mapper_store.path)");
    }
  }
  if (config.backend.type != "auto" && config.backend.type != "cpu" &&
      config.backend.type != "cuda") {
    return bad("backend.type", config.backend.type, "must be auto, cpu or cuda");
  }
  if (config.backend.cpu_threads < 0) {
    return bad("backend.cpu_threads", config.backend.cpu_threads, "must be >= 0");
  }
  if (config.backend.cpu_gemm != "auto" && config.backend.cpu_gemm != "bf16" &&
      config.backend.cpu_gemm != "fp32") {
    return bad("backend.cpu_gemm", config.backend.cpu_gemm, "must be auto, bf16 or fp32");
  }
  if (config.backend.token_chunk < 16) {
    return bad("backend.token_chunk", config.backend.token_chunk, "must be >= 16");
  }
  if (config.limits.max_tokens < 1) {
    return bad("limits.max_tokens", config.limits.max_tokens, "must be >= 1");
  }
  if (config.limits.max_request_bytes < 1) {
    return bad("limits.max_request_bytes", config.limits.max_request_bytes, "must be >= 1");
  }
  if (config.limits.max_inflight_requests < 1) {
    return bad("limits.max_inflight_requests", config.limits.max_inflight_requests,
               "must be >= 1");
  }
  if (config.limits.max_inflight_bytes < config.limits.max_request_bytes) {
    return bad("limits.max_inflight_bytes", config.limits.max_inflight_bytes,
               "must be >= limits.max_request_bytes");
  }
  if (config.limits.response_chunk_bytes < 4096 ||
      config.limits.response_chunk_bytes > config.server.max_message_bytes / 2) {
    return bad("limits.response_chunk_bytes", config.limits.response_chunk_bytes,
               "must be in [4096, server.max_message_bytes / 2]");
  }
  if (config.transport.pipeline_min_tokens < 0) {
    return bad("transport.pipeline_min_tokens", config.transport.pipeline_min_tokens,
               "must be >= 0");
  }
  if (config.transport.async_scatter_min_bytes < 0) {
    return bad("transport.async_scatter_min_bytes", config.transport.async_scatter_min_bytes,
               "must be >= 0");
  }
  const KvtdConfig::PrefixCache& prefix = config.prefix_cache;
  if (prefix.max_bytes < 0) {
    return bad("prefix_cache.max_bytes", prefix.max_bytes, "must be >= 0");
  }
  if (prefix.ttl_seconds <= 0) {
    return bad("prefix_cache.ttl_seconds", prefix.ttl_seconds, "must be > 0");
  }
  if (prefix.block_tokens < 1 || prefix.block_tokens > 4096) {
    return bad("prefix_cache.block_tokens", prefix.block_tokens, "must be in [1, 4096]");
  }
  if (prefix.lease_seconds <= 0) {
    return bad("prefix_cache.lease_seconds", prefix.lease_seconds, "must be > 0");
  }
  if (prefix.max_input_shift < 0) {
    return bad("prefix_cache.max_input_shift", prefix.max_input_shift,
               "must be >= 0 (0: not checked)");
  }
  if (config.security.tls_cert_file.empty() != config.security.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "keys 'security.tls_cert_file' and 'security.tls_key_file' go together: set both for "
        "TLS, or neither");
  }
  if (!config.security.tls_client_ca_file.empty() && config.security.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(
        "key 'security.tls_client_ca_file' (mTLS) needs 'security.tls_cert_file' and "
        "'security.tls_key_file' (TLS) too");
  }
  if (config.shutdown.drain_grace_seconds < 0) {
    return bad("shutdown.drain_grace_seconds", config.shutdown.drain_grace_seconds,
               "must be >= 0");
  }
  if (config.shutdown.deadline_seconds <= 0) {
    return bad("shutdown.deadline_seconds", config.shutdown.deadline_seconds, "must be > 0");
  }
  if (!config.metrics.listen_address.empty() &&
      config.metrics.listen_address.rfind(':') == std::string::npos) {
    return bad("metrics.listen_address", config.metrics.listen_address,
               "expected host:port (or \"\" to disable the metrics endpoint)");
  }
  for (const auto& [model, cost] : config.metrics.prefill_cost) {
    const std::string key = absl::StrCat("metrics.prefill_cost.", model);
    if (cost.a < 0 || cost.b < 0 || cost.c < 0) {
      return bad(key, absl::StrCat("{a: ", cost.a, ", b: ", cost.b, ", c: ", cost.c, "}"),
                 "coefficients must be >= 0");
    }
    if (cost.a + cost.b + cost.c <= 0) {
      return bad(key, "{a: 0, b: 0, c: 0}", "at least one coefficient must be > 0");
    }
  }
  return absl::OkStatus();
}

}  // namespace kvt
