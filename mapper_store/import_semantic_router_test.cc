#include "mapper_store/import_semantic_router.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"

namespace kvt {
namespace {

using nlohmann::json;

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// A semantic-router artifact in memory, laid out as artifact.py writes it; tests edit it before
// writing it out.
struct Artifact {
  json manifest;
  std::map<std::string, Tensor> tensors;
};

struct ArtifactOptions {
  std::string variant = "full_head";
  bool compact_per_head = false;  // per_head W as [n, k d, d] instead of the dense block matrix
  int source_layers = 5;
  int target_layers = 3;
  int heads = 2;
  int head_dim = 4;
  int topk = 2;
  uint64_t seed = 11;
};

Artifact MakeArtifact(const ArtifactOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Artifact a;
  const int64_t n = o.heads, d = o.head_dim, width = n * d, k = o.topk;
  json selection = json::object();
  std::vector<int> all(o.source_layers);
  for (int j = 0; j < o.source_layers; ++j) all[j] = j;
  for (int l = 0; l < o.target_layers; ++l) {
    std::shuffle(all.begin(), all.end(), rng);
    selection[std::to_string(l)] = std::vector<int>(all.begin(), all.begin() + k);
    for (char kv : {'k', 'v'}) {
      const std::string prefix = absl::StrCat("target.", l, ".", std::string(1, kv));
      Tensor w;
      if (o.variant == "per_head" && o.compact_per_head) {
        w.shape = {n, k * d, d};
        for (int64_t i = 0; i < n * k * d * d; ++i) w.values.push_back(normal(rng));
      } else {
        w.shape = {k * width, width};
        for (int64_t r = 0; r < k * width; ++r) {
          for (int64_t c = 0; c < width; ++c) {
            const bool off_block = o.variant == "per_head" && (r / d) % n != c / d;
            w.values.push_back(off_block ? 0.0f : normal(rng));
          }
        }
      }
      Tensor b{{width}, {}};
      for (int64_t c = 0; c < width; ++c) b.values.push_back(0.1f * normal(rng));
      a.tensors[prefix + ".W"] = w;
      a.tensors[prefix + ".b"] = b;
    }
  }
  a.manifest = {{"mapper_id", "tiny-a-b-full_head-fp16-tp1-h2-sabc-tdef-b1"},
                {"compatibility",
                 {{"source_model", "org/tiny-a"},
                  {"source_revision", "abc123"},
                  {"target_model", "org/tiny-b"},
                  {"target_revision", "def456"},
                  {"variant", o.variant},
                  {"precision", "fp16"},
                  {"source_tp", 1},
                  {"target_tp", 1},
                  {"head_order", "contiguous"},
                  {"num_kv_heads", o.heads},
                  {"head_dim", o.head_dim}}},
                {"topk", o.topk},
                {"ridge_alpha", 0.01},
                {"centered_inputs", true},
                {"rope_stripped_on_keys", true},
                {"source_layers_per_target", {{"k", selection}, {"v", selection}}},
                {"calibration", {{"corpus", "synthetic"}, {"seed", 0}}},
                {"evaluation_report", nullptr},
                {"schema_version", 1}};
  return a;
}

void WriteFiles(const std::string& dir, const Artifact& a) {
  ASSERT_TRUE(MakeDirs(dir).ok());
  const std::string manifest = a.manifest.dump(2) + "\n";
  KVT_ASSERT_OK(WriteStringToFile(JoinPath(dir, "manifest.json"), manifest));
  std::vector<TensorRef> refs;
  for (const auto& [name, t] : a.tensors) {
    TensorRef ref;
    ref.spec = {name, DType::kFP32, t.shape};
    ref.bytes = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(t.values.data()),
                                          t.values.size() * sizeof(float));
    refs.push_back(ref);
  }
  absl::StatusOr<SafetensorsWriteResult> written =
      WriteSafetensors(JoinPath(dir, "weights.safetensors"), refs);
  ASSERT_TRUE(written.ok()) << written.status();
  absl::StatusOr<std::string> manifest_sum = Sha256Hex(manifest);
  ASSERT_TRUE(manifest_sum.ok());
  KVT_ASSERT_OK(
      WriteStringToFile(JoinPath(dir, "SHA256SUMS"),
                        FormatSha256Sums({{*manifest_sum, "manifest.json"},
                                          {written->sha256_hex, "weights.safetensors"}})));
}

SemanticRouterImportOptions Options(int source_layers = 5) {
  SemanticRouterImportOptions options;
  options.source_spec = NeoxModelSpec("", source_layers, 0, 0, 10000.0);
  options.target_spec = NeoxModelSpec("", 0, 0, 0, 1000000.0);
  return options;
}

class ImportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::MakeTempDir("import_semantic_router");
    in_ = JoinPath(root_, "in");
    out_ = JoinPath(root_, "out");
  }
  absl::StatusOr<SemanticRouterImportResult> Import(
      const Artifact& a, const SemanticRouterImportOptions& options = Options()) {
    WriteFiles(in_, a);
    return ImportSemanticRouterMapper(in_, out_, options);
  }

  std::string root_, in_, out_;
};

std::vector<float> TensorFloats(const LoadedMapper& mapper, const std::string& name) {
  const TensorInfo* info = mapper.weights().Find(name);
  EXPECT_NE(info, nullptr) << name;
  if (info == nullptr) return {};
  std::vector<float> out(info->spec.num_elements());
  ToFloat(info->spec.dtype, mapper.weights().data(*info).data(), out.data(), out.size());
  return out;
}

TEST_F(ImportTest, FullHeadRoundTripIsExactInFp32) {
  const Artifact a = MakeArtifact({});
  absl::StatusOr<SemanticRouterImportResult> result = Import(a);
  ASSERT_TRUE(result.ok()) << result.status();
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(out_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Manifest& m = (*loaded)->manifest();
  EXPECT_EQ(m.source.name, "org/tiny-a");
  EXPECT_EQ(m.target.name, "org/tiny-b");
  EXPECT_EQ(m.source.num_layers, 5);
  EXPECT_EQ(m.target.num_layers, 3);
  EXPECT_EQ(m.source.num_kv_heads, 2);
  EXPECT_EQ(m.target.head_dim, 4);
  EXPECT_EQ(m.target.rope.theta, 1000000.0);
  EXPECT_EQ(m.k, 2);
  EXPECT_EQ(m.lambda, 0.01);
  EXPECT_EQ(m.lambda_scale, LambdaScale::kSum);
  EXPECT_EQ(m.weights_dtype, DType::kFP32);
  EXPECT_NE(m.calibration_yaml.find("tiny-a-b-full_head"), std::string::npos) << m.calibration_yaml;
  EXPECT_NE(m.calibration_yaml.find("synthetic"), std::string::npos) << m.calibration_yaml;
  for (int l = 0; l < 3; ++l) {
    const std::vector<int> sigma =
        a.manifest["source_layers_per_target"]["k"][std::to_string(l)].get<std::vector<int>>();
    EXPECT_EQ(m.layers[l].sigma_k, sigma);
    EXPECT_EQ(m.layers[l].sigma_v, sigma);
    for (char kv : {'k', 'v'}) {
      for (bool bias : {false, true}) {
        const std::string from =
            absl::StrCat("target.", l, ".", std::string(1, kv), bias ? ".b" : ".W");
        EXPECT_EQ(TensorFloats(**loaded, MapperTensorName(l, kv, bias)), a.tensors.at(from).values)
            << from;
      }
    }
  }
}

TEST_F(ImportTest, Bf16OutputRoundsEachWeight) {
  const Artifact a = MakeArtifact({});
  SemanticRouterImportOptions options = Options();
  options.weights_dtype = DType::kBF16;
  ASSERT_TRUE(Import(a, options).ok());
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(out_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::vector<float> got = TensorFloats(**loaded, "layers.1.v.weight");
  const std::vector<float>& want = a.tensors.at("target.1.v.W").values;
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], BF16ToFloat(FloatToBF16(want[i]))) << i;
  }
}

// per_head is head-local (target head h from source head h of each selected layer): imported as
// kvt's ridge per_head, [n, k d, d] per target layer and K|V, n times smaller than dense. From a
// dense block matrix, head h's rows are its diagonal block's; the bias keeps its floats.
TEST_F(ImportTest, PerHeadDenseBlockMatrixIsStoredCompact) {
  ArtifactOptions o;
  o.variant = "per_head";
  const Artifact a = MakeArtifact(o);
  ASSERT_TRUE(Import(a).ok());
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(out_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->manifest().ridge_granularity, RidgeGranularity::kPerHead);
  EXPECT_TRUE((*loaded)->view().head_local);
  const int64_t n = 2, d = 4, k = 2, width = n * d;
  const std::vector<float> got = TensorFloats(**loaded, "layers.2.k.weight");
  const std::vector<float>& dense = a.tensors.at("target.2.k.W").values;
  ASSERT_EQ(got.size(), static_cast<size_t>(n * k * d * d));
  for (int64_t h = 0; h < n; ++h) {
    for (int64_t b = 0; b < k; ++b) {
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t o2 = 0; o2 < d; ++o2) {
          ASSERT_EQ(got[((h * k + b) * d + i) * d + o2],
                    dense[((b * n + h) * d + i) * width + h * d + o2])
              << "head " << h << " block " << b << " dim " << i << " col " << o2;
        }
      }
    }
  }
  EXPECT_EQ(TensorFloats(**loaded, "layers.2.k.bias"), a.tensors.at("target.2.k.b").values);
}

TEST_F(ImportTest, PerHeadCompactIsKeptCompact) {
  ArtifactOptions o;
  o.variant = "per_head";
  o.compact_per_head = true;
  o.heads = 3;
  o.head_dim = 2;
  o.topk = 3;
  const Artifact a = MakeArtifact(o);
  ASSERT_TRUE(Import(a).ok());
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(out_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->manifest().ridge_granularity, RidgeGranularity::kPerHead);
  // n * k d * d per tensor instead of the dense k n d * n d.
  EXPECT_EQ((*loaded)->num_params(), 3 * 2 * (3 * 3 * 2 * 2 + 3 * 2));
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(TensorFloats(**loaded, MapperTensorName(l, 'v', false)),
              a.tensors.at(absl::StrCat("target.", l, ".v.W")).values)
        << "layer " << l;
  }
}

TEST_F(ImportTest, PerHeadDenseMatrixWithCrossHeadWeightIsRefused) {
  ArtifactOptions o;
  o.variant = "per_head";
  Artifact a = MakeArtifact(o);
  a.tensors["target.1.k.W"].values[1 * 8 + 5] = 0.5f;  // row 1 (head 0) -> column 5 (head 1)
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "tensor 'target.1.k.W' is not per_head (compatibility.variant): element [1, 5]");
  EXPECT_FALSE(PathExists(out_));
}

TEST_F(ImportTest, ConfigJsonGivesShapesRopeAndNames) {
  const Artifact a = MakeArtifact({});
  const std::string source_cfg = JoinPath(root_, "source.json");
  const std::string target_cfg = JoinPath(root_, "target.json");
  KVT_ASSERT_OK(WriteStringToFile(
      source_cfg,
      R"({"_name_or_path": "local/a", "num_hidden_layers": 5, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 4, "rope_theta": 5000})"));
  KVT_ASSERT_OK(WriteStringToFile(
      target_cfg,
      R"({"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 4, "rope_theta": 1000000, "partial_rotary_factor": 0.5,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}})"));
  SemanticRouterImportOptions options;
  options.source_config = source_cfg;
  options.target_config = target_cfg;
  options.target_name = "serving/b";
  absl::StatusOr<SemanticRouterImportResult> result = Import(a, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->manifest.source.name, "org/tiny-a");  // the manifest's, not _name_or_path
  EXPECT_EQ(result->manifest.target.name, "serving/b");
  EXPECT_EQ(result->manifest.source.rope.theta, 5000.0);
  EXPECT_EQ(result->manifest.target.rope.rotary_dim, 2);
  EXPECT_EQ(result->manifest.target.rope.scaling.type, RopeScalingType::kLinear);
  EXPECT_TRUE(LoadMapperDir(out_).ok());
}

TEST_F(ImportTest, ConfigWithAnotherKvShapeIsRefused) {
  const Artifact a = MakeArtifact({});
  const std::string cfg = JoinPath(root_, "source.json");
  KVT_ASSERT_OK(WriteStringToFile(
      cfg, R"({"num_hidden_layers": 5, "num_key_value_heads": 4, "num_attention_heads": 8,
               "head_dim": 4})"));
  SemanticRouterImportOptions options = Options();
  options.source_config = cfg;
  KVT_EXPECT_ERROR(
      Import(a, options), absl::StatusCode::kInvalidArgument,
      "has 4 KV heads x head_dim 4 but manifest.json has compatibility.num_kv_heads 2");
}

TEST_F(ImportTest, TargetLayerCountMustMatchTheTargetModel) {
  const Artifact a = MakeArtifact({});
  SemanticRouterImportOptions options = Options();
  options.target_spec.num_layers = 4;
  KVT_EXPECT_ERROR(Import(a, options), absl::StatusCode::kInvalidArgument,
                   "source_layers_per_target has 3 target layers but the target model org/tiny-b "
                   "has 4");
}

TEST_F(ImportTest, SourceLayerIndexOutOfRange) {
  Artifact a = MakeArtifact({});
  a.manifest["source_layers_per_target"]["v"]["1"][1] = 7;
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "source_layers_per_target.v[\"1\"][1] = 7 is out of range: the source model "
                   "org/tiny-a has 5 layers");
}

TEST_F(ImportTest, TargetLayerKeysMustBeContiguous) {
  Artifact a = MakeArtifact({});
  json& k = a.manifest["source_layers_per_target"]["k"];
  k["5"] = k["2"];
  k.erase("2");
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "source_layers_per_target.k has no entry for target layer 2");
  k["x"] = k["5"];
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "source_layers_per_target.k has key 'x'");
}

TEST_F(ImportTest, SelectionErrorsNameTheEntry) {
  Artifact a = MakeArtifact({});
  a.manifest["source_layers_per_target"]["k"]["0"] = {1, 1};
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "source_layers_per_target.k[\"0\"] repeats source layer 1");
  a.manifest["source_layers_per_target"]["k"]["0"] = {1, 2, 3};
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "source_layers_per_target.k[\"0\"] has 3 source layers but topk is 2");
  a.manifest["source_layers_per_target"]["k"]["0"] = {1, -2};
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "key 'source_layers_per_target.k[\"0\"][1]' must be an integer >= 0, got -2");
}

TEST_F(ImportTest, MissingTensor) {
  Artifact a = MakeArtifact({});
  a.tensors.erase("target.2.v.b");
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument, "missing tensor 'target.2.v.b'");
}

TEST_F(ImportTest, UnexpectedTensor) {
  Artifact a = MakeArtifact({});
  a.tensors["target.3.k.W"] = a.tensors["target.0.k.W"];
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "unexpected tensor 'target.3.k.W'");
}

TEST_F(ImportTest, WrongShape) {
  Artifact a = MakeArtifact({});
  a.tensors["target.0.k.W"] = Tensor{{8, 8}, std::vector<float>(64, 0.0f)};
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "tensor 'target.0.k.W' has shape [8, 8] but the manifest requires [16, 8]");
  a = MakeArtifact({});
  a.tensors["target.1.v.b"] = Tensor{{1, 8}, std::vector<float>(8, 0.0f)};
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "tensor 'target.1.v.b' has shape [1, 8] but the manifest requires [8]");
}

TEST_F(ImportTest, NonFiniteWeight) {
  Artifact a = MakeArtifact({});
  a.tensors["target.1.k.b"].values[3] = std::nanf("");
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "tensor 'target.1.k.b' holds a non-finite value");
}

TEST_F(ImportTest, ChecksumMismatch) {
  WriteFiles(in_, MakeArtifact({}));
  // One flipped byte in the data section of the weights.
  const std::string weights = JoinPath(in_, "weights.safetensors");
  absl::StatusOr<std::string> bytes = ReadFileToString(weights);
  ASSERT_TRUE(bytes.ok());
  (*bytes)[bytes->size() - 3] ^= 0x40;
  KVT_ASSERT_OK(WriteStringToFile(weights, *bytes));
  KVT_EXPECT_ERROR(ImportSemanticRouterMapper(in_, out_, Options()), absl::StatusCode::kDataLoss,
                   "checksum mismatch for " + weights);
  // An edited manifest.
  WriteFiles(in_, MakeArtifact({}));
  const std::string manifest = JoinPath(in_, "manifest.json");
  absl::StatusOr<std::string> text = ReadFileToString(manifest);
  ASSERT_TRUE(text.ok());
  KVT_ASSERT_OK(WriteStringToFile(manifest, *text + " "));
  KVT_EXPECT_ERROR(ImportSemanticRouterMapper(in_, out_, Options()), absl::StatusCode::kDataLoss,
                   "checksum mismatch for " + manifest);
  EXPECT_FALSE(PathExists(out_));
}

TEST_F(ImportTest, MissingChecksumsOrEntries) {
  WriteFiles(in_, MakeArtifact({}));
  const std::string sums = JoinPath(in_, "SHA256SUMS");
  absl::StatusOr<std::string> text = ReadFileToString(sums);
  ASSERT_TRUE(text.ok());
  KVT_ASSERT_OK(WriteStringToFile(sums, text->substr(0, text->find('\n') + 1)));
  KVT_EXPECT_ERROR(ImportSemanticRouterMapper(in_, out_, Options()),
                   absl::StatusCode::kFailedPrecondition, "has no entry for weights.safetensors");
  KVT_ASSERT_OK(RemoveTree(sums));
  KVT_EXPECT_ERROR(ImportSemanticRouterMapper(in_, out_, Options()), absl::StatusCode::kNotFound,
                   "missing SHA256SUMS");
  KVT_EXPECT_ERROR(ImportSemanticRouterMapper(JoinPath(root_, "nope"), out_, Options()),
                   absl::StatusCode::kNotFound, "does not exist");
}

TEST_F(ImportTest, UnknownVariant) {
  Artifact a = MakeArtifact({});
  a.manifest["compatibility"]["variant"] = "per_group";
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "compatibility.variant 'per_group' is not supported (full_head, per_head)");
}

TEST_F(ImportTest, ManifestFieldErrors) {
  Artifact a = MakeArtifact({});
  a.manifest["compatibility"].erase("head_dim");
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "missing required key 'compatibility.head_dim'");
  a = MakeArtifact({});
  a.manifest["topk"] = "two";
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "key 'topk' must be an integer >= 1, got \"two\"");
  a = MakeArtifact({});
  a.manifest["compatibility"]["colour"] = "red";
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "unknown key 'compatibility.colour'");
  a = MakeArtifact({});
  a.manifest["compatibility"]["precision"] = "float128";
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "compatibility.precision 'float128' is not supported");
  a = MakeArtifact({});
  a.manifest["schema_version"] = 2;
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kInvalidArgument,
                   "schema_version 2 is not supported");
  a = MakeArtifact({});
  a.manifest["rope_stripped_on_keys"] = false;
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kUnimplemented, "rope_stripped_on_keys is false");
  a = MakeArtifact({});
  a.manifest["compatibility"]["head_order"] = "interleaved";
  KVT_EXPECT_ERROR(Import(a), absl::StatusCode::kUnimplemented,
                   "compatibility.head_order 'interleaved' is not supported");
}

TEST_F(ImportTest, ParseNeverThrows) {
  for (const char* text :
       {"", "{", "[]", "null", "{\"mapper_id\": 3}", "\xff\xfe", "{\"schema_version\": 1e400}",
        "{\"schema_version\": 18446744073709551615}"}) {
    absl::StatusOr<SemanticRouterManifest> parsed = ParseSemanticRouterManifest(text);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

TEST_F(ImportTest, ExistingDestinationNeedsOverwrite) {
  const Artifact a = MakeArtifact({});
  ASSERT_TRUE(Import(a).ok());
  KVT_EXPECT_ERROR(ImportSemanticRouterMapper(in_, out_, Options()),
                   absl::StatusCode::kAlreadyExists, "");
  SemanticRouterImportOptions options = Options();
  options.overwrite = true;
  EXPECT_TRUE(ImportSemanticRouterMapper(in_, out_, options).ok());
}

TEST_F(ImportTest, SourceModelNeedsLayersWithoutConfig) {
  KVT_EXPECT_ERROR(Import(MakeArtifact({}), Options(/*source_layers=*/0)),
                   absl::StatusCode::kInvalidArgument,
                   "source model: the semantic-router artifact does not store its layer count");
}

}  // namespace
}  // namespace kvt
