#include "mapper_store/format/manifest_testing.h"
#include "quality/mapper_quality.h"

#include <optional>
#include <string>

#include "gtest/gtest.h"

namespace kvt {
namespace {

LayerEntry Layer(int target_layer, std::optional<double> r2_k, std::optional<double> r2_v) {
  LayerEntry layer;
  layer.target_layer = target_layer;
  layer.r2_k_heldout = r2_k;
  layer.r2_v_heldout = r2_v;
  return layer;
}

TEST(MeanHeldoutR2Test, AveragesKAndVOverTheLayersPastZero) {
  Manifest manifest;
  manifest.layers = {Layer(0, 0.99, 0.99), Layer(1, 0.5, 0.7), Layer(2, 0.6, std::nullopt)};
  ASSERT_TRUE(MeanHeldoutR2(manifest).has_value());
  EXPECT_DOUBLE_EQ(*MeanHeldoutR2(manifest), (0.5 + 0.7 + 0.6) / 3);
}

TEST(MeanHeldoutR2Test, FallsBackToLayerZeroWhenItAloneRecordsThem) {
  Manifest manifest;
  manifest.layers = {Layer(0, 0.8, 0.6), Layer(1, std::nullopt, std::nullopt)};
  ASSERT_TRUE(MeanHeldoutR2(manifest).has_value());
  EXPECT_DOUBLE_EQ(*MeanHeldoutR2(manifest), 0.7);
}

TEST(MeanHeldoutR2Test, NoneWhenNoLayerRecordsThem) {
  Manifest manifest;
  EXPECT_FALSE(MeanHeldoutR2(manifest).has_value());
  manifest.layers = {Layer(0, std::nullopt, std::nullopt), Layer(1, std::nullopt, std::nullopt)};
  EXPECT_FALSE(MeanHeldoutR2(manifest).has_value());
}

TEST(MapperRecordedQualityTest, IsTheAttentionCosinesLowerBound) {
  Manifest manifest;
  manifest.layers = {Layer(1, 0.5, 0.5)};
  manifest.quality.attention_cosine_heldout = 0.93;
  manifest.quality.attention_cosine_heldout_lower95 = 0.91;
  manifest.quality.heldout_sequences = 20;
  const RecordedQuality recorded = MapperRecordedQuality(manifest);
  EXPECT_EQ(recorded.value, 0.91);  // the bound, never the point estimate
  EXPECT_EQ(std::string(recorded.metric), "attention_cosine_heldout_lower95");
  EXPECT_EQ(std::string(recorded.description),
            "held-out attention-output cosine (95% lower bound)");
}

TEST(MapperRecordedQualityTest, ACosineWithoutABoundIsNothingToGateOn) {
  Manifest manifest;
  manifest.layers = {Layer(1, 0.9, 0.9)};  // not a fallback either: the cosine was measured
  manifest.quality.attention_cosine_heldout = 0.877;
  manifest.quality.heldout_sequences = 1;
  RecordedQuality recorded = MapperRecordedQuality(manifest);
  EXPECT_FALSE(recorded.value.has_value());
  EXPECT_EQ(std::string(recorded.metric), "attention_cosine_heldout_lower95");
  EXPECT_EQ(recorded.missing,
            "the mapper's held-out attention-output cosine (0.877) has no 95% lower bound "
            "(quality.attention_cosine_heldout_lower95): it rests on one held-out sequence; "
            "refit with at least 16 held-out sequences");
  manifest.quality.heldout_sequences.reset();  // fitted before the counts were recorded
  EXPECT_EQ(MapperRecordedQuality(manifest).missing.find("one held-out sequence") !=
                std::string::npos,
            true);
  manifest.quality.heldout_sequences = 40;
  EXPECT_NE(MapperRecordedQuality(manifest).missing.find("before bounds were recorded"),
            std::string::npos);
}

TEST(MapperRecordedQualityTest, FallsBackToTheMeanHeldoutR2) {
  Manifest manifest;
  manifest.layers = {Layer(0, 0.9, 0.9), Layer(1, 0.4, 0.6)};
  const RecordedQuality recorded = MapperRecordedQuality(manifest);
  ASSERT_TRUE(recorded.value.has_value());
  EXPECT_DOUBLE_EQ(*recorded.value, 0.5);
  EXPECT_EQ(std::string(recorded.metric), "r2_heldout");
  EXPECT_EQ(std::string(recorded.description), "held-out R^2");
}

TEST(MapperRecordedQualityTest, NothingRecorded) {
  const RecordedQuality recorded = MapperRecordedQuality(Manifest());
  EXPECT_FALSE(recorded.value.has_value());
  EXPECT_EQ(std::string(recorded.metric), "r2_heldout");
}


TEST(MapperRecordedBenefitTest, NoneWhenNothingIsRecorded) {
  Manifest manifest;
  manifest.quality.attention_cosine_heldout = 0.95;  // a cosine is not a measured benefit
  manifest.quality.attention_cosine_heldout_lower95 = 0.94;
  EXPECT_FALSE(MapperRecordedBenefit(manifest).has_value());
}

TEST(MapperRecordedBenefitTest, IsTheEntryWithTheLowestBound) {
  Manifest manifest;
  manifest.quality.benefit = {TestBenefitRecord("docs", 0.6, 0.55), TestBenefitRecord("wiki", 0.5, 0.3),
                              TestBenefitRecord("code", 0.4, 0.3)};  // ties: the first listed is named
  const std::optional<RecordedBenefit> worst = MapperRecordedBenefit(manifest);
  ASSERT_TRUE(worst.has_value());
  EXPECT_EQ(worst->lower95, 0.3);  // the bound, never the point estimate
  EXPECT_EQ(worst->text, "wiki");
  manifest.quality.benefit = {TestBenefitRecord("docs", 0.6, 0.55)};
  ASSERT_TRUE(MapperRecordedBenefit(manifest).has_value());
  EXPECT_EQ(MapperRecordedBenefit(manifest)->text, "docs");
  EXPECT_EQ(MapperRecordedBenefit(manifest)->lower95, 0.55);
}

}  // namespace
}  // namespace kvt
