// RecordBenefit on a real mapper directory written by the project's writer: the merged entries
// load back with checksums verified, the weights are the same file (not rewritten), and every
// error leaves the directory byte-identical.
#include "mapper_store/record_benefit.h"

#include <sys/stat.h>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

constexpr char kDocs[] =
    R"({"text": "python-docs-heldout", "windows": 64, "context_tokens": 384,
        "continuation_tokens": 96, "recovered": 0.64, "lower95": 0.5, "upper95": 0.86,
        "kl": 0.12})";
constexpr char kLicense[] =
    R"({"text": "debian-licenses", "windows": 32, "context_tokens": 256,
        "continuation_tokens": 64, "recovered": 0.3, "lower95": 0.2, "upper95": 0.4, "kl": 0.5})";

class RecordBenefitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SynthOptions options;
    options.source = NeoxModelSpec("test/src", 3, 2, 16, 10000);
    options.target = NeoxModelSpec("test/dst", 2, 2, 16, 10000);
    options.k = 2;
    options.dtype = DType::kFP32;
    options.seed = 3;
    KVT_ASSERT_OK(WriteSynthMapper(dir_, options));
  }

  std::string WriteJson(const std::string& name, const std::string& text) {
    const std::string path = JoinPath(root_, name);
    EXPECT_TRUE(WriteStringToFile(path, text).ok());
    return path;
  }

  // Every file of the mapper directory, by name.
  std::map<std::string, std::string> Files() {
    std::map<std::string, std::string> files;
    absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir_);
    EXPECT_TRUE(names.ok()) << names.status();
    for (const std::string& name : names.value_or(std::vector<std::string>{})) {
      files[name] = ReadFileToString(JoinPath(dir_, name)).value_or("<unreadable>");
    }
    return files;
  }

  ino_t WeightsInode() {
    struct stat st;
    EXPECT_EQ(::stat(JoinPath(dir_, kDefaultWeightsFileName).c_str(), &st), 0);
    return st.st_ino;
  }

  std::string root_ = testing::MakeTempDir("record_benefit");
  std::string dir_ = JoinPath(root_, "m");
};

TEST_F(RecordBenefitTest, MergesIntoTheManifestAndLoadsWithChecksumsVerified) {
  const std::map<std::string, std::string> before = Files();
  const ino_t weights = WeightsInode();
  absl::StatusOr<std::vector<BenefitRecord>> merged = RecordBenefit(
      dir_, WriteJson("a.json", absl::StrCat(R"({"benefit": [)", kDocs, "]}")));
  ASSERT_TRUE(merged.ok()) << merged.status();
  ASSERT_EQ(merged->size(), 1u);

  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE((*loaded)->checksums_verified());
  const std::vector<BenefitRecord>& benefit = (*loaded)->manifest().quality.benefit;
  ASSERT_EQ(benefit.size(), 1u);
  EXPECT_EQ(benefit[0].text, "python-docs-heldout");
  EXPECT_EQ(benefit[0].windows, 64);
  EXPECT_EQ(benefit[0].context_tokens, 384);
  EXPECT_EQ(benefit[0].continuation_tokens, 96);
  EXPECT_EQ(benefit[0].recovered, 0.64);
  EXPECT_EQ(benefit[0].lower95, 0.5);
  EXPECT_EQ(benefit[0].upper95, 0.86);
  EXPECT_EQ(benefit[0].kl, 0.12);
  // Only manifest.yaml and SHA256SUMS changed; the weights are the same file, not a copy.
  const std::map<std::string, std::string> after = Files();
  ASSERT_EQ(after.size(), before.size());
  EXPECT_EQ(after.at(kDefaultWeightsFileName), before.at(kDefaultWeightsFileName));
  EXPECT_NE(after.at(kManifestFileName), before.at(kManifestFileName));
  EXPECT_NE(after.at(kChecksumFileName), before.at(kChecksumFileName));
  EXPECT_EQ(WeightsInode(), weights);
  // No temporary or moved-aside directory is left next to it.
  absl::StatusOr<std::vector<std::string>> siblings = ListDirectory(root_);
  ASSERT_TRUE(siblings.ok());
  for (const std::string& name : *siblings) EXPECT_NE(name[0], '.') << name;

  // A second file: the same text replaces its entry in place, a new one is appended.
  const std::string remeasured = absl::StrCat(
      R"({"benefit": [)", kLicense, ", ",
      absl::StrReplaceAll(kDocs, {{"\"recovered\": 0.64", "\"recovered\": 0.7"}}), "]}");
  merged = RecordBenefit(dir_, WriteJson("b.json", remeasured));
  ASSERT_TRUE(merged.ok()) << merged.status();
  loaded = LoadMapperDir(dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const std::vector<BenefitRecord>& both = (*loaded)->manifest().quality.benefit;
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(both[0].text, "python-docs-heldout");
  EXPECT_EQ(both[0].recovered, 0.7);
  EXPECT_EQ(both[1].text, "debian-licenses");
  EXPECT_EQ(both[1].lower95, 0.2);
}

TEST_F(RecordBenefitTest, ErrorsNameTheFieldAndLeaveTheMapperUntouched) {
  const std::map<std::string, std::string> before = Files();
  const struct {
    std::string json;
    StatusCode code;
    std::string message;
  } cases[] = {
      {"{\"benefit\": [", StatusCode::kInvalidArgument, "not valid JSON"},
      {R"({"benefit": []})", StatusCode::kInvalidArgument,
       "key 'benefit' must be a non-empty list of entries"},
      {R"({"benefits": []})", StatusCode::kInvalidArgument, "unknown key 'benefits'"},
      {absl::StrCat(R"({"benefit": [)", kLicense, ", ",
                    absl::StrReplaceAll(kDocs, {{"\"lower95\": 0.5", "\"lower95\": 0.7"}}), "]}"),
       StatusCode::kInvalidArgument, "benefit[1].lower95 = 0.7 exceeds recovered 0.64"},
      {absl::StrCat(R"({"benefit": [)", kDocs, ", ", kDocs, "]}"), StatusCode::kInvalidArgument,
       "benefit[1].text 'python-docs-heldout' is already benefit[0] (one entry per text)"},
      {absl::StrCat(R"({"benefit": [)",
                    absl::StrReplaceAll(kDocs, {{"\"windows\": 64", "\"windows\": 1"}}), "]}"),
       StatusCode::kInvalidArgument, "key 'benefit[0].windows' must be an integer >= 2"},
      {absl::StrCat(R"({"benefit": [)",
                    absl::StrReplaceAll(kDocs, {{"\"kl\": 0.12", "\"kl\": \"low\""}}), "]}"),
       StatusCode::kInvalidArgument, "key 'benefit[0].kl' must be a number"},
      {R"({"benefit": [{"text": "t", "windows": 2, "context_tokens": 1,
                        "continuation_tokens": 1, "recovered": 0, "lower95": 0, "upper95": 0}]})",
       StatusCode::kInvalidArgument, "benefit[0].kl"},
      {absl::StrCat(R"({"benefit": [)",
                    absl::StrReplaceAll(kDocs, {{"\"kl\"", "\"kl_nats\""}}), "]}"),
       StatusCode::kInvalidArgument, "unknown key 'benefit[0].kl_nats'"},
      {absl::StrCat(R"({"benefit": [)",
                    absl::StrReplaceAll(kDocs, {{"python-docs-heldout", "a/b"}}), "]}"),
       StatusCode::kInvalidArgument, "benefit[0].text 'a/b' must be a non-empty name"},
  };
  int n = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.json);
    const std::string path = WriteJson(absl::StrCat("bad", n++, ".json"), c.json);
    absl::StatusOr<std::vector<BenefitRecord>> merged = RecordBenefit(dir_, path);
    KVT_EXPECT_ERROR(merged, c.code, c.message);
    KVT_EXPECT_ERROR(merged, c.code, path);  // the file is named
    EXPECT_TRUE(Files() == before);  // (not printed: the weights are binary)
  }
  const std::string good = WriteJson("good.json", absl::StrCat(R"({"benefit": [)", kDocs, "]}"));
  KVT_EXPECT_ERROR(RecordBenefit(JoinPath(root_, "missing"), good), StatusCode::kNotFound,
                   "not a mapper directory");
  KVT_EXPECT_ERROR(RecordBenefit(dir_, JoinPath(root_, "missing.json")), StatusCode::kNotFound,
                   "missing.json");
  EXPECT_TRUE(Files() == before);  // (not printed: the weights are binary)

  // A damaged mapper is refused by the checksum check, and left as it was.
  const std::string manifest_path = JoinPath(dir_, kManifestFileName);
  KVT_ASSERT_OK(WriteStringToFile(manifest_path, before.at(kManifestFileName) + "# edited\n"));
  const std::map<std::string, std::string> damaged = Files();
  KVT_EXPECT_ERROR(RecordBenefit(dir_, good), StatusCode::kDataLoss, "checksum mismatch");
  EXPECT_TRUE(Files() == damaged);
}

TEST(MergeBenefitTest, ReplacesTheSameTextInPlaceAndAppendsNewOnes) {
  BenefitRecord a, b, a2, c;
  a.text = "a";
  b.text = "b";
  a2.text = "a";
  a2.kl = 1;
  c.text = "c";
  const std::vector<BenefitRecord> merged = MergeBenefit({a, b}, {c, a2});
  ASSERT_EQ(merged.size(), 3u);
  EXPECT_EQ(merged[0].text, "a");
  EXPECT_EQ(merged[0].kl, 1);
  EXPECT_EQ(merged[1].text, "b");
  EXPECT_EQ(merged[2].text, "c");
}

}  // namespace
}  // namespace kvt
