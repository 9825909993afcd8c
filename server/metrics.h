// kvtd's Prometheus metrics (every name, label and bucket in docs/TELEMETRY.md): one registry,
// the families of docs/TELEMETRY.md, label values bounded by the mapper store, values
// read at scrape time (in-flight requests, mapper residency), and the optional /metrics endpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "kernels/mapper_view.h"
#include "mapper_store/store.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvt {

// The `source` / `target` label values of one request. Built only from a mapper the store
// handed out (or as "unknown"), never from the strings a client sent, so the number of series
// stays bounded by the store's contents.
class PairLabels {
 public:
  static constexpr char kUnknown[] = "unknown";
  static PairLabels Unknown() { return PairLabels(kUnknown, kUnknown); }
  static PairLabels Of(const MapperView& mapper) {
    return PairLabels(mapper.source.name, mapper.target.name);
  }
  const std::string& source() const { return source_; }
  const std::string& target() const { return target_; }

 private:
  PairLabels(std::string source, std::string target)
      : source_(std::move(source)), target_(std::move(target)) {}
  std::string source_;
  std::string target_;
};

// Everything one TranslateKV call reports, whatever way it ended.
struct TranslateRecord {
  PairLabels pair = PairLabels::Unknown();
  absl::StatusCode code = absl::StatusCode::kUnknown;
  // Stage durations, seconds; observed only for successful translations (a failure's timings
  // would mix fast rejections into the latency distribution).
  double queue_s = 0, stage_in_s = 0, compute_s = 0, stage_out_s = 0, total_s = 0;
  int64_t tokens = 0;
  std::optional<double> speedup;      // estimated re-prefill time / total time
  std::optional<double> input_shift;  // mapper has feature statistics
};

// What one ValidateKV call reports: the overall quality without layer 0 (see docs/TELEMETRY.md).
struct ValidateRecord {
  PairLabels pair = PairLabels::Unknown();
  absl::StatusCode code = absl::StatusCode::kUnknown;
  uint32_t turn = 0;
  double total_s = 0;
  bool has_quality = false;  // set on success
  double r2_k = 0, r2_v = 0, cosine_k = 0, cosine_v = 0;
  std::optional<double> attention_cosine, c_k, c_v;
};

class Metrics {
 public:
  // `device` is the backend's device ("cpu", "cuda:0"): the `device` label of this process.
  explicit Metrics(std::string device);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves GET /metrics on `listen_address` (host:port, port 0 = any free port); "" = no
  // endpoint. UNAVAILABLE naming metrics.listen_address when it cannot bind.
  //
  // Not prometheus-cpp's Exposer: its civetweb workers run on 100 KiB stacks (Debian builds
  // civetweb with USE_STACK_SIZE=102400), and glibc carves every thread's static TLS out of its
  // stack; OpenBLAS alone has 60 KiB of TLS, so in kvtd the first scrape overflowed the stack.
  // The endpoint here is one thread with a default-sized stack serving one scrape at a time.
  absl::Status StartExposer(const std::string& listen_address);
  // The bound port; 0 without an endpoint.
  int port() const { return port_; }

  // kvt_backend_info{backend, device, requested} = 1: which engine kvtd chose for backend.type.
  void SetBackend(const std::string& backend, const std::string& device,
                  const std::string& requested);
  // kvt_backend_self_check{backend, device, result} = 1: a backend's start-up self-check
  // (server/backend_self_check.h); result "pass", "mismatch" or "error".
  void SetBackendSelfCheck(const std::string& backend, const std::string& device,
                           const std::string& result);
  // kvt_cpu_gemm_path{path, isa, requested} = 1: the CPU backend's GEMM path for bf16 / fp16
  // mappers ("onednn_bf16" | "sgemm"), the ISA oneDNN dispatches, backend.cpu_gemm.
  void SetCpuGemmPath(const std::string& path, const std::string& isa,
                      const std::string& requested);
  // kvt_cpu_gemm_probe_gflops{engine}: what `cpu_gemm: auto` measured per engine (onednn_bf16,
  // sgemm) at start-up, single-threaded GFLOP/s on the served shapes. Absent when forced.
  void SetCpuGemmProbe(const std::string& engine, double gflops);
  // Scrape-time sources: the store (residency) and the number of admitted requests. Either may
  // be null / empty; they must outlive this object or be reset first.
  void SetScrapeSources(const MapperStore* store, std::function<int64_t()> inflight_requests);

  void RecordTranslate(const TranslateRecord& record);
  void RecordValidate(const ValidateRecord& record);
  // For the mapper store's pager: a mapper copied into / dropped from a tier ("host": loaded
  // from disk into host memory; else a device copy), and every acquisition (hit: resident).
  void RecordPageIn(const PairLabels& pair, const std::string& device, double seconds);
  void RecordEviction(const PairLabels& pair, const std::string& device);
  void RecordMapperAccess(const PairLabels& pair, const std::string& device, bool hit);

  // The prefix cache (kvt.v1.KvPrefixCache). Model labels come from the mapper store (a publish
  // or lookup for a model no mapper names is refused before it is recorded, as "unknown").
  // result: "hit", or the miss reason of LookupPrefixResponse ("no_prefix", "gate", ...).
  void RecordPrefixLookup(const std::string& target, const std::string& result);
  // Tokens of a prefix of `pair.source` leased for translation into `pair.target`.
  void RecordPrefixReuse(const PairLabels& pair, int64_t tokens);
  // result: "stored", "empty" (shorter than a block) or the error code.
  void RecordPrefixPublish(const std::string& model, const std::string& result, int64_t tokens);
  // reason: "lru", "ttl", "subsumed", "admin".
  void RecordPrefixEviction(const std::string& reason, int64_t bytes);
  void SetPrefixCacheUsage(int64_t bytes_held, int64_t max_bytes, int64_t entries);
  // The published-prefix digest (prefix_cache/prefix_digest.h): the keys it holds and the
  // estimated share of unstored prompts it answers "maybe" (each then costs a LookupPrefix).
  void SetPrefixDigestUsage(int64_t keys, double false_positive_rate);
  // Live verification (server/live_verifier.h). result: "pass" / "fail" (the sample against
  // the mapper's recorded kv_cosine_heldout - tolerance; "pass" when it records none), "expired"
  // (no own publish in time, or pushed out), "skipped" (the mapper changed version or could not
  // be measured).
  void RecordLiveVerification(const PairLabels& pair, const std::string& mapper,
                              const std::string& result);
  // kvt_live_quality{source, target, mapper}: mean K/V cosine of the last window of samples.
  void SetLiveQuality(const PairLabels& pair, const std::string& mapper, double value);
  // kvt_mapper_out_of_service{source, target, mapper}: 1 while live verification holds the
  // mapper's current version out of service, else 0.
  void SetMapperOutOfService(const PairLabels& pair, const std::string& mapper, bool out);

  // The text exposition (what GET /metrics returns).
  std::string Serialize() const;
  // Every family kvtd can export, with or without series yet (dashboards and alerts are checked
  // against it).
  std::vector<std::string> FamilyNames() const;

  // The `turn` label: "0" .. "9" exactly, then "10-19", "20+" (bounded, fine where drift is).
  static std::string TurnBucket(uint32_t turn);
  // "OK", "INVALID_ARGUMENT", ...: the `code` label.
  static std::string CodeLabel(absl::StatusCode code);

 private:
  class ScrapeCollector;
  class HttpEndpoint;

  // Records a registered family's name (FamilyNames) and returns it.
  template <typename T>
  prometheus::Family<T>* Keep(prometheus::Family<T>& family) {
    family_names_.push_back(family.GetName());
    return &family;
  }

  const std::string device_;
  std::vector<std::string> family_names_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ScrapeCollector> scrape_;
  std::unique_ptr<HttpEndpoint> endpoint_;
  int port_ = 0;

  prometheus::Family<prometheus::Gauge>* build_info_;
  prometheus::Family<prometheus::Gauge>* backend_info_;
  prometheus::Family<prometheus::Gauge>* backend_self_check_;
  prometheus::Family<prometheus::Gauge>* cpu_gemm_path_;
  prometheus::Family<prometheus::Gauge>* cpu_gemm_probe_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* duration_;
  prometheus::Family<prometheus::Counter>* tokens_;
  prometheus::Family<prometheus::Histogram>* speedup_;
  prometheus::Family<prometheus::Histogram>* input_shift_;
  prometheus::Family<prometheus::Counter>* validate_requests_;
  prometheus::Family<prometheus::Histogram>* validate_duration_;
  prometheus::Family<prometheus::Histogram>* attention_cosine_;
  prometheus::Family<prometheus::Histogram>* r2_;
  prometheus::Family<prometheus::Histogram>* kv_cosine_;
  prometheus::Family<prometheus::Histogram>* error_concentration_;
  prometheus::Family<prometheus::Counter>* page_ins_;
  prometheus::Family<prometheus::Counter>* evictions_;
  prometheus::Family<prometheus::Histogram>* page_in_duration_;
  prometheus::Family<prometheus::Counter>* acquisitions_;
  prometheus::Family<prometheus::Counter>* prefix_lookups_;
  prometheus::Family<prometheus::Counter>* prefix_reused_tokens_;
  prometheus::Family<prometheus::Counter>* prefix_publishes_;
  prometheus::Family<prometheus::Counter>* prefix_published_tokens_;
  prometheus::Family<prometheus::Counter>* prefix_evictions_;
  prometheus::Family<prometheus::Counter>* prefix_evicted_bytes_;
  prometheus::Family<prometheus::Counter>* live_verifications_;
  prometheus::Family<prometheus::Gauge>* live_quality_;
  prometheus::Family<prometheus::Gauge>* out_of_service_;
  prometheus::Family<prometheus::Gauge>* prefix_bytes_;
  prometheus::Family<prometheus::Gauge>* prefix_entries_;
  prometheus::Family<prometheus::Gauge>* digest_keys_;
  prometheus::Family<prometheus::Gauge>* digest_false_positives_;
};

}  // namespace kvt
