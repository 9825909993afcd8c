#include "server/config.h"

#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "yaml-cpp/yaml.h"

namespace kvt {
namespace {

std::string Where(absl::string_view source, const YAML::Node& node) {
  const YAML::Mark mark = node.Mark();
  if (mark.line < 0) return std::string(source);
  return absl::StrCat(source, ":", mark.line + 1);
}

template <typename T>
absl::Status ReadScalar(absl::string_view source, const std::string& key, const YAML::Node& node,
                        const char* expected, T* out) {
  if (!node.IsScalar()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(source, node), ": key '", key, "' must be ", expected));
  }
  try {
    *out = node.as<T>();
  } catch (const YAML::Exception&) {
    return absl::InvalidArgumentError(absl::StrCat(Where(source, node), ": key '", key,
                                                   "' must be ", expected, ", got '",
                                                   node.Scalar(), "'"));
  }
  return absl::OkStatus();
}

// A mapping key as a string; a key that is itself a map or a list ("{{}: 1}") is an error, not a
// YAML::BadConversion thrown out of the parser.
absl::Status ReadKey(absl::string_view source, const YAML::Node& key, std::string* out) {
  if (!key.IsScalar()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(source, key), ": keys must be plain strings, not a map or a list"));
  }
  *out = key.Scalar();
  return absl::OkStatus();
}

// One section of the file: its keys and how each is stored.
using Setter = std::function<absl::Status(const std::string& key, const YAML::Node&)>;

absl::Status ReadSection(absl::string_view source, const std::string& section,
                         const YAML::Node& node, const std::map<std::string, Setter>& setters) {
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(source, node), ": '", section, "' must be a map"));
  }
  std::set<std::string> seen;
  for (const auto& entry : node) {
    std::string key;
    if (absl::Status status = ReadKey(source, entry.first, &key); !status.ok()) return status;
    const std::string full_key = absl::StrCat(section, ".", key);
    if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(source, entry.first), ": duplicate key '", full_key, "'"));
    }
    auto it = setters.find(key);
    if (it == setters.end()) {
      std::vector<std::string> known;
      for (const auto& setter : setters) known.push_back(setter.first);
      return absl::InvalidArgumentError(absl::StrCat(Where(source, entry.first),
                                                     ": unknown key '", full_key,
                                                     "' (known: ", absl::StrJoin(known, ", "),
                                                     ")"));
    }
    absl::Status status = it->second(full_key, entry.second);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

// metrics.prefill_cost: a map from target model name to {a, b, c}; every coefficient required.
absl::Status ReadPrefillCosts(absl::string_view source, const std::string& key,
                              const YAML::Node& node,
                              std::map<std::string, KvtdConfig::Metrics::PrefillCost>* out) {
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(source, node), ": key '", key,
        "' must be a map from target model name to {a: ms, b: ms/token, c: ms/token^2}"));
  }
  for (const auto& model : node) {
    std::string name;
    if (absl::Status status = ReadKey(source, model.first, &name); !status.ok()) return status;
    const std::string model_key = absl::StrCat(key, ".", name);
    if (out->count(name) > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(source, model.first), ": duplicate key '", model_key, "'"));
    }
    KvtdConfig::Metrics::PrefillCost cost;
    const std::map<std::string, Setter> coefficients = {
        {"a", [&](const std::string& k, const YAML::Node& n) {
           return ReadScalar(source, k, n, "a number", &cost.a);
         }},
        {"b", [&](const std::string& k, const YAML::Node& n) {
           return ReadScalar(source, k, n, "a number", &cost.b);
         }},
        {"c", [&](const std::string& k, const YAML::Node& n) {
           return ReadScalar(source, k, n, "a number", &cost.c);
         }},
    };
    absl::Status status = ReadSection(source, model_key, model.second, coefficients);
    if (!status.ok()) return status;
    for (const char* coefficient : {"a", "b", "c"}) {
      if (!model.second[coefficient]) {
        return absl::InvalidArgumentError(absl::StrCat(Where(source, model.second), ": key '",
                                                       model_key, ".", coefficient,
                                                       "' is required (a, b and c)"));
      }
    }
    (*out)[name] = cost;
  }
  return absl::OkStatus();
}

// prefix_cache.pair_min_quality: a map from "source->target" to a quality floor.
absl::Status ReadPairFloors(absl::string_view source, const std::string& key,
                            const YAML::Node& node, std::map<std::string, double>* out) {
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(source, node), ": key '", key,
        "' must be a map from \"source->target\" (model names) to a quality floor"));
  }
  for (const auto& pair : node) {
    std::string name;
    if (absl::Status status = ReadKey(source, pair.first, &name); !status.ok()) return status;
    const std::string pair_key = absl::StrCat(key, ".", name);
    if (name.find("->") == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(source, pair.first), ": key '", pair_key,
          "' must name a pair as \"source->target\" (model names as in mapper manifests)"));
    }
    if (out->count(name) > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(source, pair.first), ": duplicate key '", pair_key, "'"));
    }
    double floor = 0;
    if (absl::Status s = ReadScalar(source, pair_key, pair.second, "a number", &floor); !s.ok()) {
      return s;
    }
    (*out)[name] = floor;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<KvtdConfig> ParseKvtdConfig(absl::string_view yaml_text,
                                           absl::string_view source_name) {
  KvtdConfig config;
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::ParserException& e) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ":", e.mark.line + 1,
                                                   ": invalid YAML: ", e.msg));
  }
  if (root.IsNull()) return config;  // empty file: all defaults
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source_name, ": top level must be a map of sections"));
  }
  const absl::string_view src = source_name;
  auto str = [src](std::string* out) -> Setter {
    return [src, out](const std::string& key, const YAML::Node& node) {
      return ReadScalar(src, key, node, "a string", out);
    };
  };
  auto i64 = [src](int64_t* out) -> Setter {
    return [src, out](const std::string& key, const YAML::Node& node) {
      return ReadScalar(src, key, node, "an integer", out);
    };
  };
  auto f64 = [src](double* out) -> Setter {
    return [src, out](const std::string& key, const YAML::Node& node) {
      return ReadScalar(src, key, node, "a number", out);
    };
  };

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
        {"load_on_scan",
         [src, &config](const std::string& key, const YAML::Node& node) {
           return ReadScalar(src, key, node, "true or false", &config.mapper_store.load_on_scan);
         }},
        {"preload",
         [src, &config](const std::string& key, const YAML::Node& node) -> absl::Status {
           if (!node.IsSequence()) {
             return absl::InvalidArgumentError(absl::StrCat(
                 Where(src, node), ": key '", key, "' must be a list of mapper ids"));
           }
           config.mapper_store.preload.clear();
           for (const YAML::Node& item : node) {
             std::string id;
             if (absl::Status s = ReadScalar(src, key, item, "a list of mapper ids", &id);
                 !s.ok()) {
               return s;
             }
             config.mapper_store.preload.push_back(id);
           }
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
        {"response_chunk_bytes", i64(&config.limits.response_chunk_bytes)}}},
      {"shutdown",
       {{"drain_grace_seconds", f64(&config.shutdown.drain_grace_seconds)},
        {"deadline_seconds", f64(&config.shutdown.deadline_seconds)}}},
      {"logging",
       {{"level",
         [src, &config](const std::string& key, const YAML::Node& node) -> absl::Status {
           std::string name;
           absl::Status status = ReadScalar(src, key, node, "a string", &name);
           if (!status.ok()) return status;
           if (!ParseLogLevel(name, &config.logging.level)) {
             return absl::InvalidArgumentError(
                 absl::StrCat(Where(src, node), ": key '", key,
                              "' must be one of debug, info, warning, error; got '", name, "'"));
           }
           return absl::OkStatus();
         }}}},
      {"shared_memory",
       {{"allow_client_regions",
         [src, &config](const std::string& key, const YAML::Node& node) {
           return ReadScalar(src, key, node, "true or false",
                             &config.shared_memory.allow_client_regions);
         }}}},
      {"transport",
       {{"pipeline_min_tokens", i64(&config.transport.pipeline_min_tokens)},
        {"async_scatter_min_bytes", i64(&config.transport.async_scatter_min_bytes)}}},
      {"prefix_cache",
       {{"enabled",
         [src, &config](const std::string& key, const YAML::Node& node) {
           return ReadScalar(src, key, node, "true or false", &config.prefix_cache.enabled);
         }},
        {"max_bytes", i64(&config.prefix_cache.max_bytes)},
        {"ttl_seconds", f64(&config.prefix_cache.ttl_seconds)},
        {"block_tokens", i64(&config.prefix_cache.block_tokens)},
        {"lease_seconds", f64(&config.prefix_cache.lease_seconds)},
        {"min_mapper_quality", f64(&config.prefix_cache.min_mapper_quality)},
        {"min_r2_heldout", f64(&config.prefix_cache.min_r2_heldout)},
        {"max_input_shift", f64(&config.prefix_cache.max_input_shift)},
        {"pair_min_quality", [src, &config](const std::string& key, const YAML::Node& node) {
           return ReadPairFloors(src, key, node, &config.prefix_cache.pair_min_quality);
         }}}},
      {"security",
       {{"tls_cert_file", str(&config.security.tls_cert_file)},
        {"tls_key_file", str(&config.security.tls_key_file)},
        {"tls_client_ca_file", str(&config.security.tls_client_ca_file)},
        {"auth_token_file", str(&config.security.auth_token_file)}}},
      {"metrics",
       {{"listen_address", str(&config.metrics.listen_address)},
        {"prefill_cost", [src, &config](const std::string& key, const YAML::Node& node) {
           return ReadPrefillCosts(src, key, node, &config.metrics.prefill_cost);
         }}}},
  };

  std::set<std::string> seen_sections;
  for (const auto& entry : root) {
    std::string section;
    if (absl::Status status = ReadKey(source_name, entry.first, &section); !status.ok()) {
      return status;
    }
    if (!seen_sections.insert(section).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(source_name, entry.first), ": duplicate key '", section, "'"));
    }
    auto it = sections.find(section);
    if (it == sections.end()) {
      std::vector<std::string> known;
      for (const auto& s : sections) known.push_back(s.first);
      return absl::InvalidArgumentError(absl::StrCat(Where(source_name, entry.first),
                                                     ": unknown key '", section,
                                                     "' (known sections: ",
                                                     absl::StrJoin(known, ", "), ")"));
    }
    absl::Status status = ReadSection(source_name, section, entry.second, it->second);
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
