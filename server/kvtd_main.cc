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
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/allocator.h"
#include "common/logging.h"
#include "kernels/blas_core.h"
#include "mapper_store/store.h"
#include "server/mapper_store_setup.h"
#include "server/backend_select.h"
#include "server/config.h"
#include "server/config_flags.h"
#include "server/kvtd_server.h"

ABSL_FLAG(std::string, config, "",
          "Path of kvtd.yaml (every key documented in server/kvtd.yaml). Empty: defaults.");
ABSL_FLAG(bool, self_check, false,
          "Only run the backend selection with its start-up self-checks (backend.type decides "
          "which engines), print one line per check to stdout and exit: 0 when every check that "
          "ran passed, 1 when one failed, 2 when the selection itself failed (forced cuda).");
// The flags that override kvtd.yaml keys (--listen_address, --backend, ...) are defined with the
// keys' schema, in server/config_flags.cc.

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
  absl::Status overridden = ApplyKvtdFlagOverrides(&config);
  if (!overridden.ok()) return overridden;
  return config;
}

// The thread that sigwaits for SIGTERM / SIGINT (Run's).
pthread_t g_signal_thread;

// Threads a library started before Run blocked the signals (a BLAS pool at load time) may be
// the one the kernel hands a process-directed SIGINT to, whose default action ends the process
// before it drains (seen under ASan). Such a thread runs this instead and passes the signal on
// to the sigwaiting thread, where it is pending (pthread_kill is async-signal-safe).
void ForwardToSignalThread(int signal_number) { pthread_kill(g_signal_thread, signal_number); }

// `blas_restart`: what RestartWithBestBlasCore returned at the top of main.
int Run(const absl::Status& blas_restart) {
  TuneAllocatorForCacheTraffic();
  absl::StatusOr<KvtdConfig> config = BuildConfig();
  if (!config.ok()) return Fatal(config.status());
  SetMinLogLevel(config->logging.level);
  const BlasCoreState blas = CurrentBlasCore();
  // The OpenBLAS core serving sgemm; `picked` (OpenBLAS's own) differs only after a restart.
  LogLine(blas_restart.ok() ? LogLevel::kInfo : LogLevel::kWarning, "blas core")
      .With("core", blas.core)
      .With("picked", blas.restarted() ? blas.picked : blas.core)
      .With("openblas_coretype", blas.forced)
      .With("cpu", blas.cpu)
      .With("reason", blas_restart.ok()
                          ? blas.Summary()
                          : absl::StrCat("restart failed: ", blas_restart.ToString()));

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
  absl::StatusOr<SelectedBackend> backend =
      SelectBackend(config->backend, {}, ServedGemmShapes(config->mapper_store.path));
  if (!backend.ok()) return Fatal(backend.status());
  KVT_LOG(kInfo, "backend")
      .With("backend", backend->backend->name())
      .With("device", backend->backend->device())
      .With("reason", backend->reason)
      .With("description", backend->backend->description());
  if (!backend->cpu_gemm_path.empty()) {
    KVT_LOG(kInfo, "cpu_gemm")
        .With("path", backend->cpu_gemm_path)
        .With("fp32_path", backend->cpu_fp32_gemm_path)
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
    if (const std::optional<GemmProbeResult>& probe = backend->cpu_gemm_probe) {
      for (int e = 0; e < kNumGemmEngines; ++e) {
        if (!probe->engines[e].available) continue;
        (*server)->metrics()->SetCpuGemmProbe(GemmEngineName(static_cast<GemmEngine>(e)),
                                              probe->engines[e].gflops);
      }
    }
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
  // First, before anything starts threads: sgemm (fp32 mappers, the GEMM probe) runs the kernels
  // OpenBLAS picked when it loaded; restart once with better ones if it picked weak ones
  // (kernels/blas_core.h). Returns only when no restart happened or it failed.
  const absl::Status blas_restart = kvt::RestartWithBestBlasCore(argv);
  absl::SetProgramUsageMessage(
      "translates the KV cache of one LLM into the KV cache of another model of the same "
      "family over gRPC (kvt.v1.KvTranslator), so the receiving model skips prefill.\n\n"
      "  kvtd --config=/etc/kvt/kvtd.yaml\n"
      "  kvtd --mapper_store=demo/mappers --listen_address=127.0.0.1:0\n\n"
      "Configuration comes from the YAML file (see server/kvtd.yaml for every key); the flags "
      "below override it. Logs are JSON lines on stderr; the 'listening' line gives the port. "
      "SIGTERM/SIGINT: health turns NOT_SERVING, in-flight requests finish within "
      "shutdown.deadline_seconds, exit 0.");
  // --help lists only the flags of the program's own file unless told otherwise; the overrides
  // of kvtd.yaml keys live with the config schema in server/config_flags.cc.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/kvtd_main.cc") ||
           absl::EndsWith(file, "server/config_flags.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  return kvt::Run(blas_restart);
}
