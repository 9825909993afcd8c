// kvtd configuration: the YAML file (every key documented in server/kvtd.yaml), validated
// strictly (unknown keys and bad values are errors naming the key and line), then command-line
// flags on top; one schema of keys behind all of it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/logging.h"

namespace kvt {

struct KvtdConfig {
  struct Server {
    std::string listen_address = "0.0.0.0:50051";  // host:port; port 0 = any free port
    std::string unix_socket;                        // optional extra listener (path)
    int64_t max_message_bytes = 64ll << 20;         // per gRPC message, both directions
    int64_t max_sync_threads = 64;                  // gRPC handler threads (bounded)
  } server;
  struct MapperStoreConfig {
    std::string path = "/var/lib/kvt/mappers";
    int64_t host_budget_bytes = 0;    // host memory for mapper weights; 0 = 80% of RAM
    int64_t device_budget_bytes = 0;  // per device, for prepared copies; 0 = automatic
    double reload_interval_seconds = 10;  // hot-reload polling; 0 = off
    double acquire_timeout_seconds = 30;  // longest wait for room / a load, within deadlines
    bool load_on_scan = true;             // load new mappers that fit at once (else on use)
    std::vector<std::string> preload;     // mapper ids paged onto a device at startup
  } mapper_store;
  struct Backend {
    std::string type = "auto";  // auto | cpu | cuda
    int64_t cpu_threads = 0;    // 0 = all cores
    int64_t token_chunk = 1024; // tokens per compute step (bounds working memory)
    // GEMM engines of the CPU backend: auto (bf16 / fp16 mappers on whichever of oneDNN bf16,
    // oneDNN fp32 and sgemm measures fastest at start-up on the served shapes, fp32 mappers on
    // the faster exact one) | bf16 (oneDNN bf16 forced for bf16 / fp16 mappers, fp32 ones on
    // sgemm) | fp32 (every mapper on OpenBLAS sgemm) | onednn_f32 (every mapper on oneDNN fp32).
    std::string cpu_gemm = "auto";
  } backend;
  struct Limits {
    int64_t max_tokens = 131072;                  // per request
    int64_t max_request_bytes = 16ll << 30;       // source + target cache bytes per request
    int64_t max_inflight_requests = 8;            // translations admitted at once
    int64_t max_inflight_bytes = 32ll << 30;      // cache bytes held by admitted requests
    int64_t response_chunk_bytes = 4ll << 20;     // target chunk size on the wire
    // Publish and TranslateKV refuse caches holding NaN or Inf (INVALID_ARGUMENT naming the
    // layer, kind and element): stored, they would spread into every model translated from
    // them. true: accepted as they are, for callers that need it.
    bool allow_non_finite = false;
  } limits;
  struct Shutdown {
    double drain_grace_seconds = 1.0;  // NOT_SERVING before the listener closes
    double deadline_seconds = 30.0;    // in-flight requests get this long to finish
  } shutdown;
  struct Logging {
    LogLevel level = LogLevel::kInfo;
  } logging;
  struct SharedMemory {
    // Clients may register POSIX shm regions and pass caches through them (same host only).
    bool allow_client_regions = false;
  } shared_memory;
  struct Transport {
    // TranslateKV with inline input of at least this many tokens is layer-pipelined: target
    // layers are computed and streamed back while later source layers still arrive. Smaller
    // requests read everything first (the handoffs cost more than the overlap saves). 0: all.
    int64_t pipeline_min_tokens = 1024;
    // TranslateKV with inline input of at least this many bytes copies received chunks into
    // their layers on a thread of its own while the request's thread reads on. 0: never (the
    // default: on 2 cores it measured slower, docs/BENCHMARKS.md; meant for hosts where the
    // copy gets a core of its own, to be measured there).
    int64_t async_scatter_min_bytes = 0;
  } transport;
  struct PrefixCache {
    // The source-cache tier (kvt.v1.KvPrefixCache): engines publish their caches under (model,
    // token ids); LookupPrefix finds the longest prefix another model can be translated from.
    bool enabled = false;
    int64_t max_bytes = 1ll << 30;  // host memory for stored caches (LRU beyond it)
    double ttl_seconds = 600;       // default and longest lifetime of a stored cache
    int64_t block_tokens = 16;      // chain-hash block: only whole blocks are stored and matched
    double lease_seconds = 30;      // a lookup's lease must be used by TranslateKV within this
    // Counters of the published-prefix digest (prefix_cache/prefix_digest.h): a shared-memory
    // Bloom filter of stored prefixes' first blocks, 2 bytes per slot, that same-host engines
    // read to skip LookupPrefix on a certain miss. A power of two in [1024, 2^28]; 0 = off.
    int64_t digest_slots = 1 << 20;
    // Quality gate: a pair is offered only when its mapper's recorded held-out quality reaches
    // a floor: pair_min_quality["source->target"] when listed (against whatever the mapper
    // records); else min_mapper_quality for the fit's held-out attention-output cosine (past
    // layer 0; docs/EVAL.md: at >= 0.87 every bundled pair recovers >= 0.65 of the context
    // benefit, below it ridge into L recovers 0.40-0.52, no better than token identity's 0.50),
    // or min_r2_heldout for mappers that record only held-out R^2. When max_input_shift > 0 and
    // the mapper has statistics, the prefix's input-shift score must be at most that.
    double min_mapper_quality = 0.87;
    double min_r2_heldout = 0.0;
    std::map<std::string, double> pair_min_quality;
    double max_input_shift = 0;  // 0 = not checked
    // Benefit gate, in addition to the one above: every text source the mapper's manifest
    // records a measured benefit for (quality.benefit, `python -m kvt.qualify` then
    // `kvt record-benefit`) must have its recovered context benefit's 95% lower bound at least
    // pair_min_benefit["source->target"] when listed, else min_benefit_recovered; a mapper that
    // records none is refused. The attention cosine does not see that benefit (docs/EVAL.md,
    // "A second text source"). 0 = off; in [0, 1].
    double min_benefit_recovered = 0.5;
    std::map<std::string, double> pair_min_benefit;
    // Live verification (docs/OPERATIONS.md): every round(1 / verify_sample_fraction)-th
    // gate-passing lookup of a pair answers "verify" instead of a lease; the requester prefills
    // and publishes its own cache, which kvtd compares with its translation of the same source
    // prefix. A mapper version whose last verify_window samples average below its recorded
    // quality.kv_cosine_heldout - verify_tolerance is taken out of service until restored or
    // replaced. 0 = off.
    double verify_sample_fraction = 0.02;
    int64_t verify_window = 8;
    double verify_tolerance = 0.05;
    int64_t verify_max_pending = 64;       // pending samples held (oldest expire first)
    double verify_pending_seconds = 120;   // a sample whose own publish has not arrived expires
  } prefix_cache;
  struct Security {
    std::string tls_cert_file;       // PEM certificate chain; set with tls_key_file for TLS
    std::string tls_key_file;        // PEM private key
    std::string tls_client_ca_file;  // PEM CA; set: mTLS, clients must present a certificate
    std::string auth_token_file;     // "TOKEN ROLE" lines; set: every RPC needs a bearer token
  } security;
  struct Metrics {
    // Prometheus /metrics endpoint, host:port (port 0 = any free port, logged); "" = off.
    std::string listen_address;
    // What a re-prefill of T tokens costs on a target model: ms = a + b*T + c*T^2. Feeds
    // kvt_translate_speedup_ratio when a request carries no reprefill_estimate_ms.
    struct PrefillCost {
      double a = 0;  // ms
      double b = 0;  // ms per token
      double c = 0;  // ms per token^2 (attention)
      double Ms(int64_t tokens) const {
        const double t = static_cast<double>(tokens);
        return a + b * t + c * t * t;
      }
    };
    std::map<std::string, PrefillCost> prefill_cost;  // by target model name
  } metrics;
};

// One key of kvtd.yaml as the schema describes it. The schema (kKeys in server/config.cc) is the
// one list of keys: the YAML parser, the flag overrides (server/config_flags.h), the JSON
// rendering and the validation are all derived from it; config_test checks server/kvtd.yaml
// against it. docs/OPERATIONS.md, "Adding a kvtd key", says how to add one.
struct KvtdConfigKey {
  std::string path;       // "section.key", as in kvtd.yaml: "limits.max_tokens"
  std::string flag;       // the command-line flag overriding it, without "--"; "" = none
  std::string flag_help;  // that flag's --help text
};

// Every key, in kvtd.yaml's order.
const std::vector<KvtdConfigKey>& KvtdConfigKeys();

// Sets the key `path` from text as a command line gives it ("4096", "true", "cpu"), read like
// the same value in kvtd.yaml; errors name `source` (the flag) and the key. Not validated: call
// ValidateKvtdConfig when every override is in.
absl::Status SetKvtdConfigKey(absl::string_view path, absl::string_view text,
                              absl::string_view source, KvtdConfig* config);

// The whole config as JSON, nested like kvtd.yaml ({"limits": {"max_tokens": 131072, ...}}),
// every key present; `indent` as nlohmann::json::dump's (-1: one line).
std::string KvtdConfigToJson(const KvtdConfig& config, int indent = 2);

// Parses YAML text; `source_name` (a path) prefixes error messages.
absl::StatusOr<KvtdConfig> ParseKvtdConfig(absl::string_view yaml_text,
                                           absl::string_view source_name);
absl::StatusOr<KvtdConfig> LoadKvtdConfigFile(const std::string& path);

// The schema's range checks of every key, then the rules that tie keys together (TLS files go in
// pairs, something to listen on); shared by the file and the flag overrides; errors name the key.
absl::Status ValidateKvtdConfig(const KvtdConfig& config);

}  // namespace kvt
