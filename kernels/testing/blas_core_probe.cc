// Test binary of kernels/blas_core_e2e_test: `blas_core_probe auto ARGS...` runs the start-up
// check as kvt and kvtd do; `blas_core_probe force:CORE ARGS...` re-execs once with CORE. Each
// start prints a "start" line to stderr; the final process prints its state to stdout.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "kernels/blas_core.h"

int main(int argc, char** argv) {
  const char* marker = std::getenv(kvt::kBlasCoreRestartedEnv);
  std::fprintf(stderr, "start core=%s marker=%s\n", kvt::OpenblasCoreName().c_str(),
               marker == nullptr ? "-" : marker);
  std::fflush(stderr);
  if (argc < 2) return 2;
  const std::string mode = argv[1];
  absl::Status status;
  if (mode == "auto") {
    status = kvt::RestartWithBestBlasCore(argv);
  } else if (mode.rfind("force:", 0) == 0) {
    if (marker == nullptr) {
      status = kvt::ReexecWithBlasCore(mode.substr(6), kvt::OpenblasCoreName(), argv);
      if (status.ok()) status = absl::InternalError("ReexecWithBlasCore returned");
    }
  } else {
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str());
    return 3;
  }
  const kvt::BlasCoreState state = kvt::CurrentBlasCore();
  std::printf("core=%s\npicked=%s\nforced=%s\n", state.core.c_str(), state.picked.c_str(),
              state.forced.c_str());
  std::printf("argc=%d\n", argc);
  for (int i = 1; i < argc; ++i) std::printf("arg[%d]=%s\n", i, argv[i]);
  std::printf("summary=%s\n", state.Summary().c_str());
  return 0;
}
