#include "mapper_store/synth.h"

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "common/file_util.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kernels/testing/reference.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

SynthOptions Small(uint64_t seed) {
  SynthOptions o;
  o.source = NeoxModelSpec("s", 5, 2, 16);
  o.target = NeoxModelSpec("t", 3, 2, 16);
  o.k = 3;
  o.dtype = DType::kBF16;
  o.seed = seed;
  return o;
}

TEST(SynthTest, SameSeedGivesIdenticalBytes) {
  const std::string root = testing::MakeTempDir("synth_det");
  KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root, "a"), Small(7)));
  KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root, "b"), Small(7)));
  KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root, "c"), Small(8)));
  for (const char* file : {"manifest.yaml", "weights.safetensors", "SHA256SUMS"}) {
    EXPECT_EQ(*ReadFileToString(JoinPath(root, std::string("a/") + file)),
              *ReadFileToString(JoinPath(root, std::string("b/") + file)))
        << file;
  }
  EXPECT_NE(*ReadFileToString(JoinPath(root, "a/weights.safetensors")),
            *ReadFileToString(JoinPath(root, "c/weights.safetensors")));
  EXPECT_NE(SynthManifest(Small(7))->layers[0].sigma_k, SynthManifest(Small(8))->layers[0].sigma_k);
}

TEST(SynthTest, TensorsDoNotDependOnGenerationOrder) {
  const std::string dir = JoinPath(testing::MakeTempDir("synth_order"), "m");
  const SynthOptions options = Small(3);
  KVT_ASSERT_OK(WriteSynthMapper(dir, options));
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(dir);
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  const Manifest manifest = *SynthManifest(options);
  const std::vector<TensorSpec> specs = MapperTensorSpecs(manifest);
  std::vector<uint8_t> alone(specs[6].num_bytes());
  KVT_ASSERT_OK(FillSynthTensor(options, manifest, 6, absl::MakeSpan(alone)));
  absl::Span<const uint8_t> stored = (*mapper)->weights().data(*(*mapper)->weights().Find(specs[6].name));
  EXPECT_EQ(std::vector<uint8_t>(stored.begin(), stored.end()), alone);
}

TEST(SynthTest, ManifestIsSyntheticWithValidSigma) {
  const SynthOptions options = Small(11);
  absl::StatusOr<Manifest> m = SynthManifest(options);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->synthetic);
  EXPECT_EQ(m->k, 3);
  EXPECT_EQ(m->created_by, "kvt synth 0.1");
  EXPECT_NE(m->calibration_yaml.find("seed: 11"), std::string::npos);
  ASSERT_EQ(m->layers.size(), 3u);
  bool k_and_v_differ = false;
  for (const LayerEntry& layer : m->layers) {
    for (const std::vector<int>* sigma : {&layer.sigma_k, &layer.sigma_v}) {
      EXPECT_EQ(sigma->size(), 3u);
      EXPECT_EQ(std::set<int>(sigma->begin(), sigma->end()).size(), 3u);
      for (int j : *sigma) {
        EXPECT_GE(j, 0);
        EXPECT_LT(j, 5);
      }
    }
    k_and_v_differ = k_and_v_differ || layer.sigma_k != layer.sigma_v;
  }
  EXPECT_TRUE(k_and_v_differ);

  SynthOptions shared = options;
  shared.shared_sigma = true;
  shared.k = 0;  // all
  absl::StatusOr<Manifest> all = SynthManifest(shared);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->k, 5);
  for (const LayerEntry& layer : all->layers) EXPECT_EQ(layer.sigma_k, layer.sigma_v);
}

TEST(SynthTest, WeightsKeepTheInputScale) {
  SynthOptions options;
  options.source = NeoxModelSpec("s", 4, 2, 64);
  options.target = NeoxModelSpec("t", 1, 2, 64);
  options.k = 2;  // fan_in 256
  options.dtype = DType::kFP32;
  options.seed = 5;
  const Manifest m = *SynthManifest(options);
  const std::vector<TensorSpec> specs = MapperTensorSpecs(m);
  std::vector<float> w(specs[0].num_elements()), b(specs[1].num_elements());
  KVT_ASSERT_OK(FillSynthTensor(options, m, 0,
                                absl::MakeSpan(reinterpret_cast<uint8_t*>(w.data()), w.size() * 4)));
  KVT_ASSERT_OK(FillSynthTensor(options, m, 1,
                                absl::MakeSpan(reinterpret_cast<uint8_t*>(b.data()), b.size() * 4)));
  double sum = 0, sum_sq = 0;
  for (float v : w) {
    sum += v;
    sum_sq += double(v) * v;
  }
  const double n = w.size();
  EXPECT_NEAR(sum / n, 0.0, 0.003);
  EXPECT_NEAR(std::sqrt(sum_sq / n), 1.0 / 16.0, 0.002);  // 1/sqrt(256), 32768 samples
  double bias_sq = 0;
  for (float v : b) bias_sq += double(v) * v;
  EXPECT_NEAR(std::sqrt(bias_sq / b.size()), 0.01, 0.003);

  // y = x W with x of unit-variance features keeps unit variance (outputs keep the input scale).
  const int64_t rows = specs[0].shape[0], cols = specs[0].shape[1];
  double y_sq = 0;
  int samples = 0;
  for (int t = 0; t < 32; ++t) {
    std::vector<double> x(rows);
    for (int64_t r = 0; r < rows; ++r) x[r] = ((r * 7919 + t * 104729) % 2 == 0) ? 1.0 : -1.0;
    for (int64_t c = 0; c < cols; ++c) {
      double y = 0;
      for (int64_t r = 0; r < rows; ++r) y += x[r] * w[r * cols + c];
      y_sq += y * y;
      ++samples;
    }
  }
  EXPECT_NEAR(y_sq / samples, 1.0, 0.15);
}

TEST(SynthTest, PresetsHaveThePapersSizes) {
  EXPECT_EQ(SynthPresetNames(),
            (std::vector<std::string>{"demo-tiny", "llama3.1-8b-to-70b", "ministral-3b-to-8b",
                                      "qwen3-14b-to-32b", "qwen3-32b-to-14b", "qwen3-8b-to-32b"}));
  for (const std::string& name : SynthPresetNames()) {
    absl::StatusOr<SynthOptions> preset = SynthPreset(name);
    ASSERT_TRUE(preset.ok()) << name << ": " << preset.status();
    absl::StatusOr<Manifest> m = SynthManifest(*preset);
    ASSERT_TRUE(m.ok()) << name << ": " << m.status();
  }
  // SPEC 6: 2 L_t n_t (k n_s d_s) d_t weight parameters (+ biases 2 L_t n_t d_t).
  auto weights_only = [](const char* preset) {
    const Manifest m = *SynthManifest(*SynthPreset(preset));
    return MapperNumParams(m) - 2LL * m.target.num_layers * m.target.num_kv_heads * m.target.head_dim;
  };
  EXPECT_EQ(weights_only("qwen3-14b-to-32b"), 1073741824LL);  // 1.07 B
  EXPECT_EQ(weights_only("qwen3-8b-to-32b"), 1610612736LL);   // 1.61 B
  EXPECT_EQ(weights_only("llama3.1-8b-to-70b"), 3355443200LL);  // 3.36 B

  const SynthOptions qwen = *SynthPreset("qwen3-32b-to-14b");
  EXPECT_EQ(qwen.source.name, "Qwen/Qwen3-32B");
  EXPECT_EQ(qwen.source.num_layers, 64);
  EXPECT_EQ(qwen.target.num_layers, 40);
  EXPECT_EQ(qwen.target.rope.theta, 1e6);
  EXPECT_EQ(qwen.k, 8);
  EXPECT_EQ(qwen.dtype, DType::kBF16);
  const SynthOptions llama = *SynthPreset("llama3.1-8b-to-70b");
  EXPECT_EQ(llama.target.num_layers, 80);
  EXPECT_EQ(llama.target.rope.scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(llama.target.rope.scaling.factor, 8);
  EXPECT_EQ(llama.target.rope.theta, 500000);
  EXPECT_EQ(SynthManifest(*SynthPreset("ministral-3b-to-8b"))->k, 26);  // k = all

  const SynthOptions tiny = *SynthPreset("demo-tiny");
  EXPECT_EQ(tiny.source.num_layers, 4);
  EXPECT_EQ(tiny.target.num_layers, 6);
  EXPECT_EQ(tiny.source.num_kv_heads, 2);
  EXPECT_EQ(tiny.source.head_dim, 32);
  EXPECT_EQ(tiny.k, 2);
  EXPECT_EQ(tiny.dtype, DType::kFP32);

  KVT_EXPECT_ERROR(SynthPreset("qwen3-1b-to-2b"), StatusCode::kNotFound,
                   "unknown synth preset 'qwen3-1b-to-2b'");
  EXPECT_EQ(KnownModelSpec("Qwen/Qwen3-8B")->num_layers, 36);
  KVT_EXPECT_ERROR(KnownModelSpec("gpt2"), StatusCode::kNotFound, "unknown model 'gpt2'");
}

TEST(SynthTest, DemoTinyWritesAndLoads) {
  const std::string dir = JoinPath(testing::MakeTempDir("synth_tiny"), "demo");
  KVT_ASSERT_OK(WriteSynthMapper(dir, *SynthPreset("demo-tiny")));
  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(dir);
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  EXPECT_TRUE((*mapper)->manifest().synthetic);
  EXPECT_EQ((*mapper)->view().layers.size(), 6u);
  EXPECT_EQ((*mapper)->view().layers[0].w_k.rows, 2 * 2 * 32);
  EXPECT_EQ((*mapper)->view().layers[0].w_k.cols, 2 * 32);
}

// kind: mlp from the same generator: both granularities load, and the He scaling keeps the
// hidden activations and the outputs O(1) for unit-variance inputs (checked through the float64
// reference on a random cache: E[y^2] is 1 in expectation).
TEST(SynthTest, MlpMappersLoadAndKeepTheScale) {
  for (MlpGranularity granularity : {MlpGranularity::kPerLayer, MlpGranularity::kPerHead}) {
    SCOPED_TRACE(MlpGranularityName(granularity));
    SynthOptions o = Small(9);
    o.dtype = DType::kFP32;
    o.mlp = MlpConfig{128, granularity};
    const std::string dir = JoinPath(testing::MakeTempDir("synth_mlp"), "m");
    KVT_ASSERT_OK(WriteSynthMapper(dir, o));
    absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const Manifest& m = (*loaded)->manifest();
    EXPECT_EQ(m.kind, MapperKind::kMlp);
    EXPECT_EQ(m.mlp->hidden, 128);
    EXPECT_EQ(m.mlp->granularity, granularity);
    EXPECT_TRUE(m.synthetic);
    EXPECT_EQ((*loaded)->view().kind, MapKind::kMlp);
    EXPECT_EQ((*loaded)->view().layers[2].mlp_v.heads,
              granularity == MlpGranularity::kPerHead ? 2 : 1);

    const kvt::testing::OwnedCache cache =
        kvt::testing::MakeRandomCache(5, 2, 16, 64, DType::kFP32, Layout::kHND, 3);
    for (int layer = 0; layer < 3; ++layer) {
      for (kvt::testing::Kind kind : {kvt::testing::Kind::kK, kvt::testing::Kind::kV}) {
        const std::vector<double> y = kvt::testing::ReferenceTranslate(
            (*loaded)->view(), layer, kind, cache.view, Positions());
        double sum_sq = 0;
        for (double v : y) sum_sq += v * v;
        const double mean_sq = sum_sq / y.size();
        EXPECT_GT(mean_sq, 0.4) << "layer " << layer;
        EXPECT_LT(mean_sq, 2.5) << "layer " << layer;
      }
    }
  }
  // Same seed, same bytes; and an MLP is not the ridge mapper of the same seed.
  SynthOptions o = Small(4);
  o.mlp = MlpConfig{8, MlpGranularity::kPerLayer};
  const std::string root = testing::MakeTempDir("synth_mlp_det");
  KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root, "a"), o));
  KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root, "b"), o));
  EXPECT_EQ(*ReadFileToString(JoinPath(root, "a/weights.safetensors")),
            *ReadFileToString(JoinPath(root, "b/weights.safetensors")));
  o.mlp->hidden = 0;
  KVT_EXPECT_ERROR(SynthManifest(o), StatusCode::kInvalidArgument, "mlp hidden must be >= 1");
}

// Head-local ridge: n_s = n_t, 2 n_t and n_t / 2; loads as a head_local view whose outputs keep
// the input scale (fan_in = window |sigma| g d_s), deterministic, and refused with kind mlp.
TEST(SynthTest, RidgePerHeadLoadsAndKeepsTheScale) {
  for (int target_heads : {2, 1, 4}) {
    SCOPED_TRACE(absl::StrCat("target heads ", target_heads));
    SynthOptions o = Small(12);
    o.dtype = DType::kFP32;
    o.weight_scale = 1.0;
    o.window = target_heads == 1 ? 2 : 1;
    o.target = NeoxModelSpec("t", 3, target_heads, 16);
    o.ridge_granularity = RidgeGranularity::kPerHead;
    const std::string dir = JoinPath(testing::MakeTempDir("synth_per_head"), "m");
    KVT_ASSERT_OK(WriteSynthMapper(dir, o));
    absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ((*loaded)->manifest().ridge_granularity, RidgeGranularity::kPerHead);
    EXPECT_TRUE((*loaded)->view().head_local);
    const kvt::testing::OwnedCache cache =
        kvt::testing::MakeRandomCache(5, 2, 16, 64, DType::kFP32, Layout::kHND, 3);
    for (int layer = 0; layer < 3; ++layer) {
      const std::vector<double> y = kvt::testing::ReferenceTranslate(
          (*loaded)->view(), layer, kvt::testing::Kind::kV, cache.view, Positions());
      double sum_sq = 0;
      for (double v : y) sum_sq += v * v;
      const double mean_sq = sum_sq / y.size();
      EXPECT_GT(mean_sq, 0.4) << "layer " << layer;
      EXPECT_LT(mean_sq, 2.5) << "layer " << layer;
    }
    absl::StatusOr<std::unique_ptr<InMemoryMapper>> in_memory = MakeSynthMapperInMemory(o);
    ASSERT_TRUE(in_memory.ok()) << in_memory.status();
    EXPECT_TRUE((*in_memory)->view.head_local);
  }
  SynthOptions o = Small(4);
  o.ridge_granularity = RidgeGranularity::kPerHead;
  o.mlp = MlpConfig{8, MlpGranularity::kPerLayer};
  KVT_EXPECT_ERROR(SynthManifest(o), StatusCode::kInvalidArgument,
                   "ridge.granularity per_head is only valid with kind: ridge");
  o.mlp.reset();
  o.target = NeoxModelSpec("t", 3, 3, 16);
  KVT_EXPECT_ERROR(SynthManifest(o), StatusCode::kInvalidArgument,
                   "source.num_kv_heads=2 and target.num_kv_heads=3");
}

TEST(SynthTest, BadOptionsAreNamed) {
  SynthOptions o = Small(1);
  o.k = 6;
  KVT_EXPECT_ERROR(SynthManifest(o), StatusCode::kInvalidArgument,
                   "k = 6 must be between 1 and source.num_layers (5)");
  o = Small(1);
  o.weight_scale = 0;
  KVT_EXPECT_ERROR(SynthManifest(o), StatusCode::kInvalidArgument, "weight_scale must be > 0");
  o = Small(1);
  o.target.rope.rotary_dim = 15;
  KVT_EXPECT_ERROR(SynthManifest(o), StatusCode::kInvalidArgument, "target.rope");
}

}  // namespace
}  // namespace kvt
