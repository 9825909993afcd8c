#include "server/metrics.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/mutex.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"
#include "server/server_metadata.h"

namespace kvt {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

// Latencies from a sub-millisecond small translation to a multi-second 128K-token one.
const Histogram::BucketBoundaries& LatencyBuckets() {
  static const Histogram::BucketBoundaries buckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
  return buckets;
}
// Re-prefill time / translate time: below 1 is a loss, the paper reports 2.7x .. 25x.
const Histogram::BucketBoundaries& SpeedupBuckets() {
  static const Histogram::BucketBoundaries buckets = {0.5, 1,  1.5, 2,  3,  5,  7.5,
                                                      10,  15, 20,  30, 50, 100};
  return buckets;
}
// Cosines in [0, 1], fine near 1 where usable translations sit (negative ones land in le=0).
const Histogram::BucketBoundaries& CosineBuckets() {
  static const Histogram::BucketBoundaries buckets = {0,    0.5,  0.7,   0.8,  0.85,
                                                      0.9,  0.925, 0.95, 0.96, 0.97,
                                                      0.98, 0.99, 0.995, 0.999, 1};
  return buckets;
}
// R^2 (the paper's pairs: 0.3 .. 0.85); below 0 is worse than predicting the mean.
const Histogram::BucketBoundaries& R2Buckets() {
  static const Histogram::BucketBoundaries buckets = {0,   0.2, 0.3,  0.4, 0.5,  0.6, 0.7,
                                                      0.75, 0.8, 0.85, 0.9, 0.95, 0.99, 1};
  return buckets;
}
// Error concentration: 1 = isotropic, > 1 errors where attention reads.
const Histogram::BucketBoundaries& ConcentrationBuckets() {
  static const Histogram::BucketBoundaries buckets = {0.25, 0.5, 0.75, 0.9, 1, 1.1,
                                                      1.25, 1.5, 2,    3,   5};
  return buckets;
}
// Mean standardised squared deviation: about 1 in distribution.
const Histogram::BucketBoundaries& InputShiftBuckets() {
  static const Histogram::BucketBoundaries buckets = {0.5, 0.75, 0.9, 1,  1.1, 1.25, 1.5,
                                                      2,   3,    5,   10, 25,  100};
  return buckets;
}

prometheus::ClientMetric::Label Label(std::string name, std::string value) {
  prometheus::ClientMetric::Label label;
  label.name = std::move(name);
  label.value = std::move(value);
  return label;
}

}  // namespace

// Families whose values live elsewhere (the store, the admission controller), read per scrape so
// they can never disagree with their source.
class Metrics::ScrapeCollector : public prometheus::Collectable {
 public:
  void Set(const MapperStore* store, std::function<int64_t()> inflight)
      ABSL_LOCKS_EXCLUDED(mutex_) {
    MutexLock lock(&mutex_);
    store_ = store;
    inflight_ = std::move(inflight);
  }

  std::vector<prometheus::MetricFamily> Collect() const override ABSL_LOCKS_EXCLUDED(mutex_) {
    MutexLock lock(&mutex_);
    std::vector<prometheus::MetricFamily> families;
    prometheus::MetricFamily inflight;
    inflight.name = "kvt_inflight_requests";
    inflight.help = "Translations and validations admitted and not yet finished.";
    inflight.type = prometheus::MetricType::Gauge;
    inflight.metric.emplace_back();
    inflight.metric.back().gauge.value = inflight_ ? static_cast<double>(inflight_()) : 0.0;
    families.push_back(std::move(inflight));

    prometheus::MetricFamily resident;
    resident.name = "kvt_mapper_device_resident_bytes";
    resident.help =
        "Bytes of mapper weights held per place (device=\"host\": host memory of the store; "
        "\"cuda:N\": device copies).";
    resident.type = prometheus::MetricType::Gauge;
    prometheus::MetricFamily tiers;
    tiers.name = "kvt_mapper_tier_bytes";
    tiers.help =
        "Mapper memory per tier (device=\"host\" or a device) by kind: budget (0 = no limit), "
        "used (resident copies, pinned or not), pinned (held by in-flight requests), reserved "
        "(loads and page-ins in flight).";
    tiers.type = prometheus::MetricType::Gauge;
    if (store_ != nullptr) {
      for (const MapperInfo& info : store_->List()) {
        for (const Placement& placement : info.placements) {
          prometheus::ClientMetric metric;
          metric.label = {Label("device", placement.device), Label("mapper", info.id),
                          Label("source", info.source_model), Label("target", info.target_model)};
          metric.gauge.value = static_cast<double>(placement.bytes);
          resident.metric.push_back(std::move(metric));
        }
      }
      for (const TierUsage& tier : store_->Usage()) {
        for (const auto& [kind, bytes] :
             {std::pair<const char*, uint64_t>{"budget", tier.budget_bytes},
              {"used", tier.used_bytes},
              {"pinned", tier.pinned_bytes},
              {"reserved", tier.reserved_bytes}}) {
          prometheus::ClientMetric metric;
          metric.label = {Label("device", tier.place), Label("kind", kind)};
          metric.gauge.value = static_cast<double>(bytes);
          tiers.metric.push_back(std::move(metric));
        }
      }
    }
    families.push_back(std::move(resident));
    families.push_back(std::move(tiers));
    return families;
  }

 private:
  mutable Mutex mutex_;
  const MapperStore* store_ ABSL_GUARDED_BY(mutex_) = nullptr;
  std::function<int64_t()> inflight_ ABSL_GUARDED_BY(mutex_);
};

// GET /metrics over HTTP/1.x on one listening socket: one connection at a time (Prometheus
// scrapes a target sequentially), each answered and closed; slow clients time out after 5 s.
class Metrics::HttpEndpoint {
 public:
  static absl::StatusOr<std::unique_ptr<HttpEndpoint>> Start(const std::string& address,
                                                             std::function<std::string()> body) {
    auto fail = [&](const std::string& why) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on metrics.listen_address='", address, "': ", why));
    };
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) return fail("expected host:port");
    std::string host = address.substr(0, colon);
    const std::string port = address.substr(colon + 1);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    if (const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints,
                                   &found);
        rc != 0) {
      return fail(gai_strerror(rc));
    }
    int fd = -1;
    std::string error = "no usable address";
    for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
      fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      const int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 16) != 0) {
        error = std::strerror(errno);
        close(fd);
        fd = -1;
      }
    }
    freeaddrinfo(found);
    if (fd < 0) return fail(error);
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
    const int bound_port =
        bound.ss_family == AF_INET6
            ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
            : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return std::unique_ptr<HttpEndpoint>(new HttpEndpoint(fd, bound_port, std::move(body)));
  }

  ~HttpEndpoint() {
    stop_.store(true);
    thread_.join();
    close(fd_);
  }

  int port() const { return port_; }

 private:
  HttpEndpoint(int fd, int port, std::function<std::string()> body)
      : fd_(fd), port_(port), body_(std::move(body)), thread_([this] { Serve(); }) {}

  void Serve() {
    while (!stop_.load()) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;  // wakes up to notice stop_
      const int connection = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) continue;
      Answer(connection);
      close(connection);
    }
  }

  void Answer(int connection) {
    timeval timeout{5, 0};
    setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    std::string request;
    char buffer[4096];
    while (request.find("\r\n\r\n") == std::string::npos && request.size() < 16384) {
      const ssize_t n = recv(connection, buffer, sizeof(buffer), 0);
      if (n <= 0) return;
      request.append(buffer, static_cast<size_t>(n));
    }
    const size_t line_end = request.find("\r\n");
    const std::string line = request.substr(0, line_end);
    std::string status = "200 OK", type = "text/plain; version=0.0.4; charset=utf-8", content;
    const bool get = absl::StartsWith(line, "GET "), head = absl::StartsWith(line, "HEAD ");
    const std::string target = line.substr(line.find(' ') + 1, line.rfind(' ') - line.find(' ') - 1);
    if (!get && !head) {
      status = "405 Method Not Allowed";
      type = "text/plain";
      content = "GET /metrics\n";
    } else if (target != "/metrics" && !absl::StartsWith(target, "/metrics?")) {
      status = "404 Not Found";
      type = "text/plain";
      content = "kvtd serves its metrics at /metrics\n";
    } else {
      content = body_();
    }
    std::string response = absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                                        "\r\nContent-Length: ", content.size(),
                                        "\r\nConnection: close\r\n\r\n");
    if (!head) response += content;
    size_t sent = 0;
    while (sent < response.size()) {
      const ssize_t n = send(connection, response.data() + sent, response.size() - sent,
                             MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<size_t>(n);
    }
  }

  const int fd_;
  const int port_;
  const std::function<std::string()> body_;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts once everything it reads is initialised
};

Metrics::Metrics(std::string device)
    : device_(std::move(device)),
      registry_(std::make_shared<prometheus::Registry>()),
      scrape_(std::make_shared<ScrapeCollector>()) {
  prometheus::Registry& r = *registry_;
  build_info_ = Keep(BuildGauge()
                         .Name("kvt_build_info")
                         .Help("Always 1; labels say which kvt build is running.")
                         .Register(r));
  build_info_->Add({{"version", kKvtdVersion}, {"compiler", __VERSION__}}).Set(1);
  backend_info_ = Keep(BuildGauge()
                           .Name("kvt_backend_info")
                           .Help("Always 1; the translation backend kvtd chose (backend.type is "
                                 "'requested').")
                           .Register(r));
  backend_self_check_ =
      Keep(BuildGauge()
               .Name("kvt_backend_self_check")
               .Help("Always 1; the start-up self-check of each backend kvtd tried "
                     "(result: pass, mismatch or error; a failed cuda under "
                     "backend.type auto means kvtd fell back to cpu).")
               .Register(r));
  cpu_gemm_path_ = Keep(BuildGauge()
                            .Name("kvt_cpu_gemm_path")
                            .Help("Always 1; the CPU backend's GEMM path for bf16/fp16 mappers "
                                  "(onednn_bf16 | sgemm), the ISA oneDNN dispatches, and "
                                  "backend.cpu_gemm as 'requested'. Absent on CUDA.")
                            .Register(r));
  cpu_gemm_probe_ =
      Keep(BuildGauge()
               .Name("kvt_cpu_gemm_probe_gflops")
               .Help("What backend.cpu_gemm: auto measured at start-up: single-threaded "
                     "GFLOP/s of each GEMM engine (onednn_bf16, sgemm) on the served "
                     "mappers' shapes. Absent when a path was forced.")
               .Register(r));
  requests_ = Keep(BuildCounter()
                       .Name("kvt_translate_requests_total")
                       .Help("TranslateKV calls by outcome (canonical gRPC code).")
                       .Register(r));
  duration_ =
      Keep(BuildHistogram()
               .Name("kvt_translate_duration_seconds")
               .Help("Successful TranslateKV wall time per stage (queue, stage_in, compute, "
                     "stage_out, total).")
               .Register(r));
  tokens_ = Keep(BuildCounter()
                     .Name("kvt_translate_tokens_total")
                     .Help("Tokens translated by successful TranslateKV calls.")
                     .Register(r));
  speedup_ =
      Keep(BuildHistogram()
               .Name("kvt_translate_speedup_ratio")
               .Help("Estimated target re-prefill time / translate total time (estimate from "
                     "the request or metrics.prefill_cost).")
               .Register(r));
  input_shift_ = Keep(BuildHistogram()
                          .Name("kvt_input_shift_score")
                          .Help("Mean standardised squared deviation of the source features from "
                                "the mapper's calibration statistics (about 1 in distribution).")
                          .Register(r));
  validate_requests_ = Keep(BuildCounter()
                                .Name("kvt_validate_requests_total")
                                .Help("ValidateKV calls by outcome (canonical gRPC code).")
                                .Register(r));
  validate_duration_ = Keep(BuildHistogram()
                                .Name("kvt_validate_duration_seconds")
                                .Help("Successful ValidateKV wall time.")
                                .Register(r));
  attention_cosine_ = Keep(BuildHistogram()
                               .Name("kvt_quality_attention_cosine")
                               .Help("ValidateKV attention-output cosine, mean over layers 1.. "
                                     "(SPEC 5), by conversation turn bucket.")
                               .Register(r));
  r2_ = Keep(BuildHistogram()
                 .Name("kvt_quality_r2")
                 .Help("ValidateKV R^2 of K (content space) and V, mean over layers 1.., by turn "
                       "bucket.")
                 .Register(r));
  kv_cosine_ =
      Keep(BuildHistogram()
               .Name("kvt_quality_kv_cosine")
               .Help("ValidateKV cosine of translated vs true K and V, mean over layers 1.., "
                     "by turn bucket.")
               .Register(r));
  error_concentration_ = Keep(BuildHistogram()
                                  .Name("kvt_quality_error_concentration")
                                  .Help("ValidateKV c_K / c_V (1 = isotropic error, > 1 where "
                                        "attention reads), mean over layers 1.., by turn bucket.")
                                  .Register(r));
  page_ins_ = Keep(BuildCounter()
                       .Name("kvt_mapper_page_ins_total")
                       .Help("Mapper copies into a tier: device=\"host\" loads from disk into "
                             "host memory, else copies onto that device.")
                       .Register(r));
  evictions_ = Keep(BuildCounter()
                        .Name("kvt_mapper_evictions_total")
                        .Help("Mappers dropped from a tier (host or device) to make room.")
                        .Register(r));
  page_in_duration_ = Keep(BuildHistogram()
                               .Name("kvt_mapper_page_in_duration_seconds")
                               .Help("Time of one page-in (host: read and verify from disk; "
                                     "device: until the last layer has arrived).")
                               .Register(r));
  acquisitions_ = Keep(BuildCounter()
                           .Name("kvt_mapper_acquisitions_total")
                           .Help("Requests acquiring a mapper in a tier; result=\"hit\" when it "
                                 "was resident (or paging in already), \"miss\" when the request "
                                 "caused the load or page-in.")
                           .Register(r));
  prefix_lookups_ = Keep(BuildCounter()
                             .Name("kvt_prefix_lookups_total")
                             .Help("LookupPrefix calls by target model and result (\"hit\" or the "
                                   "miss reason: no_prefix, no_mapper, gate, live_quality, "
                                   "verification_sample, forbidden, too_short).")
                             .Register(r));
  prefix_reused_tokens_ = Keep(BuildCounter()
                                   .Name("kvt_prefix_reused_tokens_total")
                                   .Help("Tokens of stored source prefixes leased for translation, "
                                         "by pair.")
                                   .Register(r));
  prefix_publishes_ = Keep(BuildCounter()
                               .Name("kvt_prefix_publishes_total")
                               .Help("Publish calls by model and result (stored, empty, or the "
                                     "error code).")
                               .Register(r));
  prefix_published_tokens_ = Keep(BuildCounter()
                                      .Name("kvt_prefix_published_tokens_total")
                                      .Help("Tokens stored by Publish (whole blocks), by model.")
                                      .Register(r));
  prefix_evictions_ = Keep(BuildCounter()
                               .Name("kvt_prefix_evictions_total")
                               .Help("Stored source caches dropped, by reason (lru, ttl, subsumed, "
                                     "admin).")
                               .Register(r));
  prefix_evicted_bytes_ = Keep(BuildCounter()
                                   .Name("kvt_prefix_evicted_bytes_total")
                                   .Help("Bytes of stored source caches dropped, by reason.")
                                   .Register(r));
  live_verifications_ =
      Keep(BuildCounter()
               .Name("kvt_live_verifications_total")
               .Help("Live verification samples by pair, mapper and result (pass, "
                     "fail, no_reference, expired, skipped).")
               .Register(r));
  live_quality_ = Keep(BuildGauge()
                           .Name("kvt_live_quality")
                           .Help("Mean K/V cosine of a mapper's last window of live verification "
                                 "samples (translated stored prefix against the target's own "
                                 "cache), by pair and mapper.")
                           .Register(r));
  out_of_service_ = Keep(BuildGauge()
                             .Name("kvt_mapper_out_of_service")
                             .Help("1 while live verification holds a mapper out of service (its "
                                   "live quality fell below the recorded kv_cosine_heldout minus "
                                   "the tolerance), by pair and mapper.")
                             .Register(r));
  prefix_bytes_ = Keep(BuildGauge()
                           .Name("kvt_prefix_cache_bytes")
                           .Help("Prefix cache host memory: kind=\"held\" (stored and reserved) "
                                 "and kind=\"budget\" (prefix_cache.max_bytes).")
                           .Register(r));
  prefix_entries_ = Keep(BuildGauge()
                             .Name("kvt_prefix_cache_entries")
                             .Help("Stored source caches (one per published sequence).")
                             .Register(r));
  digest_keys_ = Keep(BuildGauge()
                          .Name("kvt_prefix_digest_keys")
                          .Help("First blocks of stored prefixes in the published-prefix digest "
                                "that engines read before a lookup.")
                          .Register(r));
  digest_false_positives_ =
      Keep(BuildGauge()
               .Name("kvt_prefix_digest_false_positive_ratio")
               .Help("Estimated share of prompts with no stored prefix that the digest answers "
                     "\"maybe\" (each costs the engine a LookupPrefix): (non-zero counters / "
                     "prefix_cache.digest_slots) ^ 3.")
               .Register(r));
}

Metrics::~Metrics() {
  // The endpoint's thread reads the registry and the collector: stop it first.
  endpoint_.reset();
}

absl::Status Metrics::StartExposer(const std::string& listen_address) {
  if (listen_address.empty()) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<HttpEndpoint>> endpoint =
      HttpEndpoint::Start(listen_address, [this] { return Serialize(); });
  if (!endpoint.ok()) return endpoint.status();
  endpoint_ = std::move(*endpoint);
  port_ = endpoint_->port();
  return absl::OkStatus();
}

void Metrics::SetBackend(const std::string& backend, const std::string& device,
                         const std::string& requested) {
  backend_info_->Add({{"backend", backend}, {"device", device}, {"requested", requested}}).Set(1);
}

void Metrics::SetBackendSelfCheck(const std::string& backend, const std::string& device,
                                  const std::string& result) {
  backend_self_check_->Add({{"backend", backend}, {"device", device}, {"result", result}}).Set(1);
}

void Metrics::SetCpuGemmPath(const std::string& path, const std::string& isa,
                             const std::string& requested) {
  cpu_gemm_path_->Add({{"path", path}, {"isa", isa}, {"requested", requested}}).Set(1);
}

void Metrics::SetCpuGemmProbe(const std::string& engine, double gflops) {
  cpu_gemm_probe_->Add({{"engine", engine}}).Set(gflops);
}

void Metrics::SetScrapeSources(const MapperStore* store,
                               std::function<int64_t()> inflight_requests) {
  scrape_->Set(store, std::move(inflight_requests));
  if (store == nullptr) return;
  // Zero-valued series for every servable pair, so rate() and the alerts see a series before
  // the first event (an absent series is not a zero rate).
  for (const MapperInfo& info : store->List()) {
    if (info.state == MapperState::kFailed) continue;
    const std::string& source = info.source_model;
    const std::string& target = info.target_model;
    requests_->Add({{"source", source}, {"target", target}, {"code", CodeLabel(absl::StatusCode::kOk)}});
    tokens_->Add({{"source", source}, {"target", target}});
    for (const std::string& device : {std::string("host"), device_}) {
      page_ins_->Add({{"source", source}, {"target", target}, {"device", device}});
      evictions_->Add({{"source", source}, {"target", target}, {"device", device}});
      for (const char* result : {"hit", "miss"}) {
        acquisitions_->Add(
            {{"source", source}, {"target", target}, {"device", device}, {"result", result}});
      }
    }
  }
}

std::string Metrics::CodeLabel(absl::StatusCode code) { return absl::StatusCodeToString(code); }

std::string Metrics::TurnBucket(uint32_t turn) {
  if (turn < 10) return absl::StrCat(turn);
  if (turn < 20) return "10-19";
  return "20+";
}

void Metrics::RecordTranslate(const TranslateRecord& record) {
  const std::string& source = record.pair.source();
  const std::string& target = record.pair.target();
  requests_->Add({{"source", source}, {"target", target}, {"code", CodeLabel(record.code)}})
      .Increment();
  if (record.code != absl::StatusCode::kOk) return;
  const std::pair<const char*, double> stages[] = {{"queue", record.queue_s},
                                                   {"stage_in", record.stage_in_s},
                                                   {"compute", record.compute_s},
                                                   {"stage_out", record.stage_out_s},
                                                   {"total", record.total_s}};
  for (const auto& [stage, seconds] : stages) {
    duration_
        ->Add({{"source", source}, {"target", target}, {"device", device_}, {"stage", stage}},
              LatencyBuckets())
        .Observe(seconds);
  }
  tokens_->Add({{"source", source}, {"target", target}}).Increment(static_cast<double>(record.tokens));
  if (record.speedup.has_value()) {
    speedup_->Add({{"source", source}, {"target", target}, {"device", device_}}, SpeedupBuckets())
        .Observe(*record.speedup);
  }
  if (record.input_shift.has_value()) {
    input_shift_->Add({{"source", source}, {"target", target}}, InputShiftBuckets())
        .Observe(*record.input_shift);
  }
}

void Metrics::RecordValidate(const ValidateRecord& record) {
  const std::string& source = record.pair.source();
  const std::string& target = record.pair.target();
  validate_requests_
      ->Add({{"source", source}, {"target", target}, {"code", CodeLabel(record.code)}})
      .Increment();
  if (record.code != absl::StatusCode::kOk) return;
  validate_duration_->Add({{"source", source}, {"target", target}, {"device", device_}},
                          LatencyBuckets())
      .Observe(record.total_s);
  if (!record.has_quality) return;
  const std::string turn = TurnBucket(record.turn);
  auto kind_labels = [&](const char* kind) -> prometheus::Labels {
    return {{"source", source}, {"target", target}, {"kind", kind}, {"turn", turn}};
  };
  r2_->Add(kind_labels("k"), R2Buckets()).Observe(record.r2_k);
  r2_->Add(kind_labels("v"), R2Buckets()).Observe(record.r2_v);
  kv_cosine_->Add(kind_labels("k"), CosineBuckets()).Observe(record.cosine_k);
  kv_cosine_->Add(kind_labels("v"), CosineBuckets()).Observe(record.cosine_v);
  if (record.attention_cosine.has_value()) {
    attention_cosine_->Add({{"source", source}, {"target", target}, {"turn", turn}},
                           CosineBuckets())
        .Observe(*record.attention_cosine);
  }
  if (record.c_k.has_value()) {
    error_concentration_->Add(kind_labels("k"), ConcentrationBuckets()).Observe(*record.c_k);
  }
  if (record.c_v.has_value()) {
    error_concentration_->Add(kind_labels("v"), ConcentrationBuckets()).Observe(*record.c_v);
  }
}

void Metrics::RecordPageIn(const PairLabels& pair, const std::string& device, double seconds) {
  page_ins_->Add({{"source", pair.source()}, {"target", pair.target()}, {"device", device}})
      .Increment();
  page_in_duration_
      ->Add({{"source", pair.source()}, {"target", pair.target()}, {"device", device}},
            LatencyBuckets())
      .Observe(seconds);
}

void Metrics::RecordMapperAccess(const PairLabels& pair, const std::string& device, bool hit) {
  acquisitions_
      ->Add({{"source", pair.source()},
             {"target", pair.target()},
             {"device", device},
             {"result", hit ? "hit" : "miss"}})
      .Increment();
}

void Metrics::RecordPrefixLookup(const std::string& target, const std::string& result) {
  prefix_lookups_->Add({{"target", target}, {"result", result}}).Increment();
}

void Metrics::RecordPrefixReuse(const PairLabels& pair, int64_t tokens) {
  prefix_reused_tokens_->Add({{"source", pair.source()}, {"target", pair.target()}})
      .Increment(static_cast<double>(tokens));
}

void Metrics::RecordPrefixPublish(const std::string& model, const std::string& result,
                                  int64_t tokens) {
  prefix_publishes_->Add({{"model", model}, {"result", result}}).Increment();
  if (tokens > 0) {
    prefix_published_tokens_->Add({{"model", model}}).Increment(static_cast<double>(tokens));
  }
}

void Metrics::RecordPrefixEviction(const std::string& reason, int64_t bytes) {
  prefix_evictions_->Add({{"reason", reason}}).Increment();
  prefix_evicted_bytes_->Add({{"reason", reason}}).Increment(static_cast<double>(bytes));
}

void Metrics::RecordLiveVerification(const PairLabels& pair, const std::string& mapper,
                                     const std::string& result) {
  live_verifications_
      ->Add({{"source", pair.source()}, {"target", pair.target()}, {"mapper", mapper},
             {"result", result}})
      .Increment();
}

void Metrics::SetLiveQuality(const PairLabels& pair, const std::string& mapper, double value) {
  live_quality_->Add({{"source", pair.source()}, {"target", pair.target()}, {"mapper", mapper}})
      .Set(value);
}

void Metrics::SetMapperOutOfService(const PairLabels& pair, const std::string& mapper,
                                    bool out) {
  out_of_service_
      ->Add({{"source", pair.source()}, {"target", pair.target()}, {"mapper", mapper}})
      .Set(out ? 1 : 0);
}

void Metrics::SetPrefixCacheUsage(int64_t bytes_held, int64_t max_bytes, int64_t entries) {
  prefix_bytes_->Add({{"kind", "held"}}).Set(static_cast<double>(bytes_held));
  prefix_bytes_->Add({{"kind", "budget"}}).Set(static_cast<double>(max_bytes));
  prefix_entries_->Add({}).Set(static_cast<double>(entries));
}

void Metrics::SetPrefixDigestUsage(int64_t keys, double false_positive_rate) {
  digest_keys_->Add({}).Set(static_cast<double>(keys));
  digest_false_positives_->Add({}).Set(false_positive_rate);
}

void Metrics::RecordEviction(const PairLabels& pair, const std::string& device) {
  evictions_->Add({{"source", pair.source()}, {"target", pair.target()}, {"device", device}})
      .Increment();
}

std::vector<std::string> Metrics::FamilyNames() const {
  std::vector<std::string> names = family_names_;
  for (const prometheus::MetricFamily& family : scrape_->Collect()) names.push_back(family.name);
  return names;
}

std::string Metrics::Serialize() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<prometheus::MetricFamily> scraped = scrape_->Collect();
  families.insert(families.end(), scraped.begin(), scraped.end());
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, families);
  return out.str();
}

}  // namespace kvt
