#include "mapper_store/mapper.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/checksum.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/dtype.h"
#include "mapper_store/format/test_util.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

// Source 3 layers x 2 heads x 4, target 2 layers x 1 head x 8 (unmatched on purpose), k = 2.
Manifest SmallManifest(DType dtype) {
  Manifest m;
  m.source = NeoxModelSpec("test/src", 3, 2, 4);
  m.target = NeoxModelSpec("test/tgt", 2, 1, 8);
  m.k = 2;
  m.weights_dtype = dtype;
  m.layers = {{0, {2, 0}, {1}, 0.9, 0.8, std::nullopt, std::nullopt},
              {1, {1}, {0, 2}, std::nullopt, std::nullopt, std::nullopt, std::nullopt}};
  m.calibration_yaml = "sequences: 4\n";
  m.created_by = "mapper_test";
  return m;
}

// Owns the bytes of a mapper's tensors: element i of tensor t holds (t + 1) + i / 64.
struct Tensors {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<TensorRef> refs;
};

Tensors MakeTensors(const std::vector<TensorSpec>& specs) {
  Tensors t;
  t.storage.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    std::vector<float> values(specs[i].num_elements());
    for (size_t e = 0; e < values.size(); ++e) values[e] = (i + 1) + e / 64.0f;
    t.storage.emplace_back(specs[i].num_bytes());
    FromFloat(specs[i].dtype, values.data(), t.storage.back().data(),
              static_cast<int64_t>(values.size()));
    t.refs.push_back({specs[i], {t.storage.back().data(), t.storage.back().size()}});
  }
  return t;
}

// Rewrites SHA256SUMS to match the files, so a test reaches the validator behind the checksums.
void Reseal(const std::string& dir, const std::string& weights = kDefaultWeightsFileName) {
  const std::string sums = FormatSha256Sums(
      {{*Sha256OfFile(JoinPath(dir, kManifestFileName)), kManifestFileName},
       {*Sha256OfFile(JoinPath(dir, weights)), weights}});
  ASSERT_TRUE(WriteStringToFile(JoinPath(dir, kChecksumFileName), sums).ok());
}

class MapperTest : public ::testing::Test {
 protected:
  // Writes a good mapper and returns its directory.
  std::string WriteGood(DType dtype = DType::kFP32, const std::string& name = "good") {
    const Manifest m = SmallManifest(dtype);
    Tensors t = MakeTensors(MapperTensorSpecs(m));
    const std::string dir = JoinPath(root_, name);
    absl::Status s = WriteMapperDir(dir, m, t.refs);
    EXPECT_TRUE(s.ok()) << s;
    return dir;
  }

  // Replaces the weights file with `specs` (built like MakeTensors) and reseals.
  void ReplaceWeights(const std::string& dir, const std::vector<TensorSpec>& specs) {
    Tensors t = MakeTensors(specs);
    ASSERT_TRUE(WriteSafetensors(JoinPath(dir, kDefaultWeightsFileName), t.refs).ok());
    Reseal(dir);
  }

  void EditManifest(const std::string& dir, const std::string& from, const std::string& to,
                    bool reseal = true) {
    const std::string path = JoinPath(dir, kManifestFileName);
    std::string text = *ReadFileToString(path);
    ASSERT_NE(text.find(from), std::string::npos) << from << " not in\n" << text;
    text = absl::StrReplaceAll(text, {{from, to}});
    ASSERT_TRUE(WriteStringToFile(path, text).ok());
    if (reseal) Reseal(dir);
  }

  std::string root_ = testing::MakeTempDir("mapper");
};

// Ridge: one [k, n] per kind and layer (k = |sigma| n_s d_s = 8 per source layer here);
// an MLP adds its hidden layers, a per-head stack counts once.
TEST(MapperGemmShapesTest, DistinctMatricesOfTheManifest) {
  Manifest m = SmallManifest(DType::kBF16);
  EXPECT_EQ(MapperGemmShapes(m), std::vector<GemmShape>({{16, 8}, {8, 8}}));
  m.kind = MapperKind::kMlp;
  m.mlp = MlpConfig{6, MlpGranularity::kPerLayer};
  EXPECT_EQ(MapperGemmShapes(m),
            std::vector<GemmShape>({{16, 6}, {6, 6}, {6, 8}, {8, 6}}));
  m.target = NeoxModelSpec("test/tgt", 2, 2, 4);
  m.mlp->granularity = MlpGranularity::kPerHead;
  EXPECT_EQ(MapperGemmShapes(m),
            std::vector<GemmShape>({{16, 6}, {6, 6}, {6, 4}, {8, 6}}));
}

TEST_F(MapperTest, WriteThenLoadRoundTripsEveryDType) {
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const Manifest m = SmallManifest(dtype);
    Tensors t = MakeTensors(MapperTensorSpecs(m));
    const std::string dir = JoinPath(root_, absl::StrCat("rt_", DTypeName(dtype)));
    KVT_ASSERT_OK(WriteMapperDir(dir, m, t.refs));

    absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir + "/");
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const LoadedMapper& mapper = **loaded;
    EXPECT_EQ(mapper.id(), absl::StrCat("rt_", DTypeName(dtype)));
    EXPECT_EQ(mapper.path(), dir);
    EXPECT_EQ(*EmitManifest(mapper.manifest()), *EmitManifest(m));
    // 2 layers x (K: [2*2*4 or 1*8, 8] + V + two biases of 8).
    const int64_t params = (16 * 8 + 8 + 8 * 8 + 8) + (8 * 8 + 8 + 16 * 8 + 8);
    EXPECT_EQ(mapper.num_params(), params);
    EXPECT_EQ(MapperNumParams(m), params);
    EXPECT_EQ(mapper.weight_bytes(), params * DTypeSize(dtype));
    EXPECT_EQ(MapperWeightBytes(m), params * DTypeSize(dtype));

    const MapperView& view = mapper.view();
    EXPECT_EQ(view.source.name, "test/src");
    EXPECT_EQ(view.target.head_dim, 8);
    ASSERT_EQ(view.layers.size(), 2u);
    EXPECT_EQ(view.layers[0].sigma_k, (std::vector<int>{2, 0}));
    EXPECT_EQ(view.layers[1].sigma_v, (std::vector<int>{0, 2}));
    const WeightView& w = view.layers[0].w_k;
    EXPECT_EQ(w.rows, 16);
    EXPECT_EQ(w.cols, 8);
    EXPECT_EQ(w.dtype, dtype);
    EXPECT_EQ(view.layers[0].b_k.rows, 1);
    EXPECT_EQ(view.layers[0].b_k.cols, 8);
    EXPECT_EQ(view.layers[1].w_v.rows, 16);
    // Bytes are the ones written, and the view points into the mapper's own buffer.
    EXPECT_EQ(0, std::memcmp(w.data, t.storage[0].data(), t.storage[0].size()));
    EXPECT_EQ(0, std::memcmp(view.layers[1].b_v.data, t.storage[7].data(), t.storage[7].size()));
    EXPECT_EQ(LoadAsDouble(dtype, view.layers[0].b_k.data, 0), 2.0);
    const uint8_t* base = mapper.weights().data_section();
    EXPECT_GE(static_cast<const uint8_t*>(w.data), base);
    EXPECT_LT(static_cast<const uint8_t*>(w.data), base + mapper.weight_bytes());

    // SHA256SUMS in sha256sum format, covering both files.
    const std::string sums = *ReadFileToString(JoinPath(dir, kChecksumFileName));
    EXPECT_EQ(sums, absl::StrCat(*Sha256OfFile(JoinPath(dir, kManifestFileName)), "  manifest.yaml\n",
                                 *Sha256OfFile(JoinPath(dir, kDefaultWeightsFileName)),
                                 "  weights.safetensors\n"));
    // The verified weights' hash identifies this version of the mapper.
    EXPECT_EQ(mapper.weights_sha256(), *Sha256OfFile(JoinPath(dir, kDefaultWeightsFileName)));
  }
  // No temporary directories left behind.
  absl::StatusOr<std::vector<std::string>> dirs = ListSubdirectories(root_);
  ASSERT_TRUE(dirs.ok());
  EXPECT_EQ(dirs->size(), 3u);
}

TEST_F(MapperTest, StreamingWriterMatchesInMemoryWriter) {
  const Manifest m = SmallManifest(DType::kBF16);
  const std::vector<TensorSpec> specs = MapperTensorSpecs(m);
  Tensors t = MakeTensors(specs);
  KVT_ASSERT_OK(WriteMapperDir(JoinPath(root_, "a"), m, t.refs));
  KVT_ASSERT_OK(WriteMapperDir(JoinPath(root_, "b"), m, specs,
                               [&](size_t i, absl::Span<uint8_t> dst) {
                                 std::memcpy(dst.data(), t.storage[i].data(), dst.size());
                                 return absl::OkStatus();
                               }));
  EXPECT_EQ(*ReadFileToString(JoinPath(root_, "a/SHA256SUMS")),
            *ReadFileToString(JoinPath(root_, "b/SHA256SUMS")));
}

TEST_F(MapperTest, StatsTensorsAreKeptButIgnored) {
  const std::string dir = WriteGood();
  std::vector<TensorSpec> specs = MapperTensorSpecs(SmallManifest(DType::kFP32));
  specs.push_back({"stats.source.0.k.mean", DType::kFP32, {8}});
  ReplaceWeights(dir, specs);
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_NE((*loaded)->weights().Find("stats.source.0.k.mean"), nullptr);
  EXPECT_EQ((*loaded)->weight_bytes(), MapperWeightBytes((*loaded)->manifest()) + 32);
}

TEST_F(MapperTest, CustomAllocatorHoldsTheWeights) {
  const std::string dir = WriteGood();
  int calls = 0;
  LoadOptions options;
  options.allocator = [&calls](size_t size) {
    ++calls;
    return HostBuffer::Allocate(size, 4096);
  };
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir, options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*loaded)->view().layers[0].w_k.data) % 4096, 0u);
}

// ---- Each validator error, named. ----

TEST_F(MapperTest, MissingTensor) {
  const std::string dir = WriteGood();
  std::vector<TensorSpec> specs = MapperTensorSpecs(SmallManifest(DType::kFP32));
  specs.pop_back();
  ReplaceWeights(dir, specs);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "missing tensor 'layers.1.v.bias'");
}

TEST_F(MapperTest, MisnamedTensorReportsMissingAndUnexpected) {
  const std::string dir = WriteGood();
  std::vector<TensorSpec> specs = MapperTensorSpecs(SmallManifest(DType::kFP32));
  specs[1].name = "layers.0.k.b";
  ReplaceWeights(dir, specs);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "missing tensor 'layers.0.k.bias'; the file has unexpected tensors "
                   "'layers.0.k.b'");
}

TEST_F(MapperTest, ExtraTensor) {
  const std::string dir = WriteGood();
  std::vector<TensorSpec> specs = MapperTensorSpecs(SmallManifest(DType::kFP32));
  specs.push_back({"layers.2.k.weight", DType::kFP32, {2, 2}});
  ReplaceWeights(dir, specs);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "extra tensor 'layers.2.k.weight'");
}

TEST_F(MapperTest, WrongShape) {
  const std::string dir = WriteGood();
  std::vector<TensorSpec> specs = MapperTensorSpecs(SmallManifest(DType::kFP32));
  specs[2].shape = {16, 8};  // layers.0.v.weight: sigma_v has 1 entry -> [8, 8]
  ReplaceWeights(dir, specs);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "tensor 'layers.0.v.weight' has shape [16, 8] but the manifest requires [8, 8]");
}

// A window mapper's weights have window x the token-wise rows (offset-major); the view carries
// the window, and a token-wise weights file under a `window: 3` manifest is refused by shape.
TEST_F(MapperTest, WindowMapperShapesAndView) {
  Manifest m = SmallManifest(DType::kFP32);
  m.window = 3;
  const std::vector<TensorSpec> specs = MapperTensorSpecs(m);
  EXPECT_EQ(specs[0].shape, (std::vector<int64_t>{3 * 2 * 2 * 4, 8}));  // layers.0.k.weight
  EXPECT_EQ(specs[2].shape, (std::vector<int64_t>{3 * 1 * 2 * 4, 8}));  // layers.0.v.weight
  Tensors t = MakeTensors(specs);
  const std::string dir = JoinPath(root_, "window");
  ASSERT_TRUE(WriteMapperDir(dir, m, t.refs).ok());
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->view().window, 3);
  EXPECT_EQ((*loaded)->view().layers[0].w_k.rows, 48);
  ReplaceWeights(dir, MapperTensorSpecs(SmallManifest(DType::kFP32)));
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "tensor 'layers.0.k.weight' has shape [16, 8] but the manifest requires [48, 8] "
                   "(window 3 x rows = len(sigma)");
}

// Head-local ridge: [n_t, window |sigma| g d_s, d_t] weights and [n_t, d_t] biases, the view
// flagged head_local with the heads stacked along rows; a per_layer file is refused by shape.
TEST_F(MapperTest, RidgePerHeadShapesViewAndBytes) {
  Manifest m = SmallManifest(DType::kBF16);
  // n_t = 2 n_s: target heads 2h, 2h+1 read source head h.
  m.target = NeoxModelSpec("test/tgt", 2, 4, 2);
  m.window = 2;
  m.ridge_granularity = RidgeGranularity::kPerHead;
  const std::vector<TensorSpec> specs = MapperTensorSpecs(m);
  using Shape = std::vector<int64_t>;
  ASSERT_EQ(specs.size(), 8u);
  EXPECT_EQ(specs[0].name, "layers.0.k.weight");
  EXPECT_EQ(specs[0].shape, (Shape{4, 2 * 2 * 1 * 4, 2}));  // window 2 x |sigma_k| 2 x g 1 x 4
  EXPECT_EQ(specs[1].shape, (Shape{4, 2}));
  EXPECT_EQ(specs[2].shape, (Shape{4, 2 * 1 * 1 * 4, 2}));
  const int64_t params = 2 * (4 * 16 * 2 + 8 + 4 * 8 * 2 + 8);
  EXPECT_EQ(MapperNumParams(m), params);
  EXPECT_EQ(MapperWeightBytes(m), static_cast<uint64_t>(params) * 2);

  Tensors t = MakeTensors(specs);
  const std::string dir = JoinPath(root_, "per_head");
  KVT_ASSERT_OK(WriteMapperDir(dir, m, t.refs));
  EXPECT_NE(ReadFileToString(JoinPath(dir, kManifestFileName))->find("ridge: {granularity: per_head}"),
            std::string::npos);
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->weight_bytes(), static_cast<uint64_t>(params) * 2);
  const MapperView& view = (*loaded)->view();
  EXPECT_TRUE(view.head_local);
  EXPECT_EQ(view.layers[0].w_k.rows, 4 * 16);
  EXPECT_EQ(view.layers[0].w_k.cols, 2);
  EXPECT_EQ(view.layers[0].b_k.rows, 4);
  EXPECT_EQ(view.layers[0].b_k.cols, 2);
  KVT_EXPECT_OK(CheckMapperView(view));

  // Two source heads per target head: g = 2.
  Manifest two = SmallManifest(DType::kFP32);
  two.ridge_granularity = RidgeGranularity::kPerHead;
  EXPECT_EQ(MapperTensorSpecs(two)[0].shape, (Shape{1, 2 * 2 * 4, 8}));

  m.ridge_granularity = RidgeGranularity::kPerLayer;
  ReplaceWeights(dir, MapperTensorSpecs(m));
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "tensor 'layers.0.k.weight' has shape [32, 8] but the manifest requires "
                   "[4, 16, 2] (window 2 x ridge.granularity per_head");
}

TEST_F(MapperTest, WrongDType) {
  const std::string dir = WriteGood(DType::kBF16);
  std::vector<TensorSpec> specs = MapperTensorSpecs(SmallManifest(DType::kBF16));
  specs[3].dtype = DType::kFP16;
  ReplaceWeights(dir, specs);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "tensor 'layers.0.v.bias' has dtype F16 but the manifest's weights.dtype is bf16");
}

TEST_F(MapperTest, SigmaOutOfRange) {
  const std::string dir = WriteGood();
  EditManifest(dir, "sigma_k: [2, 0]", "sigma_k: [3, 0]");
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "manifest.yaml:21: layers[0].sigma_k[0] = 3 is out of range: "
                   "source.num_layers is 3 (target layer 0)");
}

TEST_F(MapperTest, WeightsChecksumMismatch) {
  const std::string dir = WriteGood();
  const std::string path = JoinPath(dir, kDefaultWeightsFileName);
  std::string bytes = *ReadFileToString(path);
  bytes[bytes.size() - 5] ^= 0x01;
  ASSERT_TRUE(WriteStringToFile(path, bytes).ok());
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kDataLoss,
                   absl::StrCat("checksum mismatch for ", path));
  LoadOptions no_check;
  no_check.verify_checksums = false;
  KVT_EXPECT_OK(LoadMapperDir(dir, no_check).status());
}

TEST_F(MapperTest, ManifestChecksumMismatch) {
  const std::string dir = WriteGood();
  EditManifest(dir, "kind: ridge", "kind: ridge  # edited", /*reseal=*/false);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kDataLoss,
                   "checksum mismatch for manifest.yaml");
}

TEST_F(MapperTest, TruncatedWeights) {
  const std::string dir = WriteGood();
  const std::string path = JoinPath(dir, kDefaultWeightsFileName);
  const std::string bytes = *ReadFileToString(path);
  ASSERT_TRUE(WriteStringToFile(path, bytes.substr(0, bytes.size() - 100)).ok());
  // Unsealed: both the checksum and the truncation are reported.
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kDataLoss, "checksum mismatch");
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kDataLoss, "truncated");
  // Resealed (e.g. a copy tool that wrote new sums): still refused as truncated.
  Reseal(dir);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kDataLoss, "safetensors file truncated");
}

TEST_F(MapperTest, UnsupportedFormatVersion) {
  const std::string dir = WriteGood();
  EditManifest(dir, "format_version: 1", "format_version: 2");
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "manifest.yaml:1: unsupported format_version 2");
}

TEST_F(MapperTest, UnknownManifestKeyWithLine) {
  const std::string dir = WriteGood();
  EditManifest(dir, "synthetic: false\n", "synthetic: false\nsynthetik: true\n");
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   absl::StrCat(dir, ": manifest.yaml:4: unknown key 'synthetik'"));
}

TEST_F(MapperTest, MissingOrIncompleteChecksumFile) {
  const std::string dir = WriteGood();
  const std::string sums_path = JoinPath(dir, kChecksumFileName);
  const std::string sums = *ReadFileToString(sums_path);
  ASSERT_TRUE(WriteStringToFile(sums_path, sums.substr(0, sums.find('\n') + 1)).ok());
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kFailedPrecondition,
                   "SHA256SUMS has no entry for weights.safetensors");
  ASSERT_TRUE(RemoveTree(sums_path).ok());
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kNotFound, "missing SHA256SUMS");
  KVT_EXPECT_ERROR(LoadMapperDir(JoinPath(root_, "nope")), StatusCode::kNotFound,
                   "not a mapper directory");
}

// ---- MLP mappers ----

// SmallManifest as kind: mlp, with 2 target heads x 4 so per_head has more than one chain.
Manifest SmallMlpManifest(DType dtype, MlpGranularity granularity, int64_t hidden = 5) {
  Manifest m = SmallManifest(dtype);
  m.kind = MapperKind::kMlp;
  m.mlp = MlpConfig{hidden, granularity};
  m.target = NeoxModelSpec("test/tgt", 2, 2, 4);
  return m;
}

TEST_F(MapperTest, MlpWriteThenLoadBothGranularities) {
  for (MlpGranularity granularity : {MlpGranularity::kPerLayer, MlpGranularity::kPerHead}) {
    const bool per_head = granularity == MlpGranularity::kPerHead;
    SCOPED_TRACE(MlpGranularityName(granularity));
    const Manifest m = SmallMlpManifest(DType::kBF16, granularity);
    const std::vector<TensorSpec> specs = MapperTensorSpecs(m);
    // Canonical order: layer by layer, k then v, fc1.weight, fc1.bias, fc2..., fc3...
    ASSERT_EQ(specs.size(), 2u * 2 * 6);
    EXPECT_EQ(specs[0].name, "layers.0.k.fc1.weight");
    EXPECT_EQ(specs[1].name, "layers.0.k.fc1.bias");
    EXPECT_EQ(specs[5].name, "layers.0.k.fc3.bias");
    EXPECT_EQ(specs[6].name, "layers.0.v.fc1.weight");
    EXPECT_EQ(specs[12].name, "layers.1.k.fc1.weight");
    // layer 0: sigma_k has 2 source layers of 2 heads x 4 -> in 16; sigma_v 1 -> in 8.
    using Shape = std::vector<int64_t>;
    if (per_head) {
      EXPECT_EQ(specs[0].shape, (Shape{2, 16, 5}));
      EXPECT_EQ(specs[1].shape, (Shape{2, 5}));
      EXPECT_EQ(specs[2].shape, (Shape{2, 5, 5}));
      EXPECT_EQ(specs[4].shape, (Shape{2, 5, 4}));
      EXPECT_EQ(specs[5].shape, (Shape{2, 4}));
      EXPECT_EQ(specs[6].shape, (Shape{2, 8, 5}));
    } else {
      EXPECT_EQ(specs[0].shape, (Shape{16, 5}));
      EXPECT_EQ(specs[1].shape, (Shape{5}));
      EXPECT_EQ(specs[2].shape, (Shape{5, 5}));
      EXPECT_EQ(specs[4].shape, (Shape{5, 8}));
      EXPECT_EQ(specs[5].shape, (Shape{8}));
      EXPECT_EQ(specs[6].shape, (Shape{8, 5}));
    }
    // Per chain: in*H + H + H*H + H + H*out + out, out = 8 (per_layer) or 2 heads x (.. 4).
    const auto chain = [&](int64_t in) {
      return per_head ? 2 * (in * 5 + 5 + 25 + 5 + 5 * 4 + 4) : in * 5 + 5 + 25 + 5 + 5 * 8 + 8;
    };
    const int64_t params = chain(16) + chain(8) + chain(8) + chain(16);
    EXPECT_EQ(MapperNumParams(m), params);
    EXPECT_EQ(MapperWeightBytes(m), static_cast<uint64_t>(params) * 2);

    Tensors t = MakeTensors(specs);
    const std::string dir = JoinPath(root_, absl::StrCat("mlp_", MlpGranularityName(granularity)));
    KVT_ASSERT_OK(WriteMapperDir(dir, m, t.refs));
    absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ((*loaded)->num_params(), params);
    EXPECT_EQ((*loaded)->weight_bytes(), static_cast<uint64_t>(params) * 2);
    EXPECT_EQ((*loaded)->manifest().mlp->granularity, granularity);
    const MapperView& view = (*loaded)->view();
    EXPECT_EQ(view.kind, MapKind::kMlp);
    const MlpView& k0 = view.layers[0].mlp_k;
    EXPECT_EQ(k0.heads, per_head ? 2 : 1);
    EXPECT_EQ(k0.hidden, 5);
    // Stacked per head along rows, as MlpView documents.
    EXPECT_EQ(k0.a1.rows, per_head ? 32 : 16);
    EXPECT_EQ(k0.a1.cols, 5);
    EXPECT_EQ(k0.c1.rows, per_head ? 2 : 1);
    EXPECT_EQ(k0.a2.rows, per_head ? 10 : 5);
    EXPECT_EQ(k0.a3.rows, per_head ? 10 : 5);
    EXPECT_EQ(k0.a3.cols, per_head ? 4 : 8);
    EXPECT_EQ(k0.c3.rows, per_head ? 2 : 1);
    EXPECT_EQ(k0.c3.cols, per_head ? 4 : 8);
    EXPECT_EQ(k0.a1.dtype, DType::kBF16);
    EXPECT_EQ(view.layers[1].mlp_v.a1.rows, per_head ? 32 : 16);
    EXPECT_EQ(view.layers[0].w_k.data, nullptr);  // no ridge weights in an MLP view
    EXPECT_EQ(0, std::memcmp(k0.a1.data, t.storage[0].data(), t.storage[0].size()));
    EXPECT_EQ(0, std::memcmp(view.layers[1].mlp_v.c3.data, t.storage[23].data(),
                             t.storage[23].size()));

    // The streaming writer produces the same bytes.
    const std::string streamed = dir + "_streamed";
    KVT_ASSERT_OK(WriteMapperDir(streamed, m, specs, [&](size_t i, absl::Span<uint8_t> dst) {
      std::memcpy(dst.data(), t.storage[i].data(), dst.size());
      return absl::OkStatus();
    }));
    EXPECT_EQ(*ReadFileToString(JoinPath(streamed, kDefaultWeightsFileName)),
              *ReadFileToString(JoinPath(dir, kDefaultWeightsFileName)));
  }
}

TEST_F(MapperTest, MlpTensorErrorsNameTensorAndShape) {
  const Manifest m = SmallMlpManifest(DType::kFP32, MlpGranularity::kPerHead);
  const std::string dir = JoinPath(root_, "mlp_bad");
  Tensors t = MakeTensors(MapperTensorSpecs(m));
  KVT_ASSERT_OK(WriteMapperDir(dir, m, t.refs));
  ASSERT_TRUE(LoadMapperDir(dir).ok());

  std::vector<TensorSpec> specs = MapperTensorSpecs(m);
  specs[8].shape = {5, 5};  // layers.0.v.fc2.weight without its head dimension
  ReplaceWeights(dir, specs);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "tensor 'layers.0.v.fc2.weight' has shape [5, 5] but the manifest requires "
                   "[2, 5, 5] (mlp.granularity per_head, mlp.hidden H = 5");

  specs = MapperTensorSpecs(m);
  specs.erase(specs.begin() + 17);  // layers.1.k.fc3.bias
  ReplaceWeights(dir, specs);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "missing tensor 'layers.1.k.fc3.bias'");

  // A ridge weights file under an mlp manifest: missing MLP tensors, the ridge ones unexpected.
  ReplaceWeights(dir, MapperTensorSpecs(SmallManifest(DType::kFP32)));
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "missing tensor 'layers.0.k.fc1.weight' (and 23 more); the file has "
                   "unexpected tensors 'layers.0.k.");

  // Every tensor present plus one more.
  specs = MapperTensorSpecs(m);
  specs.push_back({"layers.0.k.fc4.weight", DType::kFP32, {5, 5}});
  ReplaceWeights(dir, specs);
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "extra tensor 'layers.0.k.fc4.weight': an mlp mapper holds only");

  // The manifest's hidden and granularity decide the shapes.
  ReplaceWeights(dir, MapperTensorSpecs(m));
  EditManifest(dir, "hidden: 5", "hidden: 6");
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "tensor 'layers.0.k.fc1.weight' has shape [2, 16, 5] but the manifest "
                   "requires [2, 16, 6]");
  EditManifest(dir, "hidden: 6, granularity: per_head", "hidden: 5, granularity: per_layer");
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "tensor 'layers.0.k.fc1.weight' has shape [2, 16, 5] but the manifest "
                   "requires [16, 5] (mlp.granularity per_layer");
  EditManifest(dir, "kind: mlp", "kind: ridge");
  KVT_EXPECT_ERROR(LoadMapperDir(dir), StatusCode::kInvalidArgument,
                   "key 'mlp' is only valid with kind: mlp");
}

// ---- Writer ----

TEST_F(MapperTest, WriterRefusesInvalidInputAndLeavesNothing) {
  const Manifest m = SmallManifest(DType::kFP32);
  std::vector<TensorSpec> specs = MapperTensorSpecs(m);
  specs.pop_back();
  Tensors t = MakeTensors(specs);
  const std::string dir = JoinPath(root_, "refused");
  KVT_EXPECT_ERROR(WriteMapperDir(dir, m, t.refs), StatusCode::kInvalidArgument,
                   "missing tensor 'layers.1.v.bias'");
  Manifest bad = m;
  bad.layers[1].sigma_k = {7};
  Tensors full = MakeTensors(MapperTensorSpecs(m));
  KVT_EXPECT_ERROR(WriteMapperDir(dir, bad, full.refs), StatusCode::kInvalidArgument,
                   "out of range");
  // A failing filler aborts and cleans up its temporary directory.
  KVT_EXPECT_ERROR(WriteMapperDir(dir, m, MapperTensorSpecs(m),
                                  [](size_t i, absl::Span<uint8_t>) {
                                    return i == 3 ? absl::AbortedError("filler gave up")
                                                  : absl::OkStatus();
                                  }),
                   StatusCode::kAborted, "filler gave up");
  EXPECT_FALSE(PathExists(dir));
  EXPECT_TRUE(ListSubdirectories(root_)->empty());
}

TEST_F(MapperTest, WriterOverwritesOnlyWhenAsked) {
  const std::string dir = WriteGood(DType::kFP32, "same");
  const Manifest m = SmallManifest(DType::kBF16);
  Tensors t = MakeTensors(MapperTensorSpecs(m));
  KVT_EXPECT_ERROR(WriteMapperDir(dir, m, t.refs), StatusCode::kAlreadyExists, "already exists");
  WriteOptions overwrite;
  overwrite.overwrite = true;
  KVT_ASSERT_OK(WriteMapperDir(dir, m, t.refs, overwrite));
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->manifest().weights_dtype, DType::kBF16);
  EXPECT_EQ(ListSubdirectories(root_)->size(), 1u);
}

}  // namespace
}  // namespace kvt
