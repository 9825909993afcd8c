// Restarts a BLAS-heavy binary once when OpenBLAS picked weaker kernels than the CPU runs.
#pragma once

// Debian 12's OpenBLAS 0.3.21 chooses its kernels ("core") once, in its library constructor,
// from the CPU model; a CPU it does not know (Intel Emerald Rapids, family 6 model 207) gets
// "Prescott" SSE3 kernels, ~7x below the hardware. OPENBLAS_CORETYPE, read in that same
// constructor, overrides the choice and there is no API to change it later, so the fix is a
// re-exec at the top of main with OPENBLAS_CORETYPE set to the best core the CPU runs.
//
// Environment:
//   OPENBLAS_CORETYPE        set by the user: always respected, no re-exec.
//   KVT_BLAS_CORE_CHECK=off  never re-exec (also 0, false, no).
//   KVT_BLAS_CORE_RESTARTED  set by the re-exec to the core OpenBLAS had picked; a process that
//                            has it never re-execs again (no loop).

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvt {

inline constexpr char kOpenblasCoretypeEnv[] = "OPENBLAS_CORETYPE";
inline constexpr char kBlasCoreCheckEnv[] = "KVT_BLAS_CORE_CHECK";
inline constexpr char kBlasCoreRestartedEnv[] = "KVT_BLAS_CORE_RESTARTED";

// What the CPU (and the OS's saved register state) supports, as far as OpenBLAS's x86-64
// kernels care.
struct CpuBlasFeatures {
  bool amd = false;  // AMD or Hygon: the AVX2 core is "Zen" rather than "Haswell"
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool avx512f = false;
  bool avx512vl = false;
  bool avx512bw = false;
  bool avx512dq = false;
  bool avx512cd = false;
  bool avx512_bf16 = false;
};

// From __builtin_cpu_supports / __builtin_cpu_is (libgcc also checks XCR0 for AVX/AVX-512).
CpuBlasFeatures DetectCpuBlasFeatures();

// "AVX-512 BF16", "AVX-512", "AVX2", "AVX" or "SSE": the CPU's best level, for messages.
std::string CpuBlasLevelName(const CpuBlasFeatures& cpu);

// The environment variables above; nullopt where unset.
struct BlasCoreEnv {
  std::optional<std::string> openblas_coretype;
  std::optional<std::string> check;
  std::optional<std::string> restarted;
};
BlasCoreEnv ReadBlasCoreEnv();

// Kernel level of an OpenBLAS x86-64 core name (case-insensitive): 0 SSE-era (Prescott, Core2,
// Nehalem, "Unknown", ...), 1 AVX (Sandybridge, Bulldozer, ...), 2 AVX2 (Haswell, Zen,
// Excavator), 3 AVX-512 (SkylakeX, Cooperlake, SapphireRapids). nullopt: a name this table
// does not know (a newer OpenBLAS, another architecture): never replaced.
std::optional<int> BlasCoreLevel(absl::string_view core);

// The best core for `cpu` that OpenBLAS 0.3.21 accepts in OPENBLAS_CORETYPE: "SkylakeX" with
// AVX-512 F/VL/BW/DQ/CD ("Cooperlake" is not accepted by 0.3.21's override and its sgemm/dgemm/
// dsyrk are SkylakeX's), "Zen" (AMD) or "Haswell" with AVX2 and FMA, "Sandybridge" with AVX;
// empty below AVX.
std::string BestBlasCore(const CpuBlasFeatures& cpu);

struct BlasCoreDecision {
  std::string force;   // the core to restart with; empty: keep OpenBLAS's pick
  std::string reason;  // why, for logs and tests
};

// Pure: the core to force, given what OpenBLAS picked, whether it is a DYNAMIC_ARCH build (only
// those read OPENBLAS_CORETYPE), the CPU and the environment. Never a core of the same or a
// lower level than the one picked.
BlasCoreDecision DecideBlasCore(absl::string_view picked, bool dynamic_arch,
                                const CpuBlasFeatures& cpu, const BlasCoreEnv& env);

// openblas_get_corename(), and whether openblas_get_config() names DYNAMIC_ARCH.
std::string OpenblasCoreName();
bool OpenblasDynamicArch();

// Replaces the process by /proc/self/exe with the same argv (argv[argc] == nullptr, as main's)
// and the environment plus OPENBLAS_CORETYPE=`core` and KVT_BLAS_CORE_RESTARTED=`picked`.
// Returns only when exec failed (the environment is restored).
absl::Status ReexecWithBlasCore(absl::string_view core, absl::string_view picked, char** argv);

// The first statement of main (before anything starts threads of its own): DecideBlasCore on
// this process and, when it says so, ReexecWithBlasCore. Returns OK when no re-exec was needed,
// the exec's error when one failed (the process then goes on with OpenBLAS's pick).
absl::Status RestartWithBestBlasCore(char** argv);

// The core this process runs and how it came to be, for the start-up log.
struct BlasCoreState {
  std::string core;    // openblas_get_corename() now
  std::string picked;  // OpenBLAS's own pick before a re-exec; empty: no re-exec happened
  std::string forced;  // OPENBLAS_CORETYPE as this process saw it; empty: unset
  std::string cpu;     // CpuBlasLevelName

  bool restarted() const { return !picked.empty(); }
  // One line: "OpenBLAS core SkylakeX: OpenBLAS picked Prescott on a CPU with AVX-512;
  // restarted with OPENBLAS_CORETYPE=SkylakeX (KVT_BLAS_CORE_CHECK=off keeps OpenBLAS's pick)",
  // "OpenBLAS core Prescott: OPENBLAS_CORETYPE=Prescott from the environment",
  // "OpenBLAS core Cooperlake: OpenBLAS's own pick".
  std::string Summary() const;
};
BlasCoreState CurrentBlasCore();

}  // namespace kvt
