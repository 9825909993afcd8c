// Window mappers (manifest `window`) served end to end, in process: a real kvtd on port 0 over
// a store of `kvt synth --window` directories (ridge and MLP), the CPU backend in pieces shorter
// than the window's reach, requests through the real client, every result checked against the
// float64 reference; ListMappers reports the window, gapped positions are refused by name, and
// a sequence translated in two requests with the window's overlap equals the one-request result.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "host_cache/host_cache_testing.h"
#include "kernels/cpu_backend.h"
#include "kernels/dtype.h"
#include "kernels/testing/reference.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"
#include "mapper_store/synth.h"
#include "tests/in_process_kvtd.h"
#include "tests/translation_case.h"
#include "transport/proto_convert.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

SynthOptions WindowRidge() {
  SynthOptions o;
  o.source = NeoxModelSpec("window/src", 3, 2, 16, 10000);
  o.target = NeoxModelSpec("window/dst", 4, 4, 8, 500000);
  o.k = 2;
  o.window = 3;
  o.dtype = DType::kBF16;
  o.seed = 41;
  return o;
}

SynthOptions WindowMlp() {
  SynthOptions o;
  o.source = NeoxModelSpec("window-mlp/src", 2, 2, 16, 10000);
  o.target = NeoxModelSpec("window-mlp/dst", 3, 2, 16, 10000);
  o.k = 0;  // all
  o.window = 5;
  o.dtype = DType::kFP32;
  o.seed = 42;
  o.mlp = MlpConfig{24, MlpGranularity::kPerHead};
  return o;
}

class WindowServingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_dir_ = JoinPath(testing::MakeTempDir("window_serving"), "store");
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(store_dir_, "window-ridge"), WindowRidge()));
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(store_dir_, "window-mlp"), WindowMlp()));
    KvtdConfig config;
    config.mapper_store.reload_interval_seconds = 0;
    InProcessKvtdOptions options;
    // Pieces of 8 tokens: most rows read source tokens of the piece before.
    options.backend = NewCpuBackend(CpuBackendOptions{2, 8});
    options.store_as_kvtd_main = true;
    kvtd_ = StartKvtdForTest(store_dir_, config, std::move(options));
    ASSERT_NE(kvtd_, nullptr);
  }

  std::unique_ptr<LoadedMapper> Local(const std::string& id) {
    absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(JoinPath(store_dir_, id));
    EXPECT_TRUE(mapper.ok()) << mapper.status();
    return mapper.ok() ? std::move(*mapper) : nullptr;
  }

  // A translation of `source`'s tokens [begin, end) at positions offset + begin ..., its result
  // as doubles [layer][token][head][dim] per kind.
  std::vector<std::vector<double>> Translate(const LoadedMapper& mapper, const HostCache& source,
                                             int64_t begin, int64_t end, uint64_t offset) {
    const HostCache piece = SliceTokens(source, begin, end);
    v1::TranslateHeader header;
    header.set_mapper_id(mapper.id());
    header.set_position_offset(offset + begin);
    header.set_output_dtype(v1::DTYPE_FP32);
    absl::StatusOr<TranslateResult> result = kvtd_->client().Translate(header, piece);
    EXPECT_TRUE(result.ok()) << result.status();
    std::vector<std::vector<double>> layers;
    if (!result.ok()) return layers;
    const CacheView view = result->target.view();
    for (int l = 0; l < mapper.view().target.num_layers; ++l) {
      for (auto kind : {testing::Kind::kK, testing::Kind::kV}) {
        layers.push_back(testing::ReadLayer(view, l, kind));
      }
    }
    return layers;
  }

  std::string store_dir_;
  std::unique_ptr<InProcessKvtd> kvtd_;
};

TEST_F(WindowServingTest, TranslationsMatchTheFloat64Reference) {
  const std::vector<testing::TranslationCase> cases = {
      {"window-ridge", DType::kFP32, Layout::kHND, DType::kFP32, Layout::kHND, 70, 0, false},
      {"window-ridge", DType::kBF16, Layout::kNHD, DType::kBF16, Layout::kHND, 2, 1000, false},
      {"window-ridge", DType::kFP16, Layout::kHND, DType::kFP32, Layout::kNHD, 33, 5, false},
      {"window-mlp", DType::kFP32, Layout::kNHD, DType::kFP32, Layout::kNHD, 97, 123456, false},
      {"window-mlp", DType::kBF16, Layout::kHND, DType::kFP16, Layout::kHND, 17, 0, false},
  };
  for (const testing::TranslationCase& c : cases) {
    std::unique_ptr<LoadedMapper> mapper = Local(c.mapper);
    ASSERT_NE(mapper, nullptr);
    ASSERT_GT(mapper->view().window, 1);
    // The bf16 ridge may run on the oneDNN bf16 path: bf16's 1e-2 there.
    const double tolerance = std::max(testing::TranslationTolerance(c.output_dtype),
                                      mapper->manifest().weights_dtype == DType::kBF16
                                          ? testing::TranslationTolerance(DType::kBF16)
                                          : 0.0);
    testing::ExpectTranslationMatchesReference(kvtd_->client(), *mapper, c,
                                               testing::FreshSeed("window serving"), tolerance);
  }
  absl::StatusOr<v1::MapperInfo> info = kvtd_->client().GetMapper("window-mlp");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->window(), 5u);
  EXPECT_EQ(info->kind(), "mlp");
}

TEST_F(WindowServingTest, GappedPositionsAreRefusedConsecutiveOnesServed) {
  std::unique_ptr<LoadedMapper> mapper = Local("window-ridge");
  ASSERT_NE(mapper, nullptr);
  const HostCache source = testing::RandomHostCache(mapper->view().source, 4, DType::kFP32,
                                                    Layout::kHND, testing::FreshSeed("gaps"));
  v1::TranslateHeader header;
  header.set_mapper_id("window-ridge");
  for (uint64_t p : {10, 11, 13, 14}) header.add_positions(p);
  absl::StatusOr<TranslateResult> gapped = kvtd_->client().Translate(header, source);
  ASSERT_FALSE(gapped.ok());
  EXPECT_EQ(gapped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(gapped.status().message()),
              HasSubstr("header.positions[2]=13 does not follow positions[1]=11"));
  EXPECT_THAT(std::string(gapped.status().message()), HasSubstr("window 3"));
  header.clear_positions();
  for (uint64_t p : {10, 11, 12, 13}) header.add_positions(p);
  absl::StatusOr<TranslateResult> consecutive = kvtd_->client().Translate(header, source);
  EXPECT_TRUE(consecutive.ok()) << consecutive.status();
}

// The any-split property with a window: the second request starts window - 1 tokens early and
// its first window - 1 outputs are dropped; the rest equals the one-request translation.
TEST_F(WindowServingTest, SplitWithTheWindowsOverlapEqualsOneRequest) {
  std::unique_ptr<LoadedMapper> mapper = Local("window-mlp");
  ASSERT_NE(mapper, nullptr);
  const int64_t tokens = 40, split = 23, overlap = mapper->view().window - 1;
  const uint64_t offset = 1000;
  const HostCache source = testing::RandomHostCache(mapper->view().source, tokens,
                                                    DType::kFP32, Layout::kNHD,
                                                    testing::FreshSeed("split"));
  const std::vector<std::vector<double>> whole = Translate(*mapper, source, 0, tokens, offset);
  const std::vector<std::vector<double>> first = Translate(*mapper, source, 0, split, offset);
  const std::vector<std::vector<double>> second =
      Translate(*mapper, source, split - overlap, tokens, offset);
  ASSERT_EQ(whole.size(), first.size());
  ASSERT_EQ(whole.size(), second.size());
  const int64_t width = mapper->view().target.num_kv_heads * mapper->view().target.head_dim;
  for (size_t i = 0; i < whole.size(); ++i) {
    std::vector<double> joined(first[i]);
    joined.insert(joined.end(), second[i].begin() + overlap * width, second[i].end());
    EXPECT_LE(testing::MaxRelError(joined, whole[i]), 1e-6) << "layer/kind " << i;
  }
  // Without the overlap the split is not the same map: the window reads zeros before it.
  const std::vector<std::vector<double>> no_overlap =
      Translate(*mapper, source, split, tokens, offset);
  std::vector<double> joined(first[0]);
  joined.insert(joined.end(), no_overlap[0].begin(), no_overlap[0].end());
  EXPECT_GT(testing::MaxRelError(joined, whole[0]), 1e-3);
}

}  // namespace
}  // namespace kvt
