#include "mapper_store/hf_config.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

TEST(HfConfigTest, Llama31WithLlama3Scaling) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(R"({
    "_name_or_path": "meta-llama/Llama-3.1-8B", "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
    "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}})",
                                                 "config.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "meta-llama/Llama-3.1-8B");
  EXPECT_EQ(spec->num_layers, 32);
  EXPECT_EQ(spec->num_kv_heads, 8);
  EXPECT_EQ(spec->head_dim, 128);  // hidden_size / num_attention_heads
  EXPECT_EQ(spec->rope.rotary_dim, 128);
  EXPECT_EQ(spec->rope.theta, 500000.0);
  EXPECT_EQ(spec->rope.scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(spec->rope.scaling.factor, 8.0);
  EXPECT_EQ(spec->rope.scaling.original_max_position_embeddings, 8192);
}

TEST(HfConfigTest, Qwen3ExplicitHeadDimNoScalingAndNameOverride) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(R"({
    "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
    "hidden_size": 5120, "head_dim": 128, "rope_theta": 1000000, "rope_scaling": null})",
                                                 "config.json", "Qwen/Qwen3-14B");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "Qwen/Qwen3-14B");
  EXPECT_EQ(spec->head_dim, 128);
  EXPECT_EQ(spec->rope.scaling.type, RopeScalingType::kNone);
}

TEST(HfConfigTest, YarnPartialRotaryTextConfigAndDefaults) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(R"({
    "_name_or_path": "m", "architectures": ["Mistral3ForConditionalGeneration"],
    "text_config": {"num_hidden_layers": 26, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 262144,
      "partial_rotary_factor": 0.5,
      "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                          "beta_fast": 32.0, "beta_slow": 1.0}}})",
                                                 "config.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->num_layers, 26);
  EXPECT_EQ(spec->rope.rotary_dim, 64);
  EXPECT_EQ(spec->rope.theta, 1000000.0);
  EXPECT_EQ(spec->rope.scaling.type, RopeScalingType::kYarn);
  // original_max_position_embeddings absent: max_position_embeddings, as Hugging Face does.
  EXPECT_EQ(spec->rope.scaling.original_max_position_embeddings, 262144);
  EXPECT_FALSE(spec->rope.scaling.has_attention_factor);
}

TEST(HfConfigTest, LinearViaOldTypeKeyAndDefaultTheta) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(R"({"_name_or_path": "x",
    "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
    "rope_scaling": {"type": "linear", "factor": 2}})", "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->num_kv_heads, 4);  // no num_key_value_heads: no GQA
  EXPECT_EQ(spec->head_dim, 16);
  EXPECT_EQ(spec->rope.theta, 10000.0);
  EXPECT_EQ(spec->rope.scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(spec->rope.scaling.factor, 2.0);
}

TEST(HfConfigTest, ErrorsNameTheKeyOrType) {
  struct Case {
    const char* json;
    const char* message;
  };
  const Case cases[] = {
      {R"({"_name_or_path": "x", "num_attention_heads": 4, "hidden_size": 64})",
       "missing required key 'num_hidden_layers'"},
      {R"({"_name_or_path": "x", "num_hidden_layers": "two", "num_attention_heads": 4})",
       "key 'num_hidden_layers' must be a positive integer, got \"two\""},
      {R"({"_name_or_path": "x", "num_hidden_layers": 2, "num_key_value_heads": 2})",
       "missing required key 'head_dim'"},
      {R"({"_name_or_path": "x", "num_hidden_layers": 2, "num_attention_heads": 3,
           "hidden_size": 64})",
       "hidden_size 64 is not a multiple of num_attention_heads 3"},
      {R"({"_name_or_path": "x", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 2}})",
       "rope_scaling.rope_type 'dynamic' is not supported"},
      {R"({"_name_or_path": "x", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 64, "rope_scaling": {"rope_type": "longrope"}})",
       "'longrope' is not supported"},
      {R"({"_name_or_path": "x", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 64, "rope_scaling": {"rope_type": "llama3", "factor": 8}})",
       "missing required key 'rope_scaling.low_freq_factor'"},
      {R"({"_name_or_path": "x", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 64, "partial_rotary_factor": 0.2})",
       "rotary_dim 3, which is not"},
      {R"({"_name_or_path": "x", "num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 64, "rope_theta": "big"})",
       "key 'rope_theta' must be a number, got \"big\""},
      {R"({"_name_or_path": "x", "text_config": {"num_hidden_layers": 2,
           "num_attention_heads": 4.5, "hidden_size": 64}})",
       "key 'text_config.num_attention_heads' must be a positive integer, got 4.5"},
      {R"({"_name_or_path": "x", "text_config": {"num_hidden_layers": 2, "num_attention_heads": 4,
           "hidden_size": 64, "rope_parameters": {"rope_type": "llama3", "factor": 8,
           "low_freq_factor": 1, "high_freq_factor": "4"}}})",
       "key 'text_config.rope_parameters.high_freq_factor' must be a number, got \"4\""},
      {R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})", "no model name"},
      {R"([1, 2])", "not a JSON object"},
      {R"({"num_hidden_layers": )", "not valid JSON"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ModelSpec> spec = ParseHfConfig(c.json, "cfg.json");
    ASSERT_FALSE(spec.ok()) << c.json;
    EXPECT_THAT(spec.status().message(), HasSubstr(c.message)) << c.json;
    EXPECT_THAT(spec.status().message(), HasSubstr("cfg.json")) << c.json;
  }
}

}  // namespace
}  // namespace kvt
