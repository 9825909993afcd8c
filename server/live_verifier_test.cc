// LiveVerifier: deterministic sampling, pending samples matched to the target's own publish by
// chain hash (and expiring by age and count), and the out-of-service state machine: window
// mean against recorded - tolerance, restore, a new version clearing the state, mappers
// without a recorded figure never taken out.
#include "server/live_verifier.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/mapper_view.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

constexpr int kBlock = 4;
const EntryShape kShape{1, 1, 2, DType::kFP32};

PairLabels Pair() {
  MapperView view;
  view.source.name = "m/src";
  view.target.name = "m/dst";
  return PairLabels::Of(view);
}

VerifiedMapper Version(int64_t generation, std::optional<double> recorded = 0.9) {
  VerifiedMapper mapper;
  mapper.id = "ab";
  mapper.generation = generation;
  mapper.version = absl::StrCat("weights-", generation);
  mapper.pair = Pair();
  mapper.recorded = recorded;
  return mapper;
}

std::vector<uint32_t> Tokens(int n, uint32_t first) {
  std::vector<uint32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = first + i;
  return tokens;
}

class LiveVerifierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PrefixCacheOptions options;
    options.max_bytes = 1 << 20;
    options.block_tokens = kBlock;
    cache_ = std::make_unique<PrefixCache>(std::move(options));
  }

  std::unique_ptr<LiveVerifier> Make(double fraction, int window = 3, int max_pending = 4) {
    LiveVerifierOptions options;
    options.sample_fraction = fraction;
    options.window = window;
    options.tolerance = 0.05;
    options.max_pending = max_pending;
    options.pending_ttl = absl::Seconds(10);
    options.block_tokens = kBlock;
    options.now = [this] { return now_; };
    absl::StatusOr<std::unique_ptr<LiveVerifier>> verifier = LiveVerifier::Create(
        std::move(options),
        [this](const PendingSample& sample, const PrefixEntry& own) -> absl::StatusOr<double> {
          measured_tokens_.push_back(sample.source.tokens);
          EXPECT_EQ(own.model(), "m/dst");
          return next_live_;
        },
        &metrics_);
    EXPECT_TRUE(verifier.ok()) << verifier.status();
    return std::move(*verifier);
  }

  std::shared_ptr<const PrefixEntry> Commit(const std::string& model,
                                            const std::vector<uint32_t>& tokens) {
    absl::StatusOr<std::unique_ptr<PendingEntry>> pending = cache_->Reserve(model, tokens, kShape);
    EXPECT_TRUE(pending.ok()) << pending.status();
    absl::StatusOr<PublishResult> result = cache_->Commit(std::move(*pending));
    EXPECT_TRUE(result.ok()) << result.status();
    return result->entry;
  }

  PrefixMatch Match(const std::shared_ptr<const PrefixEntry>& entry, int64_t tokens) {
    return PrefixMatch{entry, tokens};
  }

  std::unique_ptr<PrefixCache> cache_;
  Metrics metrics_{"cpu"};
  absl::Time now_ = absl::FromUnixSeconds(1000);
  double next_live_ = 1.0;
  std::vector<int64_t> measured_tokens_;
};

TEST_F(LiveVerifierTest, OptionsAreCheckedByName) {
  LiveVerifierOptions options;
  options.sample_fraction = 1.5;
  auto measure = [](const PendingSample&, const PrefixEntry&) -> absl::StatusOr<double> {
    return 1.0;
  };
  EXPECT_THAT(std::string(LiveVerifier::Create(options, measure, nullptr).status().message()),
              HasSubstr("prefix_cache.verify_sample_fraction = 1.5"));
  options.sample_fraction = 0.5;
  options.window = 0;
  EXPECT_THAT(std::string(LiveVerifier::Create(options, measure, nullptr).status().message()),
              HasSubstr("prefix_cache.verify_window = 0"));
}

TEST(MapperVersionOfTest, IsTheWeightsHashOrTheGeneration) {
  EXPECT_EQ(MapperVersionOf("9f86d081", 3), "9f86d081");
  EXPECT_EQ(MapperVersionOf("", 3), "generation 3");  // a store that skips checksums
}

TEST_F(LiveVerifierTest, SamplesEveryRoundedInverseFractionthLookupPerVersion) {
  std::unique_ptr<LiveVerifier> verifier = Make(0.25);
  EXPECT_EQ(verifier->period(), 4);
  std::vector<int> sampled;
  for (int i = 1; i <= 12; ++i) {
    if (verifier->Sample(Version(1))) sampled.push_back(i);
  }
  EXPECT_EQ(sampled, (std::vector<int>{4, 8, 12}));
  // A new version counts afresh.
  EXPECT_FALSE(verifier->Sample(Version(2)));
  EXPECT_FALSE(Make(0)->enabled());
  EXPECT_FALSE(Make(0)->Sample(Version(1)));
}

TEST_F(LiveVerifierTest, WindowMeanBelowRecordedMinusToleranceTakesTheVersionOut) {
  std::unique_ptr<LiveVerifier> verifier = Make(0.5, /*window=*/3);
  EXPECT_EQ(verifier->OutOfService(Version(1)), "");
  // Recorded 0.9, tolerance 0.05: the floor is 0.85.
  for (double live : {1.0, 0.25}) {  // mean 0.625, but the window is not full yet
    verifier->Record(Version(1), live);
    EXPECT_EQ(verifier->OutOfService(Version(1)), "");
  }
  verifier->Record(Version(1), 1.0);  // window full: mean 0.75 < 0.85
  const std::string reason = verifier->OutOfService(Version(1));
  EXPECT_THAT(reason, HasSubstr("live_quality: mean K/V cosine 0.75 of the last 3"));
  EXPECT_THAT(reason, HasSubstr("kv_cosine_heldout 0.9"));
  std::string text = metrics_.Serialize();
  EXPECT_THAT(text, HasSubstr(R"(kvt_mapper_out_of_service{mapper="ab",source="m/src",target="m/dst"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_live_quality{mapper="ab",source="m/src",target="m/dst"} 0.75)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_live_verifications_total{mapper="ab",result="fail",source="m/src",target="m/dst"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_live_verifications_total{mapper="ab",result="pass",source="m/src",target="m/dst"} 2)"));

  // Stays out (more good samples do not bring it back) until restored.
  for (int i = 0; i < 5; ++i) verifier->Record(Version(1), 1.0);
  EXPECT_NE(verifier->OutOfService(Version(1)), "");
  absl::StatusOr<std::pair<bool, VerificationState>> restored = verifier->Restore("ab");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_TRUE(restored->first);
  EXPECT_EQ(restored->second.samples, 0);
  EXPECT_EQ(verifier->OutOfService(Version(1)), "");
  EXPECT_FALSE(verifier->Restore("ab")->first);  // already in service
  EXPECT_EQ(verifier->Restore("zz").status().code(), absl::StatusCode::kNotFound);

  // Out again, then a new version of the mapper clears it.
  for (int i = 0; i < 3; ++i) verifier->Record(Version(1), 0.1);
  EXPECT_NE(verifier->OutOfService(Version(1)), "");
  EXPECT_EQ(verifier->OutOfService(Version(2)), "");
  EXPECT_THAT(metrics_.Serialize(), HasSubstr(R"(kvt_mapper_out_of_service{mapper="ab",source="m/src",target="m/dst"} 0)"));
  // The same weights loaded again (an eviction and a reload: a new generation) are the same
  // version: still in service, and the window is kept.
  VerifiedMapper reloaded = Version(2);
  reloaded.generation = 3;
  verifier->Record(reloaded, 0.95);
  EXPECT_EQ(verifier->List().front().samples, 1);
  verifier->Record(Version(2), absl::NotFoundError("gone"));  // unmeasurable: skipped
  EXPECT_EQ(verifier->List().front().samples, 1);
  // A sample taken on the old version no longer counts.
  verifier->Record(Version(1), 0.1);
  EXPECT_THAT(metrics_.Serialize(), HasSubstr(R"(result="skipped")"));
  EXPECT_EQ(verifier->List().front().samples, 1);
}

TEST_F(LiveVerifierTest, MappersWithoutARecordedFigureAreMeasuredButNeverTakenOut) {
  std::unique_ptr<LiveVerifier> verifier = Make(0.5, /*window=*/2);
  const VerifiedMapper unrated = Version(1, std::nullopt);
  EXPECT_EQ(verifier->OutOfService(unrated), "");
  for (int i = 0; i < 4; ++i) verifier->Record(unrated, 0.0);
  EXPECT_EQ(verifier->OutOfService(unrated), "");
  ASSERT_EQ(verifier->List().size(), 1u);
  EXPECT_EQ(verifier->List().front().live, 0.0);
  EXPECT_THAT(metrics_.Serialize(), HasSubstr(R"(result="no_reference")"));
}

TEST_F(LiveVerifierTest, OwnPublishOfTheSamePrefixIsMeasuredOthersAreNot) {
  std::unique_ptr<LiveVerifier> verifier = Make(1.0, /*window=*/1);
  const std::vector<uint32_t> prompt = Tokens(10, 100);
  const std::shared_ptr<const PrefixEntry> source = Commit("m/src", prompt);  // 8 stored
  ASSERT_EQ(verifier->OutOfService(Version(1)), "");
  ASSERT_TRUE(verifier->Sample(Version(1)));
  verifier->AddPending(Version(1), Match(source, 8));
  EXPECT_EQ(verifier->pending(), 1);

  // The source model publishing again, and another prompt of the target: not the sample.
  verifier->OnPublish(Commit("m/src", Tokens(12, 100)));
  verifier->OnPublish(Commit("m/dst", Tokens(12, 500)));
  verifier->Drain();
  EXPECT_TRUE(measured_tokens_.empty());
  EXPECT_EQ(verifier->pending(), 1);

  // The target's own prefill of the prompt (longer: it holds the matched blocks): measured.
  next_live_ = 0.5;
  verifier->OnPublish(Commit("m/dst", Tokens(12, 100)));
  verifier->Drain();
  EXPECT_EQ(measured_tokens_, (std::vector<int64_t>{8}));
  EXPECT_EQ(verifier->pending(), 0);
  EXPECT_NE(verifier->OutOfService(Version(1)), "");  // window 1: 0.5 < 0.85
}

TEST_F(LiveVerifierTest, PendingSamplesExpireByAgeAndCount) {
  std::unique_ptr<LiveVerifier> verifier = Make(1.0, 3, /*max_pending=*/2);
  const std::shared_ptr<const PrefixEntry> source = Commit("m/src", Tokens(8, 1));
  verifier->OutOfService(Version(1));
  for (int i = 0; i < 3; ++i) verifier->AddPending(Version(1), Match(source, 8));
  EXPECT_EQ(verifier->pending(), 2);  // the oldest pushed out
  now_ += absl::Seconds(11);
  EXPECT_EQ(verifier->pending(), 0);
  EXPECT_THAT(metrics_.Serialize(), HasSubstr(R"(kvt_live_verifications_total{mapper="ab",result="expired",source="m/src",target="m/dst"} 3)"));
  // Too late: the own publish no longer finds them.
  verifier->OnPublish(Commit("m/dst", Tokens(8, 1)));
  verifier->Drain();
  EXPECT_TRUE(measured_tokens_.empty());
}

}  // namespace
}  // namespace kvt
