#include "mapper_store/inspect.h"

#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

bool Contains(const std::string& text, const std::string& piece) {
  return text.find(piece) != std::string::npos;
}

// A fitted-looking mapper: synth weights, but R^2 in the manifest and shared sigma on layer 1.
std::string WriteFitted(const std::string& dir) {
  SynthOptions options = *SynthPreset("demo-tiny");
  options.source.name = "Qwen/Qwen3-14B";
  options.target.name = "Qwen/Qwen3-32B";
  options.target.rope.scaling.type = RopeScalingType::kLlama3;
  options.target.rope.scaling.factor = 8;
  Manifest m = *SynthManifest(options);
  m.synthetic = false;
  m.created_by = "kvt fit 0.1";
  m.calibration_yaml = "dataset: fineweb-edu\nsequences: 500\nstride: 4\n";
  for (LayerEntry& layer : m.layers) {
    layer.r2_k = 0.91;
    layer.r2_v = 0.5 + 0.05 * layer.target_layer;
  }
  m.layers[2].r2_k_heldout = 0.88;
  m.layers[1].sigma_v = m.layers[1].sigma_k;
  EXPECT_TRUE(WriteMapperDir(dir, m, MapperTensorSpecs(m),
                             [&](size_t i, absl::Span<uint8_t> dst) {
                               return FillSynthTensor(options, m, i, dst);
                             })
                  .ok());
  return dir;
}

TEST(InspectTest, ReportsSummarySizesSigmaAndR2) {
  const std::string dir = WriteFitted(JoinPath(testing::MakeTempDir("inspect"), "q14-q32"));
  absl::StatusOr<std::string> report = InspectMapperDir(dir);
  ASSERT_TRUE(report.ok()) << report.status();
  std::cout << *report;
  const std::string& r = *report;
  EXPECT_TRUE(Contains(r, "mapper        q14-q32\n")) << r;
  EXPECT_TRUE(Contains(r, "path          " + dir)) << r;
  EXPECT_TRUE(Contains(r, "checksums verified")) << r;
  EXPECT_TRUE(Contains(r, "kind          ridge\n")) << r;
  EXPECT_TRUE(Contains(r, "created by kvt fit 0.1")) << r;
  EXPECT_TRUE(Contains(r, "source        Qwen/Qwen3-14B: 4 layers, 2 KV heads x 32")) << r;
  EXPECT_TRUE(Contains(r, "RoPE theta 10000, neox, rotary_dim 32, no scaling")) << r;
  EXPECT_TRUE(Contains(r, "llama3 scaling x8")) << r;
  EXPECT_TRUE(Contains(r, "k             2 source layers per target layer (of 4)")) << r;
  // 6 layers x 2 x ([128, 64] + [64]) fp32.
  EXPECT_TRUE(Contains(r, "fp32, 99.1 K parameters (99072), 387.00 KiB (396288 bytes)")) << r;
  EXPECT_TRUE(Contains(r, "  dataset: fineweb-edu\n")) << r;
  EXPECT_TRUE(Contains(r, "R^2 mean      r2_k 0.910 r2_v 0.625 r2_k_heldout 0.880")) << r;
  EXPECT_FALSE(Contains(r, "r2_v_heldout")) << r;
  EXPECT_TRUE(Contains(r, "= sigma_k")) << r;
  EXPECT_TRUE(Contains(r, "0.750")) << r;  // layer 5 r2_v
}

TEST(InspectTest, ReportsTheMeasuredBenefitPerText) {
  Manifest m = *SynthManifest(*SynthPreset("demo-tiny"));
  EXPECT_FALSE(Contains(InspectManifest(m, "x"), "benefit")) << InspectManifest(m, "x");
  BenefitRecord docs;
  docs.text = "python-docs-heldout";
  docs.windows = 64;
  docs.context_tokens = 384;
  docs.continuation_tokens = 96;
  docs.recovered = 0.64;
  docs.lower95 = 0.5;
  docs.upper95 = 0.86;
  docs.kl = 0.12;
  m.quality.benefit = {docs};
  const std::string r = InspectManifest(m, "x");
  EXPECT_TRUE(Contains(r, "benefit       context benefit recovered [95% interval] per text "
                          "(quality.benefit)\n  python-docs-heldout: recovered 0.64 [0.5, 0.86], "
                          "KL 0.12 nats/token (64 windows, 384 + 96 tokens)\n"))
      << r;
}

TEST(InspectTest, SyntheticMapperIsFlaggedAndHasNoR2Columns) {
  const std::string dir = JoinPath(testing::MakeTempDir("inspect_synth"), "demo");
  KVT_ASSERT_OK(WriteSynthMapper(dir, *SynthPreset("demo-tiny")));
  LoadOptions options;
  options.verify_checksums = false;
  absl::StatusOr<std::string> report = InspectMapperDir(dir, options);
  ASSERT_TRUE(report.ok()) << report.status();
  std::cout << *report << "\n" << *ReadFileToString(JoinPath(dir, kManifestFileName));
  EXPECT_TRUE(Contains(*report, "SYNTHETIC")) << *report;
  EXPECT_TRUE(Contains(*report, "lambda        0 (covariance scale)")) << *report;
  EXPECT_TRUE(Contains(*report, "checksums NOT verified")) << *report;
  EXPECT_TRUE(Contains(*report, "  seed: 0\n")) << *report;
  EXPECT_FALSE(Contains(*report, "R^2")) << *report;
  EXPECT_TRUE(Contains(*report, "layer  sigma_k  sigma_v\n")) << *report;
}

TEST(InspectTest, MlpMapperShowsKindHiddenGranularityAndParameters) {
  SynthOptions options = *SynthPreset("demo-tiny");
  for (MlpGranularity granularity : {MlpGranularity::kPerLayer, MlpGranularity::kPerHead}) {
    options.mlp = MlpConfig{16, granularity};
    const std::string dir =
        JoinPath(testing::MakeTempDir("inspect_mlp"), MlpGranularityName(granularity));
    KVT_ASSERT_OK(WriteSynthMapper(dir, options));
    absl::StatusOr<std::string> report = InspectMapperDir(dir);
    ASSERT_TRUE(report.ok()) << report.status();
    std::cout << *report;
    const std::string& r = *report;
    EXPECT_TRUE(Contains(r, "kind          mlp (SYNTHETIC")) << r;
    // demo-tiny: 6 target layers of 2 heads x 32, k = 2 of 2 heads x 32 -> in = 128, out = 64.
    int64_t params;
    if (granularity == MlpGranularity::kPerLayer) {
      EXPECT_TRUE(Contains(r, "mlp           hidden 16, per_layer (one chain per target layer"))
          << r;
      EXPECT_TRUE(Contains(r, "fc1 [len(sigma) x 64, 16], fc2 [16, 16], fc3 [16, 64]")) << r;
      params = 6 * 2 * (128 * 16 + 16 + 16 * 16 + 16 + 16 * 64 + 64);
    } else {
      EXPECT_TRUE(Contains(r, "mlp           hidden 16, per_head (2 chains per target layer"))
          << r;
      EXPECT_TRUE(Contains(r, "fc1 [2, len(sigma) x 64, 16], fc2 [2, 16, 16], fc3 [2, 16, 32]"))
          << r;
      params = 6 * 2 * 2 * (128 * 16 + 16 + 16 * 16 + 16 + 16 * 32 + 32);
    }
    EXPECT_TRUE(Contains(r, absl::StrCat(" parameters (", params, "), "))) << r;
  }
}

// demo-tiny (2 -> 2 heads of 32, k = 2, 6 target layers) as a head-local ridge, window 2: the
// granularity, the head matching and the per-head shapes, and n_kv = 2 times fewer weights.
TEST(InspectTest, RidgePerHeadShowsGranularityAndPerHeadShapes) {
  SynthOptions options = *SynthPreset("demo-tiny");
  options.window = 2;
  options.ridge_granularity = RidgeGranularity::kPerHead;
  const std::string dir = JoinPath(testing::MakeTempDir("inspect_per_head"), "m");
  KVT_ASSERT_OK(WriteSynthMapper(dir, options));
  absl::StatusOr<std::string> report = InspectMapperDir(dir);
  ASSERT_TRUE(report.ok()) << report.status();
  const std::string& r = *report;
  EXPECT_TRUE(Contains(r, "kind          ridge (SYNTHETIC")) << r;
  EXPECT_TRUE(Contains(r, "ridge         per_head: target head h maps only source head "
                          "h x n_s / n_t of each selected layer (2 GEMMs"))
      << r;
  EXPECT_TRUE(Contains(r, "W_K, W_V [2, 2 x len(sigma) x 32, 32], b_K, b_V [2, 32]")) << r;
  const int64_t params = 6 * 2 * (2 * (2 * 2 * 32) * 32 + 2 * 32);
  EXPECT_TRUE(Contains(r, absl::StrCat(" parameters (", params, "), "))) << r;
}

TEST(InspectTest, BrokenDirectoryGivesTheLoaderError) {
  KVT_EXPECT_ERROR(InspectMapperDir(JoinPath(testing::MakeTempDir("inspect_none"), "x")),
                   StatusCode::kNotFound, "not a mapper directory");
}

TEST(InspectTest, HumanUnits) {
  EXPECT_EQ(HumanBytes(512), "512 B");
  EXPECT_EQ(HumanBytes(1536), "1.50 KiB");
  EXPECT_EQ(HumanBytes(2147745792ull), "2.00 GiB");
  EXPECT_EQ(HumanCount(17), "17");
  EXPECT_EQ(HumanCount(1073872896), "1.07 B");
  EXPECT_EQ(HumanCount(12300000), "12.3 M");
}

}  // namespace
}  // namespace kvt
