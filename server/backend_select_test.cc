#include "server/backend_select.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "common/file_util.h"
#include "kernels/cuda/device.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/synth.h"
#include "server/faulty_backend.h"

namespace kvt {
namespace {

using ::kvt::testing::Fault;
using ::kvt::testing::FaultyBackendOptions;
using ::kvt::testing::NewFaultyBackend;
using ::testing::HasSubstr;

KvtdConfig::Backend WithType(const char* type) {
  KvtdConfig::Backend config;
  config.type = type;
  config.cpu_threads = 1;
  return config;
}

TEST(BackendSelectTest, CpuIsCpu) {
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("cpu"));
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(selected->backend->name(), "cpu");
  EXPECT_EQ(selected->reason, "backend.type=cpu");
  EXPECT_THAT(selected->cpu_gemm_path, ::testing::AnyOf("onednn_bf16", "sgemm"));
  EXPECT_FALSE(selected->cpu_isa.empty());
}

// backend.cpu_gemm reaches the CPU backend: fp32 forces sgemm, bf16 forces oneDNN (where
// oneDNN has a bf16 matmul at all), anything else is refused.
TEST(BackendSelectTest, CpuGemmIsPassedOn) {
  KvtdConfig::Backend config = WithType("cpu");
  config.cpu_gemm = "fp32";
  absl::StatusOr<SelectedBackend> selected = SelectBackend(config);
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(selected->cpu_gemm_path, "sgemm");
  EXPECT_EQ(selected->cpu_fp32_gemm_path, "sgemm");
  EXPECT_THAT(selected->backend->description(), HasSubstr("sgemm"));
  config.cpu_gemm = "bf16";
  selected = SelectBackend(config);
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_THAT(selected->cpu_gemm_reason, HasSubstr(selected->cpu_isa));
  if (selected->cpu_gemm_path == "onednn_bf16") {
    EXPECT_THAT(selected->backend->description(), HasSubstr("oneDNN"));
  } else {
    EXPECT_THAT(selected->cpu_gemm_reason, HasSubstr("has no bf16 matmul"));
  }
  config.cpu_gemm = "onednn_f32";
  selected = SelectBackend(config);
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(selected->cpu_gemm_path, "onednn_f32");
  EXPECT_EQ(selected->cpu_fp32_gemm_path, "onednn_f32");
  EXPECT_THAT(selected->backend->description(), HasSubstr("fp32 matmul"));
  config.cpu_gemm = "fp16";
  EXPECT_EQ(SelectBackend(config).status().code(), absl::StatusCode::kInvalidArgument);
}

// auto picks CUDA exactly when a device is usable; the reason says what was found.
TEST(BackendSelectTest, AutoFollowsTheDevice) {
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("auto"));
  ASSERT_TRUE(selected.ok()) << selected.status();
  if (cuda::DeviceCount().ok()) {
    EXPECT_EQ(selected->backend->name(), "cuda");
    EXPECT_EQ(selected->backend->device(), "cuda:0");
    EXPECT_THAT(selected->reason, HasSubstr("using cuda:0"));
  } else {
    EXPECT_EQ(selected->backend->name(), "cpu");
    EXPECT_THAT(selected->reason, HasSubstr("auto: no usable CUDA device"));
    EXPECT_THAT(selected->reason, HasSubstr("using CPU"));
  }
}

// cuda forced without a device is a startup error that says why, never a CPU fallback.
TEST(BackendSelectTest, ForcedCudaWithoutDeviceIsAnError) {
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("cuda"));
  if (cuda::DeviceCount().ok()) {
    ASSERT_TRUE(selected.ok()) << selected.status();
    EXPECT_EQ(selected->backend->name(), "cuda");
    return;
  }
  ASSERT_FALSE(selected.ok());
  EXPECT_EQ(selected.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(selected.status().message(), HasSubstr("backend.type=cuda"));
  EXPECT_THAT(selected.status().message(), HasSubstr("use backend.type=auto or cpu"));
}

TEST(BackendSelectTest, UnknownTypeNamesTheField) {
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("tpu"));
  ASSERT_FALSE(selected.ok());
  EXPECT_EQ(selected.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(selected.status().message(), HasSubstr("backend.type='tpu'"));
}

// A machine that says it has one GPU whose engine behaves as `fault` (a CPU backend underneath,
// reporting itself as cuda:0).
BackendFactories OneFaultyGpu(Fault fault) {
  BackendFactories factories;
  factories.device_count = [] { return absl::StatusOr<int>(1); };
  factories.new_cuda = [fault](const CudaBackendOptions&) {
    FaultyBackendOptions options;
    options.fault = fault;
    return absl::StatusOr<std::unique_ptr<Backend>>(
        NewFaultyBackend(NewCpuBackend(CpuBackendOptions{1, 512}), options));
  };
  return factories;
}

TEST(BackendSelectTest, EveryModeSelfChecksTheCpuBackend) {
  for (const char* type : {"cpu", "auto"}) {
    absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType(type));
    ASSERT_TRUE(selected.ok()) << selected.status();
    ASSERT_GE(selected->self_checks.size(), 1u) << type;
    EXPECT_EQ(selected->self_checks[0].backend, "cpu");
    EXPECT_TRUE(selected->self_checks[0].passed()) << selected->self_checks[0].Summary();
  }
}

TEST(BackendSelectTest, AutoUsesAGpuThatPassesItsSelfCheck) {
  absl::StatusOr<SelectedBackend> selected =
      SelectBackend(WithType("auto"), OneFaultyGpu(Fault::kNone));
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(selected->backend->device(), "cuda:0");
  EXPECT_THAT(selected->reason, HasSubstr("using cuda:0 (self-check passed)"));
  ASSERT_EQ(selected->self_checks.size(), 2u);
  EXPECT_EQ(selected->self_checks[1].result(), "pass");
}

// auto with a GPU whose engine computes wrong numbers: CPU, and the reason says why.
TEST(BackendSelectTest, AutoFallsBackToCpuWhenTheGpuFailsItsSelfCheck) {
  for (Fault fault : {Fault::kPerturb, Fault::kTranslateError}) {
    absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("auto"), OneFaultyGpu(fault));
    ASSERT_TRUE(selected.ok()) << selected.status();
    EXPECT_EQ(selected->backend->name(), "cpu");
    EXPECT_THAT(selected->reason, HasSubstr("auto: cuda:0 failed its start-up self-check"));
    EXPECT_THAT(selected->reason, HasSubstr("using CPU"));
    ASSERT_EQ(selected->self_checks.size(), 2u);
    EXPECT_EQ(selected->self_checks[0].result(), "pass");
    EXPECT_EQ(selected->self_checks[1].device, "cuda:0");
    EXPECT_EQ(selected->self_checks[1].result(),
              fault == Fault::kPerturb ? "mismatch" : "error");
  }
}

// Forced cuda with a failing self-check refuses to start, naming the case and the numbers or
// the CUDA error.
TEST(BackendSelectTest, ForcedCudaFailingItsSelfCheckIsAnError) {
  absl::StatusOr<SelectedBackend> selected =
      SelectBackend(WithType("cuda"), OneFaultyGpu(Fault::kPerturb));
  ASSERT_FALSE(selected.ok());
  EXPECT_EQ(selected.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string message(selected.status().message());
  EXPECT_THAT(message, HasSubstr("backend.type=cuda but the CUDA backend failed its start-up "
                                 "self-check: cuda:0 self-check failed"));
  EXPECT_THAT(message, HasSubstr("ridge/fp32: max relative error "));
  EXPECT_THAT(message, HasSubstr("exceeds the SPEC 3 tolerance 1.00e-05"));
  EXPECT_THAT(message, HasSubstr("use backend.type=auto or cpu"));

  selected = SelectBackend(WithType("cuda"), OneFaultyGpu(Fault::kTranslateError));
  ASSERT_FALSE(selected.ok());
  EXPECT_THAT(selected.status().message(),
              HasSubstr("TranslateLayer(0): injected: cudaErrorIllegalAddress"));
}

TEST(BackendSelectTest, ForcedCudaThatPassesIsUsed) {
  absl::StatusOr<SelectedBackend> selected =
      SelectBackend(WithType("cuda"), OneFaultyGpu(Fault::kNone));
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(selected->backend->device(), "cuda:0");
  EXPECT_THAT(selected->reason, HasSubstr("self-check passed"));
}

// A CPU backend that fails its self-check (a broken BLAS) is fatal in every mode.
TEST(BackendSelectTest, CpuFailingItsSelfCheckIsFatal) {
  BackendFactories factories = OneFaultyGpu(Fault::kNone);
  factories.new_cpu = [](const CpuBackendOptions& options) {
    FaultyBackendOptions faulty;
    faulty.fault = Fault::kPerturb;
    faulty.name = "cpu";
    faulty.device = "cpu";
    return NewFaultyBackend(NewCpuBackend(options), faulty);
  };
  for (const char* type : {"cpu", "auto", "cuda"}) {
    absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType(type), factories);
    ASSERT_FALSE(selected.ok()) << type;
    EXPECT_EQ(selected.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(selected.status().message(),
                HasSubstr("the CPU backend failed its start-up self-check: cpu self-check failed"));
  }
}

// auto's measured GEMM path computing wrong values gives way to sgemm; both checks are kept.
TEST(BackendSelectTest, AutoGemmPathFailingItsSelfCheckFallsBackToSgemm) {
  BackendFactories factories;
  factories.new_cpu = [](const CpuBackendOptions& options) -> std::unique_ptr<Backend> {
    if (options.gemm_path != CpuGemmPath::kAuto) return NewCpuBackend(options);
    FaultyBackendOptions faulty;
    faulty.fault = Fault::kPerturb;
    faulty.name = "cpu";
    faulty.device = "cpu";
    return NewFaultyBackend(NewCpuBackend(options), faulty);
  };
  absl::StatusOr<SelectedBackend> selected = SelectBackend(WithType("cpu"), factories);
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_EQ(selected->cpu_gemm_path, "sgemm");
  EXPECT_EQ(selected->cpu_gemm_reason, "forced");
  ASSERT_EQ(selected->self_checks.size(), 2u);
  EXPECT_FALSE(selected->self_checks[0].passed());
  EXPECT_TRUE(selected->self_checks[1].passed());
}

// The served mappers' matrices are what auto times; a directory without a readable manifest
// is skipped.
TEST(BackendSelectTest, ServedGemmShapesReadsEveryManifest) {
  const std::string store = testing::MakeTempDir("served_shapes");
  SynthOptions synth;
  synth.source = NeoxModelSpec("src", 3, 2, 16);
  synth.target = NeoxModelSpec("tgt", 2, 2, 8);
  synth.k = 2;
  ASSERT_TRUE(WriteSynthMapper(JoinPath(store, "ridge"), synth).ok());
  synth.mlp = MlpConfig{24, MlpGranularity::kPerLayer};
  ASSERT_TRUE(WriteSynthMapper(JoinPath(store, "mlp"), synth).ok());
  ASSERT_TRUE(MakeDirs(JoinPath(store, "broken")).ok());
  // k = 2 source layers x 2 heads x 16 = 64 inputs, 2 x 8 = 16 outputs; the MLP's 64 -> 24 ->
  // 24 -> 16 (the store lists directories sorted: mlp first).
  EXPECT_EQ(ServedGemmShapes(store),
            std::vector<GemmShape>({{64, 24}, {24, 24}, {24, 16}, {64, 16}}));
  EXPECT_TRUE(ServedGemmShapes(JoinPath(store, "missing")).empty());
  synth.mlp.reset();

  KvtdConfig::Backend config = WithType("cpu");
  absl::StatusOr<SelectedBackend> selected = SelectBackend(config, {}, ServedGemmShapes(store));
  ASSERT_TRUE(selected.ok()) << selected.status();
  ASSERT_TRUE(selected->cpu_gemm_probe.has_value());
  EXPECT_EQ(selected->cpu_gemm_probe->shapes.size(), 4u);
  EXPECT_THAT(selected->cpu_gemm_reason, HasSubstr("auto: measured"));
  config.cpu_gemm = "fp32";
  selected = SelectBackend(config, {}, ServedGemmShapes(store));
  ASSERT_TRUE(selected.ok()) << selected.status();
  EXPECT_FALSE(selected->cpu_gemm_probe.has_value());
}

}  // namespace
}  // namespace kvt
