// The semantic-router kv_mapper import end to end: an artifact written by the committed Python
// writer (tools/write_semantic_router_mapper.py), converted by the `kvt import` process, loaded by
// the normal loader and translated by the CPU backend, checked against a float64 reference of the
// artifact's own semantics (pre-RoPE keys, x W + b, then target RoPE) read from the original
// files. Also the CLI's refusals of bad input.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "kernels/rope.h"
#include "kernels/testing/reference.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/hf_config.h"
#include "mapper_store/mapper.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"

namespace kvt {
namespace {

using ::kvt::testing::MakeTempDir;

using nlohmann::json;
using testing::Kind;

std::string Runfile(const std::string& path) {
  return absl::StrCat(std::getenv("TEST_SRCDIR"), "/kvt/", path);
}

struct RunResult {
  int rc = -1;
  std::string output;  // stdout and stderr
};

RunResult RunCommand(const std::vector<std::string>& argv) {
  std::vector<std::string> quoted;
  for (const std::string& arg : argv) quoted.push_back(absl::StrCat("'", arg, "'"));
  const std::string command = absl::StrCat(absl::StrJoin(quoted, " "), " 2>&1");
  RunResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  result.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// The writer needs numpy and safetensors: the project venv's python3 (scripts/bootstrap.sh
// --python), which scripts/test.sh puts first on PATH.
std::string PythonWithSafetensors() {
  for (const char* python : {"python3", "/usr/bin/python3"}) {
    if (RunCommand({python, "-c", "import numpy, safetensors.numpy"}).rc == 0) return python;
  }
  return "";
}

struct Case {
  std::string name;
  std::string variant = "full_head";
  std::string per_head_layout = "dense";
  std::string weight_dtype = "fp32";
  double tolerance = 1e-5;  // SPEC 3: fp32 1e-5, bf16 1e-2
};

class SemanticRouterImportTest : public ::testing::TestWithParam<Case> {};

// The artifact's float32 tensor as doubles.
std::vector<double> Floats(const SafetensorsFile& file, const std::string& name) {
  const TensorInfo* info = file.Find(name);
  EXPECT_NE(info, nullptr) << name;
  if (info == nullptr) return {};
  std::vector<float> f(info->spec.num_elements());
  std::memcpy(f.data(), file.data(*info).data(), f.size() * sizeof(float));
  return std::vector<double>(f.begin(), f.end());
}

TEST_P(SemanticRouterImportTest, ImportedMapperTranslatesLikeTheArtifact) {
  const Case& c = GetParam();
  const std::string python = PythonWithSafetensors();
  ASSERT_FALSE(python.empty()) << "no python3 with numpy and safetensors on PATH (run "
                                  "scripts/bootstrap.sh --python and put .venv/bin first on "
                                  "PATH, as scripts/test.sh does)";
  const std::string dir = MakeTempDir(c.name);
  const std::string in = JoinPath(dir, "artifact"), out = JoinPath(dir, "kvt");
  const std::string source_config = JoinPath(dir, "source/config.json");
  const std::string target_config = JoinPath(dir, "target/config.json");
  const int seed = static_cast<int>(testing::FreshSeed("semantic_router_import") % 100000);

  // Target: partial rotary with llama3 scaling, so a RoPE mistake on either side shows.
  RunResult wrote = RunCommand(
      {python,
       Runfile("tools/write_semantic_router_mapper.py"),
       "--out",
       in,
       "--variant",
       c.variant,
       "--per_head_layout",
       c.per_head_layout,
       "--source_layers",
       "5",
       "--target_layers",
       "4",
       "--num_kv_heads",
       "2",
       "--head_dim",
       "16",
       "--topk",
       "3",
       "--seed",
       std::to_string(seed),
       "--source_config",
       source_config,
       "--target_config",
       target_config,
       "--target_partial_rotary_factor",
       "0.5",
       "--target_rope_scaling",
       R"({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
           "original_max_position_embeddings": 64})"});
  ASSERT_EQ(wrote.rc, 0) << wrote.output;
  RunResult imported =
      RunCommand({Runfile("cli/kvt"), "import", "--format=semantic-router", "--in=" + in,
                  "--out=" + out, "--source_config=" + source_config,
                  "--target_config=" + target_config, "--weight_dtype=" + c.weight_dtype});
  ASSERT_EQ(imported.rc, 0) << imported.output;
  EXPECT_NE(imported.output.find("imported semantic-router mapper tiny-a-b-" + c.variant),
            std::string::npos)
      << imported.output;

  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(out);
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  const MapperView& view = (*mapper)->view();
  ASSERT_EQ(view.source.num_layers, 5);
  ASSERT_EQ(view.target.num_layers, 4);

  std::unique_ptr<Backend> backend = NewCpuBackend();
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend->Prepare(view);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  const int64_t tokens = 37;
  testing::OwnedCache source =
      testing::MakeRandomCache(5, 2, 16, tokens, DType::kFP32, Layout::kHND, seed + 1);
  testing::OwnedCache target =
      testing::MakeOutputCache(4, 2, 16, tokens, DType::kFP32, Layout::kNHD);
  Positions positions;
  positions.offset = 123457;
  ASSERT_TRUE(
      backend
          ->Translate(**prepared, source.view, positions, TranslateOptions(), &target.mutable_view)
          .ok());

  // The reference reads the original artifact and both config.json files, not the import.
  absl::StatusOr<std::string> manifest_text = ReadFileToString(JoinPath(in, "manifest.json"));
  ASSERT_TRUE(manifest_text.ok());
  const json manifest = json::parse(*manifest_text, nullptr, false);
  ASSERT_FALSE(manifest.is_discarded());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> weights =
      SafetensorsFile::Open(JoinPath(in, "weights.safetensors"));
  ASSERT_TRUE(weights.ok()) << weights.status();
  absl::StatusOr<ModelSpec> source_model = ReadHfConfig(source_config);
  absl::StatusOr<ModelSpec> target_model = ReadHfConfig(target_config);
  ASSERT_TRUE(source_model.ok() && target_model.ok());
  absl::StatusOr<Rope> source_rope = Rope::Create(source_model->rope, 16);
  absl::StatusOr<Rope> target_rope = Rope::Create(target_model->rope, 16);
  ASSERT_TRUE(source_rope.ok() && target_rope.ok());
  ASSERT_EQ(target_rope->rotary_dim(), 8);

  const int n = 2, d = 16, width = n * d;
  for (int l = 0; l < 4; ++l) {
    for (Kind kind : {Kind::kK, Kind::kV}) {
      const std::string ch = kind == Kind::kK ? "k" : "v";
      const std::vector<int> selected =
          manifest["source_layers_per_target"][ch][std::to_string(l)].get<std::vector<int>>();
      const int k = static_cast<int>(selected.size());
      const std::string prefix = absl::StrCat("target.", l, ".", ch);
      const std::vector<double> w = Floats(**weights, prefix + ".W");
      const std::vector<double> b = Floats(**weights, prefix + ".b");
      const bool compact = (*weights)->Find(prefix + ".W")->spec.shape.size() == 3;
      std::vector<std::vector<double>> layers;
      for (int j : selected) layers.push_back(testing::ReadLayer(source.view, j, kind));
      std::vector<double> expected(tokens * width);
      for (int64_t t = 0; t < tokens; ++t) {
        const uint64_t position = positions.at(t);
        // x = the selected layers' pre-RoPE (content-space) features, in stored order.
        std::vector<double> x(k * width);
        for (int blk = 0; blk < k; ++blk) {
          for (int h = 0; h < n; ++h) {
            double* head = &x[(blk * n + h) * d];
            for (int i = 0; i < d; ++i) head[i] = layers[blk][(t * n + h) * d + i];
            if (kind == Kind::kK) testing::RotateDouble(*source_rope, position, true, head);
          }
        }
        double* y = &expected[t * width];
        for (int col = 0; col < width; ++col) y[col] = b[col];
        if (compact) {  // per_head [n, k d, d]: head h from head h of each selected layer
          for (int h = 0; h < n; ++h) {
            for (int blk = 0; blk < k; ++blk) {
              for (int i = 0; i < d; ++i) {
                const double xi = x[(blk * n + h) * d + i];
                for (int o = 0; o < d; ++o) {
                  y[h * d + o] += xi * w[(h * k * d + blk * d + i) * d + o];
                }
              }
            }
          }
        } else {  // y = x @ W + b
          for (int r = 0; r < k * width; ++r) {
            for (int col = 0; col < width; ++col) y[col] += x[r] * w[r * width + col];
          }
        }
        if (kind == Kind::kK) {
          for (int h = 0; h < n; ++h) {
            testing::RotateDouble(*target_rope, position, false, y + h * d);
          }
        }
      }
      const double error =
          testing::MaxRelError(testing::ReadLayer(target.mutable_view, l, kind), expected);
      EXPECT_LE(error, c.tolerance) << "target layer " << l << " " << ch;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, SemanticRouterImportTest,
    ::testing::Values(Case{"full_head"}, Case{"full_head_bf16", "full_head", "dense", "bf16", 1e-2},
                      Case{"per_head_dense", "per_head", "dense"},
                      Case{"per_head_compact", "per_head", "compact"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(SemanticRouterImportCli, RefusesBadInputWithClearErrors) {
  const std::string python = PythonWithSafetensors();
  ASSERT_FALSE(python.empty()) << "no python3 with numpy and safetensors on PATH (run "
                                  "scripts/bootstrap.sh --python and put .venv/bin first on "
                                  "PATH, as scripts/test.sh does)";
  const std::string dir = MakeTempDir("cli_errors");
  const std::string in = JoinPath(dir, "artifact");
  ASSERT_EQ(RunCommand({python, Runfile("tools/write_semantic_router_mapper.py"), "--out", in}).rc,
            0);
  const std::string kvt = Runfile("cli/kvt");

  RunResult r = RunCommand({kvt, "import", "--format=onnx", "--in=" + in, "--out=" + dir + "/o"});
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.output.find("--format 'onnx' is not supported"), std::string::npos) << r.output;

  r = RunCommand({kvt, "import", "--format=semantic-router", "--in=" + in, "--out=" + dir + "/o"});
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.output.find("--source_num_layers and --source_rope_theta"), std::string::npos)
      << r.output;

  // Flags instead of config.json: the target's layer count comes from the manifest.
  r = RunCommand({kvt, "import", "--format=semantic-router", "--in=" + in,
                  "--out=" + dir + "/flags", "--source_num_layers=5", "--source_rope_theta=10000",
                  "--target_rope_theta=1e6"});
  EXPECT_EQ(r.rc, 0) << r.output;
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir + "/flags");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->manifest().target.num_layers, 4);
  EXPECT_EQ((*loaded)->manifest().target.rope.theta, 1e6);

  // A source model too small for the selections: the index out of range is named.
  r = RunCommand({kvt, "import", "--format=semantic-router", "--in=" + in, "--out=" + dir + "/o",
                  "--source_num_layers=2", "--source_rope_theta=10000", "--target_rope_theta=1e6"});
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("is out of range: the source model test/tiny-a has 2 layers"),
            std::string::npos)
      << r.output;

  // A corrupted weights file.
  const std::string weights = JoinPath(in, "weights.safetensors");
  absl::StatusOr<std::string> bytes = ReadFileToString(weights);
  ASSERT_TRUE(bytes.ok());
  (*bytes)[bytes->size() / 2] ^= 0x01;
  ASSERT_TRUE(WriteStringToFile(weights, *bytes).ok());
  r = RunCommand({kvt, "import", "--format=semantic-router", "--in=" + in, "--out=" + dir + "/o",
                  "--source_num_layers=5", "--source_rope_theta=10000", "--target_rope_theta=1e6"});
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.output.find("DATA_LOSS: checksum mismatch for " + weights), std::string::npos)
      << r.output;
  EXPECT_FALSE(PathExists(dir + "/o"));

  r = RunCommand({kvt, "import", "--help"});
  EXPECT_EQ(r.rc, 0);
  EXPECT_NE(r.output.find("usage: kvt import --format=semantic-router"), std::string::npos);
}

}  // namespace
}  // namespace kvt
