#include "server/config.h"

#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/strict_reader.h"
#include "nlohmann/json.hpp"
#include "prefix_cache/prefix_digest.h"
#include "yaml-cpp/yaml.h"

namespace kvt {
namespace {

using strict::YamlReader;

// ---- How each member type is read from YAML and written as JSON ----
// A key's type is its KvtdConfig member's: a new key of an existing type needs nothing here.

template <typename T>
absl::Status ReadScalar(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                        absl::string_view type, T* out) {
  absl::StatusOr<T> value = reader.Scalar<T>(node, path, type);
  if (!value.ok()) return value.status();
  *out = *std::move(value);
  return absl::OkStatus();
}

absl::Status ReadValue(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                       std::string* out) {
  return ReadScalar(reader, path, node, "a string", out);
}
absl::Status ReadValue(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                       int64_t* out) {
  return ReadScalar(reader, path, node, "an integer", out);
}
absl::Status ReadValue(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                       double* out) {
  return ReadScalar(reader, path, node, "a number", out);
}
absl::Status ReadValue(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                       bool* out) {
  return ReadScalar(reader, path, node, "true or false", out);
}
absl::Status ReadValue(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                       std::vector<std::string>* out) {
  absl::StatusOr<std::vector<std::string>> values =
      reader.ScalarList<std::string>(node, path, "a list of strings", "a string");
  if (!values.ok()) return values.status();
  *out = *std::move(values);
  return absl::OkStatus();
}
absl::Status ReadValue(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                       LogLevel* out) {
  std::string name;
  if (absl::Status status = ReadScalar(reader, path, node, "a string", &name); !status.ok()) {
    return status;
  }
  if (!ParseLogLevel(name, out)) {
    return reader.Error(node, absl::StrCat("key '", path,
                                           "' must be one of debug, info, warning, error; got '",
                                           name, "'"));
  }
  return absl::OkStatus();
}
// A map from names chosen by the writer to numbers (prefix_cache.pair_min_quality).
absl::Status ReadValue(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                       std::map<std::string, double>* out) {
  if (!node.IsMap()) return reader.WrongType(node, path, "a map from names to numbers");
  if (absl::Status status = reader.CheckFreeMap(node, path); !status.ok()) return status;
  for (const auto& entry : node) {
    const std::string name = entry.first.Scalar();
    double value = 0;
    if (absl::Status status =
            ReadScalar(reader, strict::Path(path, name), entry.second, "a number", &value);
        !status.ok()) {
      return status;
    }
    (*out)[name] = value;
  }
  return absl::OkStatus();
}
// metrics.prefill_cost: a map from target model name to {a, b, c}; every coefficient required.
absl::Status ReadValue(const YamlReader& reader, const std::string& path, const YAML::Node& node,
                       std::map<std::string, KvtdConfig::Metrics::PrefillCost>* out) {
  if (!node.IsMap()) {
    return reader.WrongType(node, path,
                            "a map from target model name to {a: ms, b: ms/token, c: ms/token^2}");
  }
  if (absl::Status status = reader.CheckFreeMap(node, path); !status.ok()) return status;
  for (const auto& model : node) {
    const std::string name = model.first.Scalar();
    const std::string model_path = strict::Path(path, name);
    if (absl::Status s = reader.CheckMap(model.second, model_path, {"a", "b", "c"}); !s.ok()) {
      return s;
    }
    KvtdConfig::Metrics::PrefillCost cost;
    for (const auto& [coefficient, value] :
         {std::pair<const char*, double*>{"a", &cost.a}, {"b", &cost.b}, {"c", &cost.c}}) {
      if (absl::Status s =
              reader.RequiredScalar(model.second, model_path, coefficient, "a number", value);
          !s.ok()) {
        return s;
      }
    }
    (*out)[name] = cost;
  }
  return absl::OkStatus();
}

template <typename T>
nlohmann::json Render(const T& value) {
  return value;
}
nlohmann::json Render(LogLevel level) { return std::string(LogLevelName(level)); }
nlohmann::json Render(const std::map<std::string, KvtdConfig::Metrics::PrefillCost>& costs) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [model, cost] : costs) {
    out[model] = {{"a", cost.a}, {"b", cost.b}, {"c", cost.c}};
  }
  return out;
}

// A value as error messages quote it: strings and numbers as they are, the rest as JSON.
std::string Shown(const std::string& value) { return value; }
std::string Shown(int64_t value) { return absl::StrCat(value); }
std::string Shown(double value) { return absl::StrCat(value); }
template <typename T>
std::string Shown(const T& value) {
  return Render(value).dump();
}

// ---- The schema's rows ----

// One key, type-erased: how to read it, render it and check it.
struct Row {
  KvtdConfigKey key;
  std::function<absl::Status(const YamlReader&, const YAML::Node&, KvtdConfig*)> read;
  std::function<nlohmann::json(const KvtdConfig&)> render;
  std::function<absl::Status(const KvtdConfig&)> check;
};

// Builds the Row of the KvtdConfig member `section.*member`, stored as T; the rule methods add
// range checks whose errors name the key ("key 'x.y' = V is invalid: must be >= 1").
template <typename T>
class Key {
 public:
  // The rule a value breaks, or "" when it keeps it; sees the whole config for rules that
  // compare keys (limits.max_inflight_bytes >= limits.max_request_bytes).
  using Rule = std::function<std::string(const KvtdConfig&, const T&)>;
  using Reader = std::function<absl::Status(const YamlReader&, const std::string& path,
                                            const YAML::Node&, T*)>;

  template <typename Section>
  Key(const char* path, Section KvtdConfig::*section, T Section::*member)
      : path_(path),
        get_([section, member](KvtdConfig* config) { return &((config->*section).*member); }),
        get_const_([section, member](const KvtdConfig& config) -> const T& {
          return (config.*section).*member;
        }) {}

  // --flag overrides the key; `help` is its --help line.
  Key&& Flag(const char* flag, const char* help) && {
    flag_ = flag;
    flag_help_ = help;
    return std::move(*this);
  }
  Key&& AtLeast(T min, const char* note = "") && {
    return std::move(*this).Check([min, note](const KvtdConfig&, const T& value) {
      return value >= min ? std::string() : absl::StrCat("must be >= ", min, note);
    });
  }
  Key&& Above(T min) && {
    return std::move(*this).Check([min](const KvtdConfig&, const T& value) {
      return value > min ? std::string() : absl::StrCat("must be > ", min);
    });
  }
  Key&& InRange(T min, T max, const char* note = "") && {
    return std::move(*this).Check([min, max, note](const KvtdConfig&, const T& value) {
      return value >= min && value <= max ? std::string()
                                          : absl::StrCat("must be in [", min, ", ", max, "]", note);
    });
  }
  Key&& OneOf(std::vector<std::string> allowed) && {
    return std::move(*this).Check([allowed](const KvtdConfig&, const T& value) {
      for (const std::string& name : allowed) {
        if (value == name) return std::string();
      }
      return absl::StrCat("must be ", absl::StrJoin(allowed.begin(), allowed.end() - 1, ", "),
                          " or ", allowed.back());
    });
  }
  Key&& Check(Rule rule) && {
    rules_.push_back(std::move(rule));
    return std::move(*this);
  }
  // Replaces the type's reader, for values with a form of their own (a pair name as a key).
  Key&& ReadWith(Reader reader) && {
    reader_ = std::move(reader);
    return std::move(*this);
  }

  operator Row() && {
    Row row;
    row.key = {path_, flag_, flag_help_};
    const std::string path = path_;
    row.read = [path, get = get_, reader = reader_](const YamlReader& yaml,
                                                    const YAML::Node& node, KvtdConfig* config) {
      // Read into a copy so that a failed read leaves the config as it was.
      T value = *get(config);
      absl::Status status =
          reader ? reader(yaml, path, node, &value) : ReadValue(yaml, path, node, &value);
      if (status.ok()) *get(config) = std::move(value);
      return status;
    };
    row.render = [get = get_const_](const KvtdConfig& config) { return Render(get(config)); };
    row.check = [path, get = get_const_, rules = rules_](const KvtdConfig& config) {
      for (const Rule& rule : rules) {
        const std::string broken = rule(config, get(config));
        if (!broken.empty()) {
          return absl::InvalidArgumentError(absl::StrCat("key '", path, "' = ", Shown(get(config)),
                                                         " is invalid: ", broken));
        }
      }
      return absl::OkStatus();
    };
    return row;
  }

 private:
  std::string path_;
  std::function<T*(KvtdConfig*)> get_;
  std::function<const T&(const KvtdConfig&)> get_const_;
  std::string flag_;
  std::string flag_help_;
  std::vector<Rule> rules_;
  Reader reader_;
};

// Key(KVTD_KEY(limits, max_tokens)): the path is spelled from the member's own names, so the
// two cannot drift apart.
#define KVTD_KEY(section, member) \
  #section "." #member, &KvtdConfig::section, &decltype(KvtdConfig::section)::member

std::string HostPort(const std::string& address, const char* rule) {
  return address.empty() || address.rfind(':') != std::string::npos ? std::string() : rule;
}

// prefix_cache.pair_min_quality, pair_min_benefit: keys are "source->target"; the error names
// the key's line.
absl::Status ReadPairFloors(const YamlReader& reader, const std::string& path,
                            const YAML::Node& node, std::map<std::string, double>* out) {
  if (!node.IsMap()) {
    return reader.WrongType(node, path,
                            "a map from \"source->target\" (model names) to a quality floor");
  }
  if (absl::Status status = reader.CheckFreeMap(node, path); !status.ok()) return status;
  for (const auto& pair : node) {
    const std::string name = pair.first.Scalar();
    if (name.find("->") == std::string::npos) {
      return reader.Error(pair.first, absl::StrCat("key '", strict::Path(path, name),
                                                   "' must name a pair as \"source->target\" "
                                                   "(model names as in mapper manifests)"));
    }
  }
  return ReadValue(reader, path, node, out);
}

// THE list of kvtd.yaml's keys, in the file's order. A key is its KvtdConfig member (type and
// default, server/config.h) plus one row here (path, rules, flag) plus its comment in
// server/kvtd.yaml; config_test fails when these disagree. Rules that tie several keys to each
// other without one key to blame are in CheckAcrossKeys below.
const std::vector<Row>& Rows() {
  static const std::vector<Row>* const rows = new std::vector<Row>{
      Key(KVTD_KEY(server, listen_address))
          .Check([](const KvtdConfig&, const std::string& address) {
            return HostPort(address, "expected host:port");
          })
          .Flag("listen_address",
                "Overrides server.listen_address (host:port; port 0 = any free port, logged)."),
      // sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
      Key(KVTD_KEY(server, unix_socket))
          .Check([](const KvtdConfig&, const std::string& path) {
            return path.size() <= 107 ? std::string()
                                      : "a unix socket path may have at most 107 characters";
          })
          .Flag("unix_socket", "Overrides server.unix_socket (extra listener)."),
      Key(KVTD_KEY(server, max_message_bytes))
          .InRange(1 << 20, (1ll << 31) - 1, " (1 MiB to 2 GiB - 1)"),
      Key(KVTD_KEY(server, max_sync_threads)).AtLeast(4),

      Key(KVTD_KEY(mapper_store, path))
          .Flag("mapper_store", "Overrides mapper_store.path."),
      Key(KVTD_KEY(mapper_store, host_budget_bytes))
          .AtLeast(0, " (0: 80% of physical memory)"),
      Key(KVTD_KEY(mapper_store, device_budget_bytes)).AtLeast(0, " (0: automatic)"),
      Key(KVTD_KEY(mapper_store, reload_interval_seconds)).AtLeast(0, " (0: off)"),
      Key(KVTD_KEY(mapper_store, acquire_timeout_seconds)).AtLeast(0),
      Key(KVTD_KEY(mapper_store, load_on_scan)),
      Key(KVTD_KEY(mapper_store, preload))
          .Check([](const KvtdConfig&, const std::vector<std::string>& ids) {
            for (const std::string& id : ids) {
              if (id.empty() || id.find('/') != std::string::npos || id[0] == '.') {
                return absl::StrCat("'", id,
                                    "': entries are mapper ids (directory names in "
                                    "mapper_store.path)");
              }
            }
            return std::string();
          }),

      Key(KVTD_KEY(backend, type))
          .OneOf({"auto", "cpu", "cuda"})
          .Flag("backend", "Overrides backend.type: auto | cpu | cuda."),
      Key(KVTD_KEY(backend, cpu_threads))
          .AtLeast(0)
          .Flag("cpu_threads", "Overrides backend.cpu_threads (0 = all cores)."),
      Key(KVTD_KEY(backend, token_chunk)).AtLeast(16),
      Key(KVTD_KEY(backend, cpu_gemm))
          .OneOf({"auto", "bf16", "fp32", "onednn_f32"})
          .Flag("cpu_gemm", "Overrides backend.cpu_gemm: auto | bf16 | fp32 | onednn_f32."),

      Key(KVTD_KEY(limits, max_tokens))
          .AtLeast(1)
          .Flag("max_tokens", "Overrides limits.max_tokens."),
      Key(KVTD_KEY(limits, max_request_bytes)).AtLeast(1),
      Key(KVTD_KEY(limits, max_inflight_requests))
          .AtLeast(1)
          .Flag("max_inflight_requests", "Overrides limits.max_inflight_requests."),
      Key(KVTD_KEY(limits, max_inflight_bytes))
          .Check([](const KvtdConfig& config, const int64_t& bytes) {
            return bytes >= config.limits.max_request_bytes
                       ? std::string()
                       : "must be >= limits.max_request_bytes";
          }),
      Key(KVTD_KEY(limits, response_chunk_bytes))
          .Check([](const KvtdConfig& config, const int64_t& bytes) {
            return bytes >= 4096 && bytes <= config.server.max_message_bytes / 2
                       ? std::string()
                       : "must be in [4096, server.max_message_bytes / 2]";
          }),
      Key(KVTD_KEY(limits, allow_non_finite))
          .Flag("allow_non_finite",
                "Sets limits.allow_non_finite: accept NaN and Inf in published and translated "
                "caches."),

      Key(KVTD_KEY(shutdown, drain_grace_seconds))
          .AtLeast(0)
          .Flag("drain_grace_seconds", "Overrides shutdown.drain_grace_seconds."),
      Key(KVTD_KEY(shutdown, deadline_seconds))
          .Above(0)
          .Flag("shutdown_deadline_seconds", "Overrides shutdown.deadline_seconds."),

      Key(KVTD_KEY(logging, level))
          .Flag("log_level", "Overrides logging.level: debug | info | warning | error."),

      Key(KVTD_KEY(shared_memory, allow_client_regions)),

      Key(KVTD_KEY(transport, pipeline_min_tokens)).AtLeast(0),
      Key(KVTD_KEY(transport, async_scatter_min_bytes)).AtLeast(0),

      Key(KVTD_KEY(prefix_cache, enabled)),
      Key(KVTD_KEY(prefix_cache, max_bytes)).AtLeast(0),
      Key(KVTD_KEY(prefix_cache, ttl_seconds)).Above(0),
      Key(KVTD_KEY(prefix_cache, block_tokens)).InRange(1, 4096),
      Key(KVTD_KEY(prefix_cache, lease_seconds)).Above(0),
      Key(KVTD_KEY(prefix_cache, digest_slots))
          .Check([](const KvtdConfig&, const int64_t& slots) {
            return slots == 0 || (slots >= kPrefixDigestMinSlots &&
                                  slots <= kPrefixDigestMaxSlots && (slots & (slots - 1)) == 0)
                       ? std::string()
                       : absl::StrCat("must be 0 (off) or a power of two in [",
                                      kPrefixDigestMinSlots, ", ", kPrefixDigestMaxSlots, "]");
          }),
      Key(KVTD_KEY(prefix_cache, min_mapper_quality)),
      Key(KVTD_KEY(prefix_cache, min_r2_heldout)),
      Key(KVTD_KEY(prefix_cache, pair_min_quality))
          .ReadWith(ReadPairFloors),
      Key(KVTD_KEY(prefix_cache, max_input_shift)).AtLeast(0, " (0: not checked)"),
      Key(KVTD_KEY(prefix_cache, min_benefit_recovered)).InRange(0.0, 1.0, " (0: off)"),
      Key(KVTD_KEY(prefix_cache, pair_min_benefit))
          .ReadWith(ReadPairFloors)
          .Check([](const KvtdConfig&, const std::map<std::string, double>& floors) {
            for (const auto& [pair, floor] : floors) {
              if (!(floor >= 0 && floor <= 1)) {
                return absl::StrCat("the floor of '", pair, "' must be in [0, 1] (0: off)");
              }
            }
            return std::string();
          }),
      Key(KVTD_KEY(prefix_cache, verify_sample_fraction))
          .Check([](const KvtdConfig&, const double& fraction) {
            return fraction >= 0 && fraction <= 1 ? std::string()
                                                  : "must be in [0, 1] (0: off)";
          }),
      Key(KVTD_KEY(prefix_cache, verify_window)).InRange(1, 4096),
      Key(KVTD_KEY(prefix_cache, verify_tolerance)).AtLeast(0),
      Key(KVTD_KEY(prefix_cache, verify_max_pending)).InRange(1, 1 << 20),
      Key(KVTD_KEY(prefix_cache, verify_pending_seconds)).Above(0),

      Key(KVTD_KEY(security, tls_cert_file))
          .Flag("tls_cert_file", "Overrides security.tls_cert_file (PEM, enables TLS)."),
      Key(KVTD_KEY(security, tls_key_file))
          .Flag("tls_key_file", "Overrides security.tls_key_file (PEM)."),
      Key(KVTD_KEY(security, tls_client_ca_file))
          .Flag("tls_client_ca_file",
                "Overrides security.tls_client_ca_file (PEM CA; enables mTLS)."),
      Key(KVTD_KEY(security, auth_token_file))
          .Flag("auth_token_file",
                "Overrides security.auth_token_file (\"TOKEN ROLE\" lines; enables bearer "
                "auth)."),

      Key(KVTD_KEY(metrics, listen_address))
          .Check([](const KvtdConfig&, const std::string& address) {
            return HostPort(address,
                            "expected host:port (or \"\" to disable the metrics endpoint)");
          })
          .Flag("metrics_listen_address",
                "Overrides metrics.listen_address: the Prometheus /metrics endpoint, host:port "
                "(port 0 = any free port, logged in the 'metrics listening' line)."),
      Key(KVTD_KEY(metrics, prefill_cost)),
  };
  return *rows;
}

#undef KVTD_KEY

const Row* FindRow(absl::string_view path) {
  for (const Row& row : Rows()) {
    if (row.key.path == path) return &row;
  }
  return nullptr;
}

// "limits" of "limits.max_tokens".
std::string SectionOf(const std::string& path) { return path.substr(0, path.find('.')); }
std::string NameOf(const std::string& path) { return path.substr(path.find('.') + 1); }

// Rules between keys that blame no single one of them, and rules per entry of a map.
absl::Status CheckAcrossKeys(const KvtdConfig& config) {
  if (config.server.listen_address.empty() && config.server.unix_socket.empty()) {
    return absl::InvalidArgumentError(
        "key 'server.listen_address' is empty and no 'server.unix_socket' is set: nothing to "
        "listen on");
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
  for (const auto& [model, cost] : config.metrics.prefill_cost) {
    const std::string key = absl::StrCat("metrics.prefill_cost.", model);
    auto bad = [&key](absl::string_view value, absl::string_view rule) {
      return absl::InvalidArgumentError(
          absl::StrCat("key '", key, "' = ", value, " is invalid: ", rule));
    };
    if (cost.a < 0 || cost.b < 0 || cost.c < 0) {
      return bad(absl::StrCat("{a: ", cost.a, ", b: ", cost.b, ", c: ", cost.c, "}"),
                 "coefficients must be >= 0");
    }
    if (cost.a + cost.b + cost.c <= 0) {
      return bad("{a: 0, b: 0, c: 0}", "at least one coefficient must be > 0");
    }
  }
  return absl::OkStatus();
}

}  // namespace

const std::vector<KvtdConfigKey>& KvtdConfigKeys() {
  static const std::vector<KvtdConfigKey>* const keys = [] {
    auto* keys = new std::vector<KvtdConfigKey>;
    for (const Row& row : Rows()) keys->push_back(row.key);
    return keys;
  }();
  return *keys;
}

absl::Status SetKvtdConfigKey(absl::string_view path, absl::string_view text,
                              absl::string_view source, KvtdConfig* config) {
  const Row* row = FindRow(path);
  if (row == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": unknown key '", path, "'"));
  }
  // A plain scalar node holding the text as given: read by the key's own reader, never parsed
  // as YAML (a flag value "[x" or "a: b" is a string, not a list or a map).
  const YAML::Node node(std::string{text});
  return row->read(YamlReader(source), node, config);
}

std::string KvtdConfigToJson(const KvtdConfig& config, int indent) {
  nlohmann::json out = nlohmann::json::object();
  for (const Row& row : Rows()) {
    out[SectionOf(row.key.path)][NameOf(row.key.path)] = row.render(config);
  }
  return out.dump(indent);
}

absl::StatusOr<KvtdConfig> ParseKvtdConfig(absl::string_view yaml_text,
                                           absl::string_view source_name) {
  KvtdConfig config;
  const YamlReader reader(source_name);
  absl::StatusOr<YAML::Node> loaded = reader.Load(yaml_text);
  if (!loaded.ok()) return loaded.status();
  const YAML::Node& root = *loaded;
  if (root.IsNull()) return config;  // empty file: all defaults
  if (!root.IsMap()) return reader.Error(root, "top level must be a map of sections");

  // Sections and their keys, in the schema's order (the order unknown-key errors list them).
  std::vector<std::string> sections;
  std::map<std::string, std::vector<std::string>> keys;
  std::map<std::string, const Row*> rows;
  for (const Row& row : Rows()) {
    const std::string section = SectionOf(row.key.path);
    if (keys.find(section) == keys.end()) sections.push_back(section);
    keys[section].push_back(NameOf(row.key.path));
    rows[row.key.path] = &row;
  }
  if (absl::Status status = reader.CheckMap(root, "", sections); !status.ok()) return status;
  for (const auto& section : root) {
    const std::string name = section.first.Scalar();
    if (absl::Status status = reader.CheckMap(section.second, name, keys.at(name));
        !status.ok()) {
      return status;
    }
    for (const auto& entry : section.second) {
      const std::string path = strict::Path(name, entry.first.Scalar());
      if (absl::Status status = rows.at(path)->read(reader, entry.second, &config);
          !status.ok()) {
        return status;
      }
    }
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
  for (const Row& row : Rows()) {
    if (absl::Status status = row.check(config); !status.ok()) return status;
  }
  return CheckAcrossKeys(config);
}

}  // namespace kvt
