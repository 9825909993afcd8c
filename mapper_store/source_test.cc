#include "mapper_store/source.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

SynthOptions Tiny() {
  SynthOptions o;
  o.source = NeoxModelSpec("a", 2, 2, 8);
  o.target = NeoxModelSpec("b", 2, 2, 8);
  o.k = 1;
  o.dtype = DType::kFP16;
  return o;
}

class SourceTest : public ::testing::Test {
 protected:
  std::string root_ = testing::MakeTempDir("source");
};

TEST_F(SourceTest, ScanListsMapperDirectoriesOnly) {
  KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root_, "m1"), Tiny()));
  KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root_, ".m2.tmp-1-0"), Tiny()));  // a temporary
  ASSERT_TRUE(MakeDirs(JoinPath(root_, "notes")).ok());                      // no manifest
  ASSERT_TRUE(WriteStringToFile(JoinPath(root_, "README"), "hi").ok());      // a file
  absl::StatusOr<std::map<std::string, Fingerprint>> present = ScanMapperDirectories(root_);
  ASSERT_TRUE(present.ok()) << present.status();
  ASSERT_EQ(present->size(), 1u);
  const Fingerprint& fingerprint = present->at("m1");
  ASSERT_EQ(fingerprint.files.size(), 3u);  // manifest, weights, SHA256SUMS
  EXPECT_EQ(std::get<0>(fingerprint.files[0]), "SHA256SUMS");  // sorted by name
  EXPECT_EQ(fingerprint.TotalSize(), fingerprint.FileSize("SHA256SUMS") +
                                         fingerprint.FileSize(kManifestFileName) +
                                         fingerprint.FileSize(kDefaultWeightsFileName));
  EXPECT_EQ(fingerprint.FileSize("missing"), 0u);
}

TEST_F(SourceTest, ScanOfAMissingRootIsNotFound) {
  KVT_EXPECT_ERROR(ScanMapperDirectories(JoinPath(root_, "nope")), StatusCode::kNotFound,
                   "does not exist or is not a directory");
}

TEST_F(SourceTest, FingerprintChangesOnARewriteOfTheSameSize) {
  const std::string dir = JoinPath(root_, "m");
  KVT_ASSERT_OK(WriteSynthMapper(dir, Tiny()));
  absl::StatusOr<Fingerprint> before = FingerprintDirectory(dir);
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(*FingerprintDirectory(dir), *before);  // stable while nothing changes
  // Same bytes, written through a new file renamed over the old one: a new inode.
  const std::string sums = JoinPath(dir, "SHA256SUMS");
  ASSERT_TRUE(WriteStringToFile(sums + ".new", *ReadFileToString(sums)).ok());
  ASSERT_EQ(std::rename((sums + ".new").c_str(), sums.c_str()), 0);
  absl::StatusOr<Fingerprint> after = FingerprintDirectory(dir);
  ASSERT_TRUE(after.ok());
  EXPECT_NE(*after, *before);
  EXPECT_EQ(after->TotalSize(), before->TotalSize());
}

TEST_F(SourceTest, ExpectedWeightBytesIsTheDataSection) {
  const std::string dir = JoinPath(root_, "m");
  KVT_ASSERT_OK(WriteSynthMapper(dir, Tiny()));
  const Fingerprint fingerprint = *FingerprintDirectory(dir);
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded = LoadMapperDir(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(ExpectedWeightBytes(dir, kDefaultWeightsFileName, fingerprint),
            (*loaded)->weight_bytes());
  EXPECT_LT((*loaded)->weight_bytes(), fingerprint.FileSize(kDefaultWeightsFileName));
  // A header that does not parse: the whole file is the estimate.
  ASSERT_TRUE(WriteStringToFile(JoinPath(dir, kDefaultWeightsFileName), "garbage!").ok());
  const Fingerprint garbage = *FingerprintDirectory(dir);
  EXPECT_EQ(ExpectedWeightBytes(dir, kDefaultWeightsFileName, garbage), 8u);
}

TEST(PollerTest, PollsUntilStoppedAndKeepsTheLastStatus) {
  std::atomic<int> polls{0};
  Poller poller([&] {
    ++polls;
    return polls >= 2 ? absl::UnavailableError("gone") : absl::OkStatus();
  });
  KVT_EXPECT_OK(poller.last_status());  // none ran yet
  poller.Start(absl::Milliseconds(1));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (polls < 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_GE(polls, 3);
  poller.Stop();
  const int stopped_at = polls;
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(polls, stopped_at);
  EXPECT_EQ(poller.last_status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvt
