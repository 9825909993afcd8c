#include "kernels/blas_core.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

CpuBlasFeatures Avx() {
  CpuBlasFeatures cpu;
  cpu.avx = true;
  return cpu;
}

CpuBlasFeatures Avx2(bool amd = false) {
  CpuBlasFeatures cpu = Avx();
  cpu.amd = amd;
  cpu.avx2 = cpu.fma = true;
  return cpu;
}

CpuBlasFeatures Avx512(bool bf16 = false, bool amd = false) {
  CpuBlasFeatures cpu = Avx2(amd);
  cpu.avx512f = cpu.avx512vl = cpu.avx512bw = cpu.avx512dq = cpu.avx512cd = true;
  cpu.avx512_bf16 = bf16;
  return cpu;
}

std::string Force(absl::string_view picked, const CpuBlasFeatures& cpu,
                  const BlasCoreEnv& env = {}) {
  return DecideBlasCore(picked, /*dynamic_arch=*/true, cpu, env).force;
}

TEST(BlasCoreLevel, RanksOpenblasNames) {
  EXPECT_EQ(BlasCoreLevel("Prescott"), 0);
  EXPECT_EQ(BlasCoreLevel("Unknown"), 0);
  EXPECT_EQ(BlasCoreLevel("Nehalem"), 0);
  EXPECT_EQ(BlasCoreLevel("Sandybridge"), 1);
  EXPECT_EQ(BlasCoreLevel("Haswell"), 2);
  EXPECT_EQ(BlasCoreLevel("Zen"), 2);
  EXPECT_EQ(BlasCoreLevel("SkylakeX"), 3);
  EXPECT_EQ(BlasCoreLevel("cooperlake"), 3);  // OpenBLAS compares without case
  EXPECT_EQ(BlasCoreLevel("SapphireRapids"), 3);
  EXPECT_EQ(BlasCoreLevel("POWER9"), std::nullopt);
  EXPECT_EQ(BlasCoreLevel(""), std::nullopt);
}

TEST(BestBlasCore, ByInstructionSet) {
  EXPECT_EQ(BestBlasCore(Avx512(/*bf16=*/true)), "SkylakeX");
  EXPECT_EQ(BestBlasCore(Avx512(/*bf16=*/false)), "SkylakeX");
  EXPECT_EQ(BestBlasCore(Avx512(/*bf16=*/true, /*amd=*/true)), "SkylakeX");
  EXPECT_EQ(BestBlasCore(Avx2()), "Haswell");
  EXPECT_EQ(BestBlasCore(Avx2(/*amd=*/true)), "Zen");
  EXPECT_EQ(BestBlasCore(Avx()), "Sandybridge");
  EXPECT_EQ(BestBlasCore(CpuBlasFeatures{}), "");
  // AVX-512F without VL/BW/DQ (Knights Landing): not SkylakeX's instruction set.
  CpuBlasFeatures knl = Avx2();
  knl.avx512f = knl.avx512cd = true;
  EXPECT_EQ(BestBlasCore(knl), "Haswell");
  // AVX2 without FMA is not Haswell's.
  CpuBlasFeatures no_fma = Avx2();
  no_fma.fma = false;
  EXPECT_EQ(BestBlasCore(no_fma), "Sandybridge");
}

TEST(DecideBlasCore, WeakPicksOnAvx512Bf16ForceSkylakeX) {
  // Emerald Rapids under OpenBLAS 0.3.21: "Prescott". Cooperlake's BLAS3 kernels are
  // SkylakeX's, and 0.3.21's OPENBLAS_CORETYPE does not accept "Cooperlake".
  for (const char* picked :
       {"Prescott", "Core2", "Nehalem", "Sandybridge", "Unknown", "Haswell", "Zen", "Atom"}) {
    SCOPED_TRACE(picked);
    EXPECT_EQ(Force(picked, Avx512(/*bf16=*/true)), "SkylakeX");
    EXPECT_EQ(Force(picked, Avx512(/*bf16=*/false)), "SkylakeX");
  }
  const BlasCoreDecision decision = DecideBlasCore("Prescott", true, Avx512(true), {});
  EXPECT_THAT(decision.reason, HasSubstr("picked Prescott"));
  EXPECT_THAT(decision.reason, HasSubstr("AVX-512 BF16"));
}

TEST(DecideBlasCore, WeakPicksOnAvx2) {
  for (const char* picked : {"Prescott", "Core2", "Nehalem", "Sandybridge", "Unknown"}) {
    SCOPED_TRACE(picked);
    EXPECT_EQ(Force(picked, Avx2()), "Haswell");
    EXPECT_EQ(Force(picked, Avx2(/*amd=*/true)), "Zen");
  }
  EXPECT_EQ(Force("Prescott", Avx()), "Sandybridge");
  EXPECT_EQ(Force("Barcelona", Avx()), "Sandybridge");
}

TEST(DecideBlasCore, GoodPicksAreKept) {
  EXPECT_EQ(Force("Cooperlake", Avx512(true)), "");
  EXPECT_EQ(Force("SkylakeX", Avx512(true)), "");
  EXPECT_EQ(Force("SapphireRapids", Avx512(true)), "");
  EXPECT_EQ(Force("Haswell", Avx2()), "");
  EXPECT_EQ(Force("Zen", Avx2(true)), "");
  EXPECT_EQ(Force("Excavator", Avx2(true)), "");
  EXPECT_EQ(Force("Sandybridge", Avx()), "");
  EXPECT_EQ(Force("Prescott", CpuBlasFeatures{}), "");
}

TEST(DecideBlasCore, NeverDowngrades) {
  // A pick above what the flags say (whatever the reason) stays.
  EXPECT_EQ(Force("SkylakeX", Avx2()), "");
  EXPECT_EQ(Force("Cooperlake", Avx()), "");
  EXPECT_EQ(Force("Haswell", Avx()), "");
  EXPECT_EQ(Force("Zen", CpuBlasFeatures{}), "");
  // Every known name against every CPU: a forced core always ranks strictly above the pick.
  for (const char* picked : {"Prescott", "Sandybridge", "Haswell", "Zen", "SkylakeX", "Cooperlake",
                             "Steamroller", "Excavator"}) {
    for (const CpuBlasFeatures& cpu :
         {CpuBlasFeatures{}, Avx(), Avx2(), Avx2(true), Avx512(), Avx512(true)}) {
      const std::string force = Force(picked, cpu);
      if (force.empty()) continue;
      EXPECT_GT(*BlasCoreLevel(force), *BlasCoreLevel(picked)) << picked << " -> " << force;
    }
  }
}

TEST(DecideBlasCore, UnknownNamesAreKept) {
  EXPECT_EQ(Force("POWER10", Avx512(true)), "");
  EXPECT_EQ(Force("Zen5", Avx512(true)), "");
  EXPECT_EQ(Force("", Avx512(true)), "");
}

TEST(DecideBlasCore, UserCoretypeIsRespected) {
  BlasCoreEnv env;
  env.openblas_coretype = "Prescott";
  const BlasCoreDecision decision = DecideBlasCore("Prescott", true, Avx512(true), env);
  EXPECT_EQ(decision.force, "");
  EXPECT_THAT(decision.reason, HasSubstr("OPENBLAS_CORETYPE=Prescott from the environment"));
  // An OPENBLAS_CORETYPE OpenBLAS did not accept (it then autodetected) is the user's too.
  env.openblas_coretype = "Cooperlake";
  EXPECT_EQ(Force("Prescott", Avx512(true), env), "");
  // Set but empty: OpenBLAS ignores it, so does the check.
  env.openblas_coretype = "";
  EXPECT_EQ(Force("Prescott", Avx512(true), env), "SkylakeX");
}

TEST(DecideBlasCore, MarkerStopsASecondRestart) {
  BlasCoreEnv env;
  env.restarted = "Prescott";
  const BlasCoreDecision decision = DecideBlasCore("Prescott", true, Avx512(true), env);
  EXPECT_EQ(decision.force, "");
  EXPECT_THAT(decision.reason, HasSubstr("already restarted"));
  env.restarted = "";
  EXPECT_EQ(Force("Prescott", Avx512(true), env), "");
}

TEST(DecideBlasCore, OptOut) {
  BlasCoreEnv env;
  for (const char* off : {"off", "OFF", "0", "false", "no", " off "}) {
    env.check = off;
    EXPECT_EQ(Force("Prescott", Avx512(true), env), "") << off;
  }
  for (const char* on : {"on", "1", "", "auto"}) {
    env.check = on;
    EXPECT_EQ(Force("Prescott", Avx512(true), env), "SkylakeX") << on;
  }
}

TEST(DecideBlasCore, OnlyDynamicArchBuildsReadTheVariable) {
  EXPECT_EQ(DecideBlasCore("Prescott", /*dynamic_arch=*/false, Avx512(true), {}).force, "");
}

TEST(BlasCoreState, Summary) {
  BlasCoreState state;
  state.core = "SkylakeX";
  state.picked = "Prescott";
  state.forced = "SkylakeX";
  state.cpu = "AVX-512 BF16";
  EXPECT_EQ(state.Summary(),
            "OpenBLAS core SkylakeX: OpenBLAS picked Prescott on a CPU with AVX-512 BF16; "
            "restarted with OPENBLAS_CORETYPE=SkylakeX (KVT_BLAS_CORE_CHECK=off keeps "
            "OpenBLAS's pick)");
  state.picked.clear();
  state.core = state.forced = "Prescott";
  EXPECT_EQ(state.Summary(),
            "OpenBLAS core Prescott: OPENBLAS_CORETYPE=Prescott from the environment");
  state.forced.clear();
  state.core = "Cooperlake";
  EXPECT_EQ(state.Summary(), "OpenBLAS core Cooperlake: OpenBLAS's own pick");
}

TEST(BlasCore, ThisProcess) {
  // Whatever the machine: the library answers, and the CPU's best core is no weaker than a
  // level the CPU's flags name.
  EXPECT_FALSE(OpenblasCoreName().empty());
  const CpuBlasFeatures cpu = DetectCpuBlasFeatures();
  const std::string best = BestBlasCore(cpu);
  if (!best.empty()) {
    EXPECT_TRUE(BlasCoreLevel(best).has_value());
  }
  EXPECT_FALSE(CurrentBlasCore().Summary().empty());
}

}  // namespace
}  // namespace kvt
