#include "kernels/blas_core.h"

#include <cblas.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvt {
namespace {

std::optional<std::string> GetEnv(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

bool IsOff(const std::string& value) {
  const std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(value));
  return v == "off" || v == "0" || v == "false" || v == "no";
}

// Restores (or removes) an environment variable when the exec it was set for failed.
void RestoreEnv(const char* name, const std::optional<std::string>& value) {
  if (value.has_value()) {
    setenv(name, value->c_str(), 1);
  } else {
    unsetenv(name);
  }
}

// What OpenBLAS's AVX-512 (SkylakeX) kernels need.
bool HasBlasAvx512(const CpuBlasFeatures& cpu) {
  return cpu.avx512f && cpu.avx512vl && cpu.avx512bw && cpu.avx512dq && cpu.avx512cd;
}

}  // namespace

CpuBlasFeatures DetectCpuBlasFeatures() {
  __builtin_cpu_init();
  CpuBlasFeatures cpu;
  cpu.amd = __builtin_cpu_is("amd");
  cpu.avx = __builtin_cpu_supports("avx");
  cpu.avx2 = __builtin_cpu_supports("avx2");
  cpu.fma = __builtin_cpu_supports("fma");
  cpu.avx512f = __builtin_cpu_supports("avx512f");
  cpu.avx512vl = __builtin_cpu_supports("avx512vl");
  cpu.avx512bw = __builtin_cpu_supports("avx512bw");
  cpu.avx512dq = __builtin_cpu_supports("avx512dq");
  cpu.avx512cd = __builtin_cpu_supports("avx512cd");
  cpu.avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  return cpu;
}

std::string CpuBlasLevelName(const CpuBlasFeatures& cpu) {
  if (HasBlasAvx512(cpu)) return cpu.avx512_bf16 ? "AVX-512 BF16" : "AVX-512";
  if (cpu.avx2 && cpu.fma) return "AVX2";
  if (cpu.avx) return "AVX";
  return "SSE";
}

BlasCoreEnv ReadBlasCoreEnv() {
  BlasCoreEnv env;
  env.openblas_coretype = GetEnv(kOpenblasCoretypeEnv);
  env.check = GetEnv(kBlasCoreCheckEnv);
  env.restarted = GetEnv(kBlasCoreRestartedEnv);
  return env;
}

std::optional<int> BlasCoreLevel(absl::string_view core) {
  // OpenBLAS 0.3.21's x86-64 names (driver/others/dynamic.c), plus the AVX-512 names of later
  // releases so that a newer library's pick is never taken for a weak one.
  static constexpr struct {
    const char* name;
    int level;
  } kCores[] = {
      {"Unknown", 0},    {"Katmai", 0},       {"Coppermine", 0},
      {"Northwood", 0},  {"Prescott", 0},     {"Banias", 0},
      {"Atom", 0},       {"Core2", 0},        {"Penryn", 0},
      {"Dunnington", 0}, {"Nehalem", 0},      {"Athlon", 0},
      {"Opteron", 0},    {"Opteron_SSE3", 0}, {"Barcelona", 0},
      {"Nano", 0},       {"Bobcat", 0},       {"Sandybridge", 1},
      {"Bulldozer", 1},  {"Piledriver", 1},   {"Steamroller", 1},
      {"Haswell", 2},    {"Zen", 2},          {"Excavator", 2},
      {"SkylakeX", 3},   {"Cooperlake", 3},   {"SapphireRapids", 3},
  };
  for (const auto& entry : kCores) {
    if (absl::EqualsIgnoreCase(core, entry.name)) return entry.level;
  }
  return std::nullopt;
}

std::string BestBlasCore(const CpuBlasFeatures& cpu) {
  if (HasBlasAvx512(cpu)) return "SkylakeX";
  if (cpu.avx2 && cpu.fma) return cpu.amd ? "Zen" : "Haswell";
  if (cpu.avx) return "Sandybridge";
  return "";
}

BlasCoreDecision DecideBlasCore(absl::string_view picked, bool dynamic_arch,
                                const CpuBlasFeatures& cpu, const BlasCoreEnv& env) {
  BlasCoreDecision decision;
  if (env.check.has_value() && IsOff(*env.check)) {
    decision.reason = absl::StrCat(kBlasCoreCheckEnv, "=", *env.check, ": OpenBLAS's pick kept");
    return decision;
  }
  if (env.restarted.has_value()) {
    decision.reason =
        absl::StrCat("already restarted once (", kBlasCoreRestartedEnv, "=", *env.restarted, ")");
    return decision;
  }
  if (env.openblas_coretype.has_value() && !env.openblas_coretype->empty()) {
    decision.reason =
        absl::StrCat(kOpenblasCoretypeEnv, "=", *env.openblas_coretype, " from the environment");
    return decision;
  }
  if (!dynamic_arch) {
    decision.reason = "not a DYNAMIC_ARCH OpenBLAS: OPENBLAS_CORETYPE would be ignored";
    return decision;
  }
  const std::optional<int> picked_level = BlasCoreLevel(picked);
  if (!picked_level.has_value()) {
    decision.reason = absl::StrCat("core '", picked, "' not known here: kept");
    return decision;
  }
  const std::string best = BestBlasCore(cpu);
  if (best.empty() || *BlasCoreLevel(best) <= *picked_level) {
    decision.reason = absl::StrCat(picked, " is as good as this CPU (", CpuBlasLevelName(cpu),
                                   ") gets from OpenBLAS");
    return decision;
  }
  decision.force = best;
  decision.reason = absl::StrCat("OpenBLAS picked ", picked, " on a CPU with ",
                                 CpuBlasLevelName(cpu), "; ", best, " runs here");
  return decision;
}

std::string OpenblasCoreName() {
  const char* name = openblas_get_corename();
  return name == nullptr ? "" : name;
}

bool OpenblasDynamicArch() {
  const char* config = openblas_get_config();
  return config != nullptr && absl::StrContains(config, "DYNAMIC_ARCH");
}

absl::Status ReexecWithBlasCore(absl::string_view core, absl::string_view picked, char** argv) {
  if (core.empty()) return absl::InvalidArgumentError("no core to restart with");
  if (argv == nullptr || argv[0] == nullptr) return absl::InvalidArgumentError("empty argv");
  const std::optional<std::string> old_coretype = GetEnv(kOpenblasCoretypeEnv);
  const std::optional<std::string> old_restarted = GetEnv(kBlasCoreRestartedEnv);
  const std::string core_value(core);
  const std::string picked_value = picked.empty() ? std::string("unknown") : std::string(picked);
  if (setenv(kOpenblasCoretypeEnv, core_value.c_str(), 1) != 0 ||
      setenv(kBlasCoreRestartedEnv, picked_value.c_str(), 1) != 0) {
    const int error = errno;
    RestoreEnv(kOpenblasCoretypeEnv, old_coretype);
    RestoreEnv(kBlasCoreRestartedEnv, old_restarted);
    return absl::InternalError(absl::StrCat("setenv: ", std::strerror(error)));
  }
  execv("/proc/self/exe", argv);
  const int error = errno;
  RestoreEnv(kOpenblasCoretypeEnv, old_coretype);
  RestoreEnv(kBlasCoreRestartedEnv, old_restarted);
  return absl::InternalError(absl::StrCat("execv(/proc/self/exe) with ", kOpenblasCoretypeEnv, "=",
                                          core_value, ": ", std::strerror(error)));
}

absl::Status RestartWithBestBlasCore(char** argv) {
  const std::string picked = OpenblasCoreName();
  const BlasCoreDecision decision =
      DecideBlasCore(picked, OpenblasDynamicArch(), DetectCpuBlasFeatures(), ReadBlasCoreEnv());
  if (decision.force.empty()) return absl::OkStatus();
  return ReexecWithBlasCore(decision.force, picked, argv);
}

BlasCoreState CurrentBlasCore() {
  BlasCoreState state;
  state.core = OpenblasCoreName();
  state.cpu = CpuBlasLevelName(DetectCpuBlasFeatures());
  const BlasCoreEnv env = ReadBlasCoreEnv();
  if (env.restarted.has_value()) state.picked = *env.restarted;
  if (env.openblas_coretype.has_value()) state.forced = *env.openblas_coretype;
  return state;
}

std::string BlasCoreState::Summary() const {
  std::string line = absl::StrCat("OpenBLAS core ", core, ": ");
  if (restarted()) {
    absl::StrAppend(&line, "OpenBLAS picked ", picked, " on a CPU with ", cpu, "; restarted with ",
                    kOpenblasCoretypeEnv, "=", forced, " (", kBlasCoreCheckEnv,
                    "=off keeps OpenBLAS's pick)");
  } else if (!forced.empty()) {
    absl::StrAppend(&line, kOpenblasCoretypeEnv, "=", forced, " from the environment");
  } else {
    absl::StrAppend(&line, "OpenBLAS's own pick");
  }
  return line;
}

}  // namespace kvt
