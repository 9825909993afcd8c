// kvtd: the KV translation daemon. Loads kvtd.yaml, applies flag overrides, loads the mapper
// store, serves kvt.v1.KvTranslator until SIGTERM/SIGINT, then drains and exits 0.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/allocator.h"
#include "common/logging.h"
#include "mapper_store/store.h"
#include "server/mapper_store_setup.h"
#include "server/backend_select.h"
#include "server/config.h"
#include "server/kvtd_server.h"

ABSL_FLAG(std::string, config, "",
          "Path of kvtd.yaml (every key documented in server/kvtd.yaml). Empty: defaults.");
ABSL_FLAG(std::string, listen_address, "",
          "Overrides server.listen_address (host:port; port 0 = any free port, logged).");
ABSL_FLAG(std::string, unix_socket, "", "Overrides server.unix_socket (extra listener).");
ABSL_FLAG(std::string, mapper_store, "", "Overrides mapper_store.path.");
ABSL_FLAG(std::string, backend, "", "Overrides backend.type: auto | cpu | cuda.");
ABSL_FLAG(std::string, cpu_gemm, "", "Overrides backend.cpu_gemm: auto | bf16 | fp32.");
ABSL_FLAG(int64_t, cpu_threads, -1, "Overrides backend.cpu_threads (0 = all cores).");
ABSL_FLAG(int64_t, max_tokens, -1, "Overrides limits.max_tokens.");
ABSL_FLAG(int64_t, max_inflight_requests, -1, "Overrides limits.max_inflight_requests.");
ABSL_FLAG(bool, allow_non_finite, false,
          "Sets limits.allow_non_finite: accept NaN and Inf in published and translated caches.");
ABSL_FLAG(double, drain_grace_seconds, -1, "Overrides shutdown.drain_grace_seconds.");
ABSL_FLAG(double, shutdown_deadline_seconds, -1, "Overrides shutdown.deadline_seconds.");
ABSL_FLAG(std::string, tls_cert_file, "", "Overrides security.tls_cert_file (PEM, enables TLS).");
ABSL_FLAG(std::string, tls_key_file, "", "Overrides security.tls_key_file (PEM).");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "Overrides security.tls_client_ca_file (PEM CA; enables mTLS).");
ABSL_FLAG(std::string, auth_token_file, "",
          "Overrides security.auth_token_file (\"TOKEN ROLE\" lines; enables bearer auth).");
ABSL_FLAG(bool, self_check, false,
          "Only run the backend selection with its start-up self-checks (backend.type decides "
          "which engines), print one line per check to stdout and exit: 0 when every check that "
          "ran passed, 1 when one failed, 2 when the selection itself failed (forced cuda).");
ABSL_FLAG(std::string, log_level, "", "Overrides logging.level: debug | info | warning | error.");
ABSL_FLAG(std::string, metrics_listen_address, "",
          "Overrides metrics.listen_address: the Prometheus /metrics endpoint, host:port (port 0 "
          "= any free port, logged in the 'metrics listening' line).");

namespace kvt {
namespace {

int Fatal(const absl::Status& status) {
  KVT_LOG(kError, "kvtd cannot start").With("error", status.ToString());
  std::fprintf(stderr, "kvtd: %s\n", std::string(status.message()).c_str());
  return 2;
}

absl::StatusOr<KvtdConfig> BuildConfig() {
  KvtdConfig config;
  const std::string path = absl::GetFlag(FLAGS_config);
  if (!path.empty()) {
    absl::StatusOr<KvtdConfig> loaded = LoadKvtdConfigFile(path);
    if (!loaded.ok()) return loaded.status();
    config = *loaded;
  }
  auto override_string = [](const absl::Flag<std::string>& flag, std::string* value) {
    const std::string flag_value = absl::GetFlag(flag);
    if (!flag_value.empty()) *value = flag_value;
  };
  override_string(FLAGS_listen_address, &config.server.listen_address);
  override_string(FLAGS_unix_socket, &config.server.unix_socket);
  override_string(FLAGS_mapper_store, &config.mapper_store.path);
  override_string(FLAGS_backend, &config.backend.type);
  override_string(FLAGS_cpu_gemm, &config.backend.cpu_gemm);
  override_string(FLAGS_tls_cert_file, &config.security.tls_cert_file);
  override_string(FLAGS_tls_key_file, &config.security.tls_key_file);
  override_string(FLAGS_tls_client_ca_file, &config.security.tls_client_ca_file);
  override_string(FLAGS_auth_token_file, &config.security.auth_token_file);
  override_string(FLAGS_metrics_listen_address, &config.metrics.listen_address);
  if (absl::GetFlag(FLAGS_cpu_threads) >= 0) {
    config.backend.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  }
  if (absl::GetFlag(FLAGS_max_tokens) >= 0) config.limits.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (absl::GetFlag(FLAGS_allow_non_finite)) config.limits.allow_non_finite = true;
  if (absl::GetFlag(FLAGS_max_inflight_requests) >= 0) {
    config.limits.max_inflight_requests = absl::GetFlag(FLAGS_max_inflight_requests);
  }
  if (absl::GetFlag(FLAGS_drain_grace_seconds) >= 0) {
    config.shutdown.drain_grace_seconds = absl::GetFlag(FLAGS_drain_grace_seconds);
  }
  if (absl::GetFlag(FLAGS_shutdown_deadline_seconds) >= 0) {
    config.shutdown.deadline_seconds = absl::GetFlag(FLAGS_shutdown_deadline_seconds);
  }
  const std::string level = absl::GetFlag(FLAGS_log_level);
  if (!level.empty() && !ParseLogLevel(level, &config.logging.level)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level=", level, " must be debug, info, warning or error"));
  }
  absl::Status valid = ValidateKvtdConfig(config);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("after flag overrides: ", valid.message()));
  }
  return config;
}

// The thread that sigwaits for SIGTERM / SIGINT (Run's).
pthread_t g_signal_thread;

// Threads a library started before Run blocked the signals (a BLAS pool at load time) may be
// the one the kernel hands a process-directed SIGINT to, whose default action ends the process
// before it drains (seen under ASan). Such a thread runs this instead and passes the signal on
// to the sigwaiting thread, where it is pending (pthread_kill is async-signal-safe).
void ForwardToSignalThread(int signal_number) { pthread_kill(g_signal_thread, signal_number); }

int Run() {
  TuneAllocatorForCacheTraffic();
  absl::StatusOr<KvtdConfig> config = BuildConfig();
  if (!config.ok()) return Fatal(config.status());
  SetMinLogLevel(config->logging.level);

  // Signals are taken synchronously by sigwait below; every thread created from here on
  // inherits the blocked mask, so none of them is interrupted by SIGTERM; threads that existed
  // before get ForwardToSignalThread.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  g_signal_thread = pthread_self();
  struct sigaction forward = {};
  forward.sa_handler = ForwardToSignalThread;
  sigemptyset(&forward.sa_mask);
  sigaction(SIGTERM, &forward, nullptr);
  sigaction(SIGINT, &forward, nullptr);

  // Self-checks every engine it tries (server/backend_self_check.h): a CPU failure or a failed
  // forced cuda is an error here; auto falls back to CPU with a warning.
  absl::StatusOr<SelectedBackend> backend = SelectBackend(config->backend);
  if (!backend.ok()) return Fatal(backend.status());
  KVT_LOG(kInfo, "backend")
      .With("backend", backend->backend->name())
      .With("device", backend->backend->device())
      .With("reason", backend->reason)
      .With("description", backend->backend->description());
  if (!backend->cpu_gemm_path.empty()) {
    KVT_LOG(kInfo, "cpu_gemm")
        .With("path", backend->cpu_gemm_path)
        .With("isa", backend->cpu_isa)
        .With("requested", config->backend.cpu_gemm)
        .With("reason", backend->cpu_gemm_reason);
  }

  // Every further GPU is one more device of the mapper store: a mapper is paged onto the one
  // with room and the least load, and requests compute where their mapper is.
  std::vector<std::unique_ptr<Backend>> more_gpus =
      MoreGpuBackends(*backend->backend, &backend->self_checks);
  if (absl::GetFlag(FLAGS_self_check)) {
    bool all_passed = true;
    for (const SelfCheckReport& report : backend->self_checks) {
      std::printf("%s\n", report.Summary().c_str());
      all_passed = all_passed && report.passed();
    }
    std::printf("serving backend: %s (%s)\n", backend->backend->device().c_str(),
                backend->reason.c_str());
    return all_passed ? 0 : 1;
  }
  std::vector<Backend*> devices = {backend->backend.get()};
  for (const auto& gpu : more_gpus) {
    devices.push_back(gpu.get());
    KVT_LOG(kInfo, "backend").With("backend", gpu->name()).With("device", gpu->device());
  }
  absl::StatusOr<std::unique_ptr<MapperStore>> store =
      MapperStore::Open(config->mapper_store.path, MakeStoreOptions(*config, devices));
  if (!store.ok()) return Fatal(store.status());
  if (absl::Status preloaded = PreloadMappers(store->get(), config->mapper_store.preload,
                                              absl::InfiniteFuture());
      !preloaded.ok()) {
    return Fatal(preloaded);
  }
  if (config->mapper_store.reload_interval_seconds > 0) {
    (*store)->StartPolling(absl::Seconds(config->mapper_store.reload_interval_seconds));
  }
  for (const TierUsage& tier : (*store)->Usage()) {
    KVT_LOG(kInfo, "mapper budget")
        .With("place", tier.place)
        .With("budget_bytes", tier.budget_bytes)
        .With("used_bytes", tier.used_bytes);
  }
  for (const MapperInfo& info : (*store)->List()) {
    const bool failed = info.state == MapperState::kFailed;
    LogLine(failed ? LogLevel::kWarning : LogLevel::kInfo, "mapper")
        .With("mapper", info.id)
        .With("source", info.source_model)
        .With("target", info.target_model)
        .With("state", MapperStateName(info.state))
        .With("reason", info.state_reason)
        .With("bytes", info.weight_bytes);
  }

  absl::StatusOr<std::unique_ptr<KvtdServer>> server =
      KvtdServer::Start(*config, store->get(), backend->backend.get());
  if (!server.ok()) return Fatal(server.status());
  ExportSelfChecks(backend->self_checks, (*server)->metrics());
  if (!backend->cpu_gemm_path.empty()) {
    (*server)->metrics()->SetCpuGemmPath(backend->cpu_gemm_path, backend->cpu_isa,
                                         config->backend.cpu_gemm);
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  KVT_LOG(kInfo, "signal received").With("signal", signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  (*server)->Shutdown();
  return 0;
}

}  // namespace
}  // namespace kvt

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "translates the KV cache of one LLM into the KV cache of another model of the same "
      "family over gRPC (kvt.v1.KvTranslator), so the receiving model skips prefill.\n\n"
      "  kvtd --config=/etc/kvt/kvtd.yaml\n"
      "  kvtd --mapper_store=demo/mappers --listen_address=127.0.0.1:0\n\n"
      "Configuration comes from the YAML file (see server/kvtd.yaml for every key); the flags "
      "below override it. Logs are JSON lines on stderr; the 'listening' line gives the port. "
      "SIGTERM/SIGINT: health turns NOT_SERVING, in-flight requests finish within "
      "shutdown.deadline_seconds, exit 0.");
  absl::ParseCommandLine(argc, argv);
  return kvt::Run();
}
