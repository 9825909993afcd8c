// The OpenBLAS core restart for real: kernels/testing/blas_core_probe started with a controlled
// environment, its "start" lines counted (one per exec) and its final state read back.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/blas_core.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

struct ProbeRun {
  int exit_code = -1;
  std::vector<std::string> starts;  // one per exec of the probe
  std::string core, picked, forced, summary;
  std::vector<std::string> args;  // argv[1..] of the final process
  std::string output;
};

// `env_assignments` like "OPENBLAS_CORETYPE=Prescott"; the check's own variables are unset
// first, whatever the test's environment has.
ProbeRun RunProbe(const std::vector<std::string>& env_assignments,
                  const std::vector<std::string>& args) {
  const std::string binary =
      absl::StrCat(std::getenv("TEST_SRCDIR"), "/kvt/kernels/testing/blas_core_probe");
  std::string command = absl::StrCat("env -u ", kOpenblasCoretypeEnv, " -u ", kBlasCoreRestartedEnv,
                                     " -u ", kBlasCoreCheckEnv);
  for (const std::string& assignment : env_assignments) absl::StrAppend(&command, " ", assignment);
  absl::StrAppend(&command, " '", binary, "'");
  for (const std::string& arg : args) absl::StrAppend(&command, " '", arg, "'");
  absl::StrAppend(&command, " 2>&1");
  ProbeRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) run.output += buffer;
  const int status = pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  for (absl::string_view line : absl::StrSplit(run.output, '\n')) {
    const auto value = [&](absl::string_view key, std::string* out) {
      if (absl::StartsWith(line, key)) *out = std::string(line.substr(key.size()));
    };
    if (absl::StartsWith(line, "start ")) run.starts.emplace_back(line);
    value("core=", &run.core);
    value("picked=", &run.picked);
    value("forced=", &run.forced);
    value("summary=", &run.summary);
    if (absl::StartsWith(line, "arg[")) {
      run.args.emplace_back(line.substr(line.find('=') + 1));
    }
  }
  return run;
}

const std::vector<std::string> kArgs = {"--flag=x", "two words", "", "last"};

std::vector<std::string> WithMode(const std::string& mode) {
  std::vector<std::string> args = {mode};
  args.insert(args.end(), kArgs.begin(), kArgs.end());
  return args;
}

TEST(BlasCoreE2E, AutoRestartsOnlyWhenThePickIsWeak) {
  if (std::getenv(kOpenblasCoretypeEnv) != nullptr) GTEST_SKIP() << "OPENBLAS_CORETYPE is set";
  // What this machine's OpenBLAS picks on its own (this test process linked the same library).
  const std::string picked = OpenblasCoreName();
  const BlasCoreDecision expected =
      DecideBlasCore(picked, OpenblasDynamicArch(), DetectCpuBlasFeatures(), BlasCoreEnv{});
  const ProbeRun run = RunProbe({}, WithMode("auto"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(run.args, WithMode("auto")) << run.output;
  if (expected.force.empty()) {
    // Here (e.g. Zen 4: "Cooperlake"): no restart, OpenBLAS's own pick.
    EXPECT_EQ(run.starts.size(), 1u) << run.output;
    EXPECT_EQ(run.core, picked);
    EXPECT_EQ(run.picked, "");
    EXPECT_EQ(run.summary, absl::StrCat("OpenBLAS core ", picked, ": OpenBLAS's own pick"));
  } else {
    // A CPU this OpenBLAS does not know: exactly one restart, onto the forced core.
    EXPECT_EQ(run.starts.size(), 2u) << run.output;
    EXPECT_EQ(run.core, expected.force);
    EXPECT_EQ(run.picked, picked);
    EXPECT_THAT(run.summary, HasSubstr("restarted with OPENBLAS_CORETYPE=" + expected.force));
  }
}

TEST(BlasCoreE2E, ExplicitCoretypeIsRespected) {
  const ProbeRun run = RunProbe({"OPENBLAS_CORETYPE=Prescott"}, WithMode("auto"));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(run.starts.size(), 1u) << run.output;
  EXPECT_EQ(run.core, "Prescott");
  EXPECT_EQ(run.forced, "Prescott");
  EXPECT_EQ(run.picked, "");
  EXPECT_EQ(run.summary, "OpenBLAS core Prescott: OPENBLAS_CORETYPE=Prescott from the environment");
}

TEST(BlasCoreE2E, OptOutAndMarkerNeverRestart) {
  for (const std::string& assignment :
       {std::string("KVT_BLAS_CORE_CHECK=off"), std::string("KVT_BLAS_CORE_RESTARTED=Prescott")}) {
    SCOPED_TRACE(assignment);
    const ProbeRun run = RunProbe({assignment}, WithMode("auto"));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_EQ(run.starts.size(), 1u) << run.output;
  }
}

// The re-exec itself, onto a core other than this machine's own pick: the restarted process
// runs that core, knows what was picked before, and has the same arguments.
void ExpectRestartOnto(const std::string& core) {
  const std::string picked = OpenblasCoreName();
  const ProbeRun run = RunProbe({}, WithMode("force:" + core));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  ASSERT_EQ(run.starts.size(), 2u) << run.output;
  EXPECT_THAT(run.starts[0], HasSubstr("marker=-"));
  EXPECT_THAT(run.starts[1], HasSubstr("core=" + core + " marker=" + picked));
  EXPECT_EQ(run.core, core);
  EXPECT_EQ(run.forced, core);
  EXPECT_EQ(run.picked, picked);
  EXPECT_EQ(run.args, WithMode("force:" + core));
  EXPECT_THAT(run.summary, HasSubstr(absl::StrCat("OpenBLAS core ", core, ": OpenBLAS picked ",
                                                  picked, " on a CPU with ")));
  EXPECT_THAT(run.summary, HasSubstr("restarted with OPENBLAS_CORETYPE=" + core));
}

TEST(BlasCoreE2E, RestartOntoPrescott) {
  if (std::getenv(kOpenblasCoretypeEnv) != nullptr) GTEST_SKIP() << "OPENBLAS_CORETYPE is set";
  if (OpenblasCoreName() == "Prescott") GTEST_SKIP() << "OpenBLAS picks Prescott here";
  ExpectRestartOnto("Prescott");
}

TEST(BlasCoreE2E, RestartOntoTheBestCore) {
  if (std::getenv(kOpenblasCoretypeEnv) != nullptr) GTEST_SKIP() << "OPENBLAS_CORETYPE is set";
  const std::string best = BestBlasCore(DetectCpuBlasFeatures());
  if (best.empty()) GTEST_SKIP() << "no AVX here";
  ExpectRestartOnto(best);  // "SkylakeX" on AVX-512 CPUs
}

}  // namespace
}  // namespace kvt
