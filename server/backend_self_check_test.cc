#include "server/backend_self_check.h"

#include <cstdio>
#include <memory>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "server/faulty_backend.h"

namespace kvt {
namespace {

using ::kvt::testing::Fault;
using ::kvt::testing::FaultyBackendOptions;
using ::kvt::testing::NewFaultyBackend;
using ::testing::HasSubstr;
using ::testing::Not;

std::unique_ptr<Backend> Cpu() {
  CpuBackendOptions options;
  options.num_threads = 2;
  return NewCpuBackend(options);
}

std::unique_ptr<Backend> Faulty(Fault fault, double offset = 0.5) {
  FaultyBackendOptions options;
  options.fault = fault;
  options.offset = offset;
  return NewFaultyBackend(Cpu(), options);
}

TEST(BackendSelfCheckTest, CasesAreRidgeAndMlpInBothDtypes) {
  std::vector<std::string> names;
  for (const SelfCheckCase& c : DefaultSelfCheckCases()) names.push_back(c.name());
  EXPECT_THAT(names, ::testing::ElementsAre("ridge/fp32", "ridge/bf16", "mlp/fp32", "mlp/bf16"));
}

// The CPU backend meets SPEC 3 against float64 in every case, in a few milliseconds.
TEST(BackendSelfCheckTest, CpuBackendPasses) {
  std::unique_ptr<Backend> cpu = Cpu();
  const SelfCheckReport report = RunBackendSelfCheck(*cpu, nullptr);
  std::printf("%s\n", report.Summary().c_str());
  for (const SelfCheckCaseResult& c : report.cases) {
    std::printf("  %s: %.1f ms\n", c.test.name().c_str(), c.seconds * 1e3);
  }
  ASSERT_TRUE(report.passed()) << report.Summary();
  EXPECT_EQ(report.result(), "pass");
  EXPECT_EQ(report.backend, "cpu");
  ASSERT_EQ(report.cases.size(), 4u);
  for (const SelfCheckCaseResult& c : report.cases) {
    EXPECT_TRUE(c.status.ok()) << c.Describe();
    EXPECT_LE(c.error_vs_reference, c.tolerance) << c.Describe();
    EXPECT_GT(c.error_vs_reference, 0) << c.Describe();  // it compared real numbers
    EXPECT_FALSE(c.error_vs_cpu.has_value());
  }
  EXPECT_THAT(report.Summary(), HasSubstr("cpu self-check passed: 4 cases in"));
  EXPECT_LT(report.seconds, 2.0);  // about 5 ms; generous for a loaded machine
}

// A device backend is compared with the CPU backend as well (here a second CPU backend under
// the name "cuda": the two agree to the bit).
TEST(BackendSelfCheckTest, ComparesWithTheCpuBackendWhenGiven) {
  std::unique_ptr<Backend> device = Faulty(Fault::kNone);
  std::unique_ptr<Backend> cpu = Cpu();
  const SelfCheckReport report = RunBackendSelfCheck(*device, cpu.get());
  ASSERT_TRUE(report.passed()) << report.Summary();
  EXPECT_EQ(report.device, "cuda:0");
  for (const SelfCheckCaseResult& c : report.cases) {
    ASSERT_TRUE(c.error_vs_cpu.has_value());
    EXPECT_EQ(*c.error_vs_cpu, 0) << c.Describe();
  }
  EXPECT_THAT(report.Summary(), HasSubstr("vs cpu"));
}

// A kernel that returns OK but writes a wrong value fails every case, and the summary names
// the case, the error and the SPEC 3 tolerance.
TEST(BackendSelfCheckTest, WrongOutputIsAMismatch) {
  std::unique_ptr<Backend> device = Faulty(Fault::kPerturb, 0.5);
  std::unique_ptr<Backend> cpu = Cpu();
  const SelfCheckReport report = RunBackendSelfCheck(*device, cpu.get());
  EXPECT_FALSE(report.passed());
  EXPECT_EQ(report.result(), "mismatch");
  for (const SelfCheckCaseResult& c : report.cases) EXPECT_FALSE(c.passed()) << c.Describe();
  const std::string summary = report.Summary();
  EXPECT_THAT(summary, HasSubstr("cuda:0 self-check failed"));
  EXPECT_THAT(summary, HasSubstr("mlp/bf16: max relative error "));
  EXPECT_THAT(summary, HasSubstr("vs the float64 reference exceeds the SPEC 3 tolerance 1.00e-02"));
  EXPECT_THAT(summary, HasSubstr("vs the CPU backend exceeds 2.00e-02"));
  EXPECT_THAT(summary, HasSubstr("ridge/fp32: max relative error "));
  EXPECT_THAT(summary, HasSubstr("tolerance 1.00e-05"));
}

// The tolerance follows the dtype: a 1e-3 error fails fp32 (1e-5) but not bf16 (1e-2).
TEST(BackendSelfCheckTest, ToleranceIsSpec3PerDtype) {
  std::unique_ptr<Backend> device = Faulty(Fault::kPerturb, 1e-3);
  const SelfCheckReport report = RunBackendSelfCheck(*device, nullptr);
  EXPECT_FALSE(report.passed());
  for (const SelfCheckCaseResult& c : report.cases) {
    EXPECT_EQ(c.passed(), c.test.dtype == DType::kBF16) << c.Describe();
  }
  EXPECT_THAT(report.Summary(), HasSubstr("ridge/fp32: "));
  EXPECT_THAT(report.Summary(), Not(HasSubstr("ridge/bf16")));
}

// A backend error (here an injected CUDA error) is reported with the call that failed.
TEST(BackendSelfCheckTest, BackendErrorsAreReported) {
  std::unique_ptr<Backend> device = Faulty(Fault::kTranslateError);
  const SelfCheckReport report = RunBackendSelfCheck(*device, nullptr);
  EXPECT_FALSE(report.passed());
  EXPECT_EQ(report.result(), "error");
  EXPECT_THAT(report.Summary(),
              HasSubstr("ridge/fp32: INTERNAL: TranslateLayer(0): injected: cudaErrorIllegalAddress"));

  std::unique_ptr<Backend> no_memory = Faulty(Fault::kPrepareError);
  const SelfCheckReport prepare = RunBackendSelfCheck(*no_memory, nullptr);
  EXPECT_EQ(prepare.result(), "error");
  EXPECT_THAT(prepare.Summary(), HasSubstr("mlp/bf16: RESOURCE_EXHAUSTED: BeginPrepare: injected"));
}

// On a machine with a GPU (tests/gpu/run.sh): the real CUDA backend against CPU and float64.
TEST(BackendSelfCheckTest, CudaBackendPassesOnAGpu) {
  if (!cuda::DeviceCount().ok()) GTEST_SKIP() << "no usable CUDA device";
  absl::StatusOr<std::unique_ptr<Backend>> cuda = NewCudaBackend();
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  std::unique_ptr<Backend> cpu = Cpu();
  const SelfCheckReport report = RunBackendSelfCheck(**cuda, cpu.get());
  std::printf("%s\n", report.Summary().c_str());
  EXPECT_TRUE(report.passed()) << report.Summary();
}

}  // namespace
}  // namespace kvt
