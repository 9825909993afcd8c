// The sharded fit Job's script (deploy/k8s/fit/fit-shard.sh) run as the Indexed Job runs it:
// one process per shard at the same time, each with its JOB_COMPLETION_INDEX, the real `kvt`
// binary, on a synthetic model family with a known ground truth. The merged mapper lands in the
// store directory (never half-written), chooses the true source layers and predicts held-out
// data; a restarted shard does not refit; a shard whose peers never run gives up with a message.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "fit/synthetic_family.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/mapper.h"

namespace kvt {
namespace {

using ::kvt::testing::MakeTempDir;

using ::testing::HasSubstr;

std::string Runfile(const std::string& path) {
  return absl::StrCat(std::getenv("TEST_SRCDIR"), "/kvt/", path);
}

// The known truth: target layer l is a linear map of source layers true_sigma[l] plus 5% noise.
fit::testing::FamilyOptions Family() {
  fit::testing::FamilyOptions o;
  o.source = NeoxModelSpec("fam/src", 3, 2, 16, 10000);
  o.target = NeoxModelSpec("fam/dst", 4, 2, 16, 1000000);
  o.true_sigma = {{1, 0}, {2, 1}, {0, 2}, {2, 0}};
  o.noise_share = 0.05;
  o.seed = 7;
  return o;
}

struct ShardResult {
  int exit_code;
  std::string output;
};

class FitJobTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = new std::string(MakeTempDir("calibration"));
    const fit::testing::Family family = fit::testing::MakeFamily(Family());
    ASSERT_TRUE(fit::testing::WriteSequences(family, *data_, 0, 24, 64, DType::kFP32).ok());
    ASSERT_TRUE(WriteStringToFile(JoinPath(*data_, "src.json"),
                                  fit::testing::HfConfigJson(Family().source))
                    .ok());
    ASSERT_TRUE(WriteStringToFile(JoinPath(*data_, "dst.json"),
                                  fit::testing::HfConfigJson(Family().target))
                    .ok());
  }

  // The environment job.yaml gives each pod (the run id stands in for the Job's uid).
  std::string Env(int index, int shards, const std::string& store, int wait_seconds = 600) {
    return absl::StrCat(
        "JOB_COMPLETION_INDEX=", index, " KVT_FIT_SHARDS=", shards, " KVT_BIN='",
        Runfile("cli/kvt"), "' KVT_FIT_WORK='", work_, "' KVT_FIT_RUN=run-1 KVT_FIT_OUT='", store,
        "/fam' KVT_FIT_WAIT_SECONDS=", wait_seconds, " KVT_FIT_FLAGS='--source_config=", *data_,
        "/src.json --target_config=", *data_, "/dst.json --source_dumps=", *data_,
        "/source --target_dumps=", *data_,
        "/target --top_k=2 --stride=2 --heldout_fraction=0.25 --threads=1 --corpus=synthetic' "
        "KVT_FIT_MERGE_FLAGS='--lambda=0.001 --weight_dtype=fp32'");
  }

  // Runs every shard's script at once, as the Job's pods would, and collects each exit status.
  std::vector<ShardResult> RunShards(const std::vector<std::string>& envs) {
    std::string command;
    for (size_t i = 0; i < envs.size(); ++i) {
      const std::string log = JoinPath(root_, absl::StrCat("shard", i, ".log"));
      absl::StrAppend(&command, "( env ", envs[i], " sh '", Runfile("deploy/k8s/fit/fit-shard.sh"),
                      "' > '", log, "' 2>&1; echo $? >> '", log, "' ) & ");
    }
    absl::StrAppend(&command, "wait");
    EXPECT_EQ(std::system(command.c_str()), 0);
    std::vector<ShardResult> results;
    for (size_t i = 0; i < envs.size(); ++i) {
      absl::StatusOr<std::string> log =
          ReadFileToString(JoinPath(root_, absl::StrCat("shard", i, ".log")));
      EXPECT_TRUE(log.ok());
      std::string text = log.ok() ? *log : "";
      // The last line is the script's exit status.
      const size_t last = text.find_last_of('\n', text.size() - 2);
      const std::string status = text.substr(last == std::string::npos ? 0 : last + 1);
      results.push_back({std::atoi(status.c_str()), text});
    }
    return results;
  }

  void SetUp() override {
    root_ = MakeTempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    work_ = JoinPath(root_, "work");
  }

  static std::string* data_;
  std::string root_, work_;
};

std::string* FitJobTest::data_ = nullptr;

TEST_F(FitJobTest, ShardsRunTogetherAndMergeIntoTheStore) {
  const std::string store = JoinPath(root_, "mappers");
  ASSERT_EQ(std::system(absl::StrCat("mkdir -p '", store, "'").c_str()), 0);
  std::vector<ShardResult> shards = RunShards({Env(2, 3, store), Env(1, 3, store), Env(0, 3, store)});
  for (const ShardResult& shard : shards) EXPECT_EQ(shard.exit_code, 0) << shard.output;
  EXPECT_THAT(shards[2].output, HasSubstr("wrote " + store + "/fam"));

  // Only the finished mapper is in the store: no staging directory left behind.
  absl::StatusOr<std::string> listing = [&]() -> absl::StatusOr<std::string> {
    const std::string file = JoinPath(root_, "ls.txt");
    if (std::system(absl::StrCat("ls -A '", store, "' > '", file, "'").c_str()) != 0) {
      return absl::InternalError("ls failed");
    }
    return ReadFileToString(file);
  }();
  ASSERT_TRUE(listing.ok());
  EXPECT_EQ(*listing, "fam\n");

  absl::StatusOr<std::unique_ptr<LoadedMapper>> mapper = LoadMapperDir(JoinPath(store, "fam"));
  ASSERT_TRUE(mapper.ok()) << mapper.status();
  const Manifest& manifest = (*mapper)->manifest();
  ASSERT_EQ(manifest.layers.size(), 4u);
  for (int l = 0; l < 4; ++l) {
    // The probe over all shards ranks the true source layers first.
    EXPECT_EQ(manifest.layers[l].sigma_k, Family().true_sigma[l]) << "target layer " << l;
    EXPECT_EQ(manifest.layers[l].sigma_v, Family().true_sigma[l]) << "target layer " << l;
    // 5% noise: the best possible R^2 is 0.95.
    ASSERT_TRUE(manifest.layers[l].r2_k_heldout.has_value());
    EXPECT_GT(*manifest.layers[l].r2_k_heldout, 0.85) << "target layer " << l;
    EXPECT_LT(*manifest.layers[l].r2_k_heldout, 0.97) << "target layer " << l;
  }

  // A restarted pod (same run) redoes nothing and leaves the mapper alone.
  const std::string sums = *ReadFileToString(JoinPath(store, "fam/SHA256SUMS"));
  std::vector<ShardResult> again = RunShards({Env(0, 3, store)});
  EXPECT_EQ(again[0].exit_code, 0) << again[0].output;
  EXPECT_THAT(again[0].output, HasSubstr("already exists"));
  EXPECT_EQ(*ReadFileToString(JoinPath(store, "fam/SHA256SUMS")), sums);
}

TEST_F(FitJobTest, AShardWhosePeersNeverRunGivesUp) {
  // parallelism < completions in a real cluster: shard 0 of 2 must not wait forever.
  const std::string store = JoinPath(root_, "mappers");
  std::vector<ShardResult> shards = RunShards({Env(0, 2, store, /*wait_seconds=*/4)});
  EXPECT_NE(shards[0].exit_code, 0);
  EXPECT_THAT(shards[0].output, HasSubstr("gave up after 4s waiting for"));
  EXPECT_FALSE(PathExists(JoinPath(store, "fam")));
}

TEST_F(FitJobTest, AnIndexOutsideTheShardCountIsRefused) {
  std::vector<ShardResult> shards = RunShards({Env(3, 3, JoinPath(root_, "mappers"))});
  EXPECT_EQ(shards[0].exit_code, 2);
  EXPECT_THAT(shards[0].output, HasSubstr("completions must equal KVT_FIT_SHARDS"));
}

}  // namespace
}  // namespace kvt
