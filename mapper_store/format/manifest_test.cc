#include "mapper_store/format/manifest.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

// A valid manifest, one line per element so tests can name line numbers (1-based).
std::vector<std::string> ExampleLines() {
  return {
      "# a mapper",                                                                     // 1
      "format_version: 1",                                                              // 2
      "kind: ridge",                                                                    // 3
      "synthetic: false",                                                               // 4
      "source:",                                                                        // 5
      "  name: Qwen/Qwen3-14B",                                                         // 6
      "  num_layers: 4",                                                                // 7
      "  num_kv_heads: 2",                                                              // 8
      "  head_dim: 8",                                                                  // 9
      "  rope: {theta: 1000000, rotary_dim: 8, style: neox, scaling: {type: none}}",    // 10
      "target:",                                                                        // 11
      "  name: Qwen/Qwen3-32B",                                                         // 12
      "  num_layers: 3",                                                                // 13
      "  num_kv_heads: 2",                                                              // 14
      "  head_dim: 8",                                                                  // 15
      "  rope:",                                                                        // 16
      "    theta: 500000",                                                              // 17
      "    rotary_dim: 8",                                                              // 18
      "    style: gptj",                                                                // 19
      "    scaling: {type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, "
      "original_max_position_embeddings: 8192}",                                        // 20
      "k: 2",                                                                           // 21
      "lambda: 0.01",                                                                   // 22
      "lambda_scale: sum",                                                              // 23
      "weights: {file: weights.safetensors, dtype: bf16}",                              // 24
      "layers:",                                                                        // 25
      "  - {target_layer: 0, sigma_k: [3, 1], sigma_v: [3], r2_k: 0.91, r2_v: 0.83}",    // 26
      "  - {target_layer: 1, sigma_k: [0], sigma_v: [2, 0], r2_k_heldout: -0.5}",        // 27
      "  - {target_layer: 2, sigma_k: [2], sigma_v: [1]}",                              // 28
      "calibration:",                                                                   // 29
      "  dataset: fineweb-edu",                                                         // 30
      "  sequences: 500",                                                               // 31
      "created_by: \"kvt fit 0.1\"",                                                    // 32
  };
}

std::string Join(const std::vector<std::string>& lines) { return absl::StrJoin(lines, "\n") + "\n"; }

// The example with line `line` (1-based) replaced.
std::string WithLine(int line, const std::string& replacement) {
  std::vector<std::string> lines = ExampleLines();
  lines[line - 1] = replacement;
  return Join(lines);
}

TEST(ManifestTest, ParsesTheExample) {
  absl::StatusOr<Manifest> m = ParseManifest(Join(ExampleLines()));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->kind, MapperKind::kRidge);
  EXPECT_FALSE(m->synthetic);
  EXPECT_EQ(m->source.name, "Qwen/Qwen3-14B");
  EXPECT_EQ(m->source.num_layers, 4);
  EXPECT_EQ(m->source.rope.theta, 1e6);
  EXPECT_EQ(m->source.rope.style, RopeStyle::kNeox);
  EXPECT_EQ(m->target.rope.style, RopeStyle::kGptj);
  EXPECT_EQ(m->target.rope.scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(m->target.rope.scaling.factor, 8);
  EXPECT_EQ(m->target.rope.scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(m->k, 2);
  EXPECT_EQ(m->lambda, 0.01);
  EXPECT_EQ(m->lambda_scale, LambdaScale::kSum);
  EXPECT_EQ(m->weights_dtype, DType::kBF16);
  ASSERT_EQ(m->layers.size(), 3u);
  EXPECT_EQ(m->layers[0].sigma_k, (std::vector<int>{3, 1}));
  EXPECT_EQ(m->layers[1].sigma_v, (std::vector<int>{2, 0}));
  EXPECT_EQ(*m->layers[0].r2_k, 0.91);
  EXPECT_FALSE(m->layers[0].r2_k_heldout.has_value());
  EXPECT_EQ(*m->layers[1].r2_k_heldout, -0.5);
  EXPECT_NE(m->calibration_yaml.find("sequences: 500"), std::string::npos);
  EXPECT_EQ(m->created_by, "kvt fit 0.1");
}

TEST(ManifestTest, MlpGranularityNamesRoundTrip) {
  for (MlpGranularity granularity : {MlpGranularity::kPerLayer, MlpGranularity::kPerHead}) {
    EXPECT_EQ(ParseMlpGranularity(MlpGranularityName(granularity)), granularity);
  }
  EXPECT_EQ(ParseMlpGranularity("per-head"), std::nullopt);
  EXPECT_EQ(ParseMlpGranularity(""), std::nullopt);
}

TEST(ManifestTest, MakeMlpConfigNamesTheBadFlag) {
  absl::StatusOr<MlpConfig> config = MakeMlpConfig(64, "per_head");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden, 64);
  EXPECT_EQ(config->granularity, MlpGranularity::kPerHead);
  KVT_EXPECT_ERROR(MakeMlpConfig(0, "per_layer"), absl::StatusCode::kInvalidArgument,
                   "--mlp_hidden=0 must be >= 1");
  KVT_EXPECT_ERROR(MakeMlpConfig(8, "per_token"), absl::StatusCode::kInvalidArgument,
                   "--mlp_granularity='per_token' must be per_layer or per_head");
}

TEST(ManifestTest, EmitThenParseIsIdentity) {
  absl::StatusOr<Manifest> m = ParseManifest(Join(ExampleLines()));
  ASSERT_TRUE(m.ok()) << m.status();
  m->target.rope.scaling = RopeScaling();
  m->target.rope.scaling.type = RopeScalingType::kYarn;
  m->target.rope.scaling.factor = 16;
  m->target.rope.scaling.original_max_position_embeddings = 16384;
  m->target.rope.scaling.has_attention_factor = true;
  m->target.rope.scaling.attention_factor = 1.0;
  m->lambda = 1e-7;
  absl::StatusOr<std::string> text = EmitManifest(*m);
  ASSERT_TRUE(text.ok()) << text.status();
  absl::StatusOr<Manifest> back = ParseManifest(*text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << *text;
  absl::StatusOr<std::string> again = EmitManifest(*back);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *text);
  EXPECT_EQ(back->lambda, 1e-7);
  EXPECT_EQ(back->layers[0].r2_v, m->layers[0].r2_v);
  EXPECT_EQ(back->target.rope.scaling.type, RopeScalingType::kYarn);
  EXPECT_TRUE(back->target.rope.scaling.has_attention_factor);
  EXPECT_EQ(back->calibration_yaml, m->calibration_yaml);
  EXPECT_NE(text->find("sigma_k: [3, 1]"), std::string::npos) << *text;
}

// The held-out quality `kvt fit` records: per layer and the top-level `quality:` map, optional,
// round-tripped exactly; a manifest without them (the example) keeps them absent.
TEST(ManifestTest, HeldoutQualityFieldsRoundTrip) {
  absl::StatusOr<Manifest> plain = ParseManifest(Join(ExampleLines()));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(plain->quality.empty());
  for (const LayerEntry& layer : plain->layers) EXPECT_FALSE(layer.attention_cosine_heldout);
  absl::StatusOr<std::string> plain_text = EmitManifest(*plain);
  ASSERT_TRUE(plain_text.ok());
  EXPECT_EQ(plain_text->find("quality"), std::string::npos) << *plain_text;

  std::vector<std::string> lines = ExampleLines();
  lines[24] =
      "quality: {attention_cosine_heldout: 0.9731, attention_cosine_heldout_all_layers: "
      "0.98125, attention_cosine_heldout_lower95: 0.9625, heldout_sequences: 12, "
      "heldout_tokens: 6144, r2_heldout: -0.25, kv_cosine_heldout: 0.875}";
  lines.insert(lines.begin() + 25, "layers:");  // the example's line 25 became `quality:`
  lines[26] = "  - {target_layer: 0, sigma_k: [3, 1], sigma_v: [3], attention_cosine_heldout: 0.999}";
  lines[27] =
      "  - {target_layer: 1, sigma_k: [0], sigma_v: [2, 0], r2_k_heldout: -0.5, "
      "attention_cosine_heldout: -0.125}";
  absl::StatusOr<Manifest> m = ParseManifest(Join(lines));
  ASSERT_TRUE(m.ok()) << m.status() << "\n" << Join(lines);
  EXPECT_EQ(m->quality.attention_cosine_heldout, 0.9731);
  EXPECT_EQ(m->quality.attention_cosine_heldout_all_layers, 0.98125);
  EXPECT_EQ(m->quality.r2_heldout, -0.25);
  EXPECT_EQ(m->quality.attention_cosine_heldout_lower95, 0.9625);
  EXPECT_EQ(m->quality.heldout_sequences, 12);
  EXPECT_EQ(m->quality.heldout_tokens, 6144);
  EXPECT_EQ(m->quality.kv_cosine_heldout, 0.875);
  EXPECT_EQ(m->layers[0].attention_cosine_heldout, 0.999);
  EXPECT_EQ(m->layers[1].attention_cosine_heldout, -0.125);
  EXPECT_FALSE(m->layers[2].attention_cosine_heldout);
  absl::StatusOr<std::string> text = EmitManifest(*m);
  ASSERT_TRUE(text.ok()) << text.status();
  absl::StatusOr<Manifest> back = ParseManifest(*text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << *text;
  EXPECT_EQ(back->quality.attention_cosine_heldout, m->quality.attention_cosine_heldout);
  EXPECT_EQ(back->quality.attention_cosine_heldout_all_layers,
            m->quality.attention_cosine_heldout_all_layers);
  EXPECT_EQ(back->quality.r2_heldout, m->quality.r2_heldout);
  EXPECT_EQ(back->quality.attention_cosine_heldout_lower95,
            m->quality.attention_cosine_heldout_lower95);
  EXPECT_EQ(back->quality.heldout_sequences, m->quality.heldout_sequences);
  EXPECT_EQ(back->quality.heldout_tokens, m->quality.heldout_tokens);
  EXPECT_EQ(back->quality.kv_cosine_heldout, m->quality.kv_cosine_heldout);
  for (size_t l = 0; l < m->layers.size(); ++l) {
    EXPECT_EQ(back->layers[l].attention_cosine_heldout, m->layers[l].attention_cosine_heldout);
  }
  absl::StatusOr<std::string> again = EmitManifest(*back);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *text);
  EXPECT_NE(text->find("attention_cosine_heldout: 0.9731"), std::string::npos) << *text;

  // Only some fields, or an empty map: the rest stay absent.
  lines[24] = "quality: {r2_heldout: 0.5}";
  absl::StatusOr<Manifest> partial = ParseManifest(Join(lines));
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_FALSE(partial->quality.attention_cosine_heldout);
  EXPECT_FALSE(partial->quality.kv_cosine_heldout);  // older manifests: valid without it
  EXPECT_EQ(partial->quality.r2_heldout, 0.5);
  lines[24] = "quality: {}";
  absl::StatusOr<Manifest> empty = ParseManifest(Join(lines));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->quality.empty());

  // Still strict: unknown keys, non-numbers and impossible values are named.
  lines[24] = "quality: {attention_cosine: 0.9}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":25: unknown key 'quality.attention_cosine'");
  lines[24] = "quality: {attention_cosine_heldout: high}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   "key 'quality.attention_cosine_heldout' must be a number, got 'high'");
  lines[24] = "quality: {attention_cosine_heldout_all_layers: 1.5}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   "quality.attention_cosine_heldout_all_layers = 1.5 is not a valid cosine");
  lines[24] = "quality: {kv_cosine_heldout: -1.5}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   "quality.kv_cosine_heldout = -1.5 is not a valid cosine");
  lines[24] = "quality: {r2_heldout: 2}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   "quality.r2_heldout = 2 is not a valid R^2");
  lines[24] = "quality: {attention_cosine_heldout: 0.9, attention_cosine_heldout_lower95: 0.95}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   "quality.attention_cosine_heldout_lower95 needs an attention_cosine_heldout "
                   "at least as large");
  lines[24] = "quality: {heldout_sequences: 0}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   "quality.heldout_sequences = 0 is not positive");
  lines[24] = "quality: {heldout_tokens: 1.5}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   "key 'quality.heldout_tokens' must be an integer");
  lines[24] = "quality: [0.9]";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   "key 'quality' must be a map, got a list");
  lines[24] = "quality: {}";
  lines[28] = "  - {target_layer: 2, sigma_k: [2], sigma_v: [1], attention_cosine_heldout: -2}";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":29: layers[2].attention_cosine_heldout = -2 is not a valid cosine");
}

// quality.benefit: a block list of one flow map per text after the cosine summaries.
std::vector<std::string> BenefitLines(const std::vector<std::string>& entries) {
  std::vector<std::string> lines = ExampleLines();
  std::vector<std::string> quality = {"quality:", "  attention_cosine_heldout: 0.93",
                                      "  attention_cosine_heldout_lower95: 0.91", "  benefit:"};
  for (const std::string& entry : entries) quality.push_back("    - " + entry);
  lines.insert(lines.begin() + 24, quality.begin(), quality.end());  // before `layers:`
  return lines;
}

constexpr char kPythonDocs[] =
    "{text: python-docs-heldout, windows: 64, context_tokens: 384, continuation_tokens: 96, "
    "recovered: 0.64, lower95: 0.5, upper95: 0.86, kl: 0.12}";
constexpr char kWiki[] =
    "{text: wiki_2.v1, windows: 2, context_tokens: 1, continuation_tokens: 1, recovered: -0.25, "
    "lower95: -1.5, upper95: 1.25, kl: 0}";

TEST(ManifestTest, BenefitParsesAndRoundTrips) {
  absl::StatusOr<Manifest> m = ParseManifest(Join(BenefitLines({kPythonDocs, kWiki})));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->quality.benefit.size(), 2u);
  const BenefitRecord& docs = m->quality.benefit[0];
  EXPECT_EQ(docs.text, "python-docs-heldout");
  EXPECT_EQ(docs.windows, 64);
  EXPECT_EQ(docs.context_tokens, 384);
  EXPECT_EQ(docs.continuation_tokens, 96);
  EXPECT_EQ(docs.recovered, 0.64);
  EXPECT_EQ(docs.lower95, 0.5);
  EXPECT_EQ(docs.upper95, 0.86);
  EXPECT_EQ(docs.kl, 0.12);
  EXPECT_EQ(m->quality.benefit[1].text, "wiki_2.v1");
  EXPECT_EQ(m->quality.benefit[1].recovered, -0.25);  // worse than no context: still a record
  EXPECT_EQ(m->quality.attention_cosine_heldout_lower95, 0.91);

  absl::StatusOr<std::string> text = EmitManifest(*m);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("quality:\n  attention_cosine_heldout: 0.93\n"), std::string::npos)
      << *text;
  EXPECT_NE(text->find("  benefit:\n    - {text: python-docs-heldout, windows: 64, "
                       "context_tokens: 384, continuation_tokens: 96, recovered: 0.64, "
                       "lower95: 0.5, upper95: 0.86, kl: 0.12}\n"),
            std::string::npos)
      << *text;
  absl::StatusOr<Manifest> back = ParseManifest(*text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << *text;
  ASSERT_EQ(back->quality.benefit.size(), 2u);
  EXPECT_EQ(back->quality.benefit[1].lower95, -1.5);
  EXPECT_EQ(back->quality.benefit[1].upper95, 1.25);
  absl::StatusOr<std::string> again = EmitManifest(*back);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *text);

  // Without benefit the quality map stays the one flow line it always was.
  back->quality.benefit.clear();
  absl::StatusOr<std::string> plain = EmitManifest(*back);
  ASSERT_TRUE(plain.ok());
  EXPECT_NE(plain->find("quality: {attention_cosine_heldout: 0.93, "
                        "attention_cosine_heldout_lower95: 0.91}\n"),
            std::string::npos)
      << *plain;
  Manifest only_benefit = *m;
  only_benefit.quality = ManifestQuality();
  EXPECT_TRUE(only_benefit.quality.empty());
  only_benefit.quality.benefit = m->quality.benefit;
  EXPECT_FALSE(only_benefit.quality.empty());
  absl::StatusOr<std::string> only = EmitManifest(only_benefit);
  ASSERT_TRUE(only.ok()) << only.status();
  absl::StatusOr<Manifest> only_back = ParseManifest(*only);
  ASSERT_TRUE(only_back.ok()) << only_back.status() << "\n" << *only;
  EXPECT_EQ(only_back->quality.benefit.size(), 2u);
  EXPECT_FALSE(only_back->quality.attention_cosine_heldout);
}

// Existing manifests emit byte-identically, so their SHA256SUMS stay valid.
TEST(ManifestTest, TheDemoManifestRoundTripsByteIdentically) {
  const std::string path =
      absl::StrCat(std::getenv("TEST_SRCDIR"), "/kvt/demo/mappers/demo-tiny/manifest.yaml");
  absl::StatusOr<std::string> original = ReadFileToString(path);
  ASSERT_TRUE(original.ok()) << original.status();
  absl::StatusOr<Manifest> m = ParseManifest(*original);
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<std::string> text = EmitManifest(*m);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, *original);
}

TEST(ManifestTest, BenefitErrorsNameTheField) {
  const std::string ok = kPythonDocs;
  // Line 30: the second entry (quality: is line 25, benefit: 28).
  KVT_EXPECT_ERROR(ParseManifest(Join(BenefitLines({ok, ok}))), StatusCode::kInvalidArgument,
                   ":30: quality.benefit[1].text 'python-docs-heldout' is already "
                   "quality.benefit[0] (one entry per text)");
  const std::string wiki = absl::StrReplaceAll(ok, {{"python-docs-heldout", "wiki"}});
  const auto second = [&](absl::string_view from, absl::string_view to) {
    return Join(BenefitLines({ok, absl::StrReplaceAll(wiki, {{from, to}})}));
  };
  KVT_EXPECT_ERROR(ParseManifest(second("lower95: 0.5", "lower95: 0.7")),
                   StatusCode::kInvalidArgument,
                   ":30: quality.benefit[1].lower95 = 0.7 exceeds recovered 0.64");
  KVT_EXPECT_ERROR(ParseManifest(second("upper95: 0.86", "upper95: 0.6")),
                   StatusCode::kInvalidArgument,
                   "quality.benefit[1].upper95 = 0.6 is below recovered 0.64");
  KVT_EXPECT_ERROR(ParseManifest(second("windows: 64", "windows: 1")),
                   StatusCode::kInvalidArgument, "quality.benefit[1].windows = 1 must be >= 2");
  KVT_EXPECT_ERROR(ParseManifest(second("context_tokens: 384", "context_tokens: 0")),
                   StatusCode::kInvalidArgument,
                   "quality.benefit[1].context_tokens = 0 must be >= 1");
  KVT_EXPECT_ERROR(ParseManifest(second("continuation_tokens: 96", "continuation_tokens: -1")),
                   StatusCode::kInvalidArgument,
                   "quality.benefit[1].continuation_tokens = -1 must be >= 1");
  KVT_EXPECT_ERROR(ParseManifest(second("kl: 0.12", "kl: -0.01")), StatusCode::kInvalidArgument,
                   "quality.benefit[1].kl = -0.01 must be >= 0");
  KVT_EXPECT_ERROR(ParseManifest(second("recovered: 0.64", "recovered: .nan")),
                   StatusCode::kInvalidArgument, "quality.benefit[1].recovered = .nan is not finite");
  KVT_EXPECT_ERROR(ParseManifest(second("text: wiki", "text: 'a b'")),
                   StatusCode::kInvalidArgument,
                   "quality.benefit[1].text 'a b' must be a non-empty name");
  KVT_EXPECT_ERROR(ParseManifest(second("text: wiki", "text: ''")), StatusCode::kInvalidArgument,
                   "quality.benefit[1].text '' must be a non-empty name");
  KVT_EXPECT_ERROR(ParseManifest(second("windows: 64", "windows: 6.5")),
                   StatusCode::kInvalidArgument,
                   "key 'quality.benefit[1].windows' must be an integer");
  KVT_EXPECT_ERROR(ParseManifest(second("lower95: 0.5", "lower95: low")),
                   StatusCode::kInvalidArgument,
                   "key 'quality.benefit[1].lower95' must be a number, got 'low'");
  KVT_EXPECT_ERROR(ParseManifest(second(", kl: 0.12", "")), StatusCode::kInvalidArgument,
                   "quality.benefit[1].kl");
  KVT_EXPECT_ERROR(ParseManifest(second("kl:", "kl_nats:")), StatusCode::kInvalidArgument,
                   "unknown key 'quality.benefit[1].kl_nats'");
  std::vector<std::string> scalar = BenefitLines({});
  scalar[27] = "  benefit: 0.5";
  KVT_EXPECT_ERROR(ParseManifest(Join(scalar)), StatusCode::kInvalidArgument,
                   "key 'quality.benefit' must be a list");

  // Hand-built manifests get the same checks, without a line.
  absl::StatusOr<Manifest> m = ParseManifest(Join(BenefitLines({ok})));
  ASSERT_TRUE(m.ok()) << m.status();
  m->quality.benefit[0].upper95 = 0.1;
  KVT_EXPECT_ERROR(ValidateManifest(*m), StatusCode::kInvalidArgument,
                   "manifest: quality.benefit[0].upper95 = 0.1 is below recovered 0.64");
  KVT_EXPECT_ERROR(ValidateBenefitRecord(m->quality.benefit[0], "benefit[3]"),
                   StatusCode::kInvalidArgument, "benefit[3].upper95 = 0.1 is below");
}

TEST(ManifestTest, UnknownKeyNamesKeyAndLine) {
  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "colour: red")), StatusCode::kInvalidArgument,
                   "manifest.yaml:4: unknown key 'colour' (allowed: format_version, kind");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(9, "  head_dims: 8")), StatusCode::kInvalidArgument,
                   ":9: unknown key 'source.head_dims'");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(19, "    stlye: gptj")), StatusCode::kInvalidArgument,
                   ":19: unknown key 'target.rope.stlye'");
  KVT_EXPECT_ERROR(
      ParseManifest(WithLine(28, "  - {target_layer: 2, sigma_k: [2], sigma_v: [1], r2: 1}")),
      StatusCode::kInvalidArgument, ":28: unknown key 'layers[2].r2'");
}

TEST(ManifestTest, UnknownKeyErrorUsesTheGivenLabel) {
  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "colour: red"), "/store/m/manifest.yaml"),
                   StatusCode::kInvalidArgument, "/store/m/manifest.yaml:4: unknown key");
}

TEST(ManifestTest, DuplicateKey) {
  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "kind: ridge")), StatusCode::kInvalidArgument,
                   ":4: duplicate key 'kind'");
}

TEST(ManifestTest, MissingRequiredKeyIsNamed) {
  KVT_EXPECT_ERROR(ParseManifest(WithLine(15, "")), StatusCode::kInvalidArgument,
                   "missing required key 'target.head_dim'");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(21, "")), StatusCode::kInvalidArgument,
                   "missing required key 'k'");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(28, "  - {target_layer: 2, sigma_k: [2]}")),
                   StatusCode::kInvalidArgument,
                   ":28: missing required key 'layers[2].sigma_v'");
}

TEST(ManifestTest, UnsupportedFormatVersion) {
  // Checked before unknown keys: a newer manifest names the version, not its new keys.
  std::vector<std::string> lines = ExampleLines();
  lines[1] = "format_version: 2";
  lines.push_back("new_v2_key: 1");
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":2: unsupported format_version 2 (this build reads format_version 1)");
}

TEST(ManifestTest, MlpKindParsesAndRoundTrips) {
  // Line 4 (synthetic) becomes the mlp map; every other line stays the ridge example's.
  std::vector<std::string> lines = ExampleLines();
  lines[2] = "kind: mlp";
  lines[3] = "mlp: {hidden: 64, granularity: per_head, activation: relu}";
  absl::StatusOr<Manifest> m = ParseManifest(Join(lines));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->kind, MapperKind::kMlp);
  ASSERT_TRUE(m->mlp.has_value());
  EXPECT_EQ(m->mlp->hidden, 64);
  EXPECT_EQ(m->mlp->granularity, MlpGranularity::kPerHead);
  absl::StatusOr<std::string> text = EmitManifest(*m);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("kind: mlp\nmlp: {hidden: 64, granularity: per_head, activation: relu}"),
            std::string::npos)
      << *text;
  absl::StatusOr<Manifest> back = ParseManifest(*text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << *text;
  EXPECT_EQ(back->kind, MapperKind::kMlp);
  EXPECT_EQ(back->mlp->hidden, 64);
  EXPECT_EQ(back->mlp->granularity, MlpGranularity::kPerHead);
  EXPECT_EQ(*EmitManifest(*back), *text);

  // activation is optional (relu is the only one); per_layer.
  lines[3] = "mlp: {granularity: per_layer, hidden: 1}";
  m = ParseManifest(Join(lines));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->mlp->hidden, 1);
  EXPECT_EQ(m->mlp->granularity, MlpGranularity::kPerLayer);
  // Ridge manifests carry no mlp map and emit none.
  m = ParseManifest(Join(ExampleLines()));
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(m->mlp.has_value());
  EXPECT_EQ(EmitManifest(*m)->find("mlp"), std::string::npos);
}

// `ridge: {granularity: per_head}` (line 4 replaces `synthetic`): parsed, emitted after kind,
// absent for per_layer (existing manifests stay byte-identical), checked against kind and heads.
TEST(ManifestTest, RidgeGranularityParsesRoundTripsAndIsChecked) {
  absl::StatusOr<Manifest> m = ParseManifest(WithLine(4, "ridge: {granularity: per_head}"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->ridge_granularity, RidgeGranularity::kPerHead);
  absl::StatusOr<std::string> text = EmitManifest(*m);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("kind: ridge\nridge: {granularity: per_head}\n"), std::string::npos)
      << *text;
  absl::StatusOr<Manifest> back = ParseManifest(*text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ridge_granularity, RidgeGranularity::kPerHead);
  EXPECT_EQ(*EmitManifest(*back), *text);

  // per_layer spelled out reads as the default and is not emitted.
  m = ParseManifest(WithLine(4, "ridge: {granularity: per_layer}"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->ridge_granularity, RidgeGranularity::kPerLayer);
  EXPECT_EQ(*EmitManifest(*m), *EmitManifest(*ParseManifest(Join(ExampleLines()))));
  EXPECT_EQ(EmitManifest(*m)->find("ridge:"), std::string::npos);

  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "ridge: {granularity: per_token}")),
                   StatusCode::kInvalidArgument,
                   ":4: ridge.granularity 'per_token' must be per_layer or per_head");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "ridge: {shape: per_head}")),
                   StatusCode::kInvalidArgument, "ridge.shape");
  std::vector<std::string> lines = ExampleLines();
  lines[2] = "kind: mlp";
  lines[3] = "mlp: {hidden: 4, granularity: per_head}";
  lines.insert(lines.begin() + 4, "ridge: {granularity: per_head}");
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":5: key 'ridge' is only valid with kind: ridge, but kind is mlp");
  // Head counts neither divides: both named.
  lines = ExampleLines();
  lines[3] = "ridge: {granularity: per_head}";
  lines[13] = "  num_kv_heads: 3";
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":4: ridge.granularity per_head: per_head ridge needs one head count to divide "
                   "the other, but source.num_kv_heads=2 and target.num_kv_heads=3");
  // A built manifest: kind mlp with per_head ridge granularity is refused by name.
  m = ParseManifest(WithLine(4, "ridge: {granularity: per_head}"));
  ASSERT_TRUE(m.ok());
  m->kind = MapperKind::kMlp;
  m->mlp = MlpConfig();
  KVT_EXPECT_ERROR(ValidateManifest(*m), StatusCode::kInvalidArgument,
                   "ridge.granularity per_head is only valid with kind: ridge, but kind is mlp");
  EXPECT_EQ(ParseRidgeGranularity("per_head"), RidgeGranularity::kPerHead);
  EXPECT_EQ(ParseRidgeGranularity("per_layer"), RidgeGranularity::kPerLayer);
  EXPECT_FALSE(ParseRidgeGranularity("dense").has_value());
}

// `window` (line 4 replaces `synthetic`): parsed, emitted right after k, omitted when 1 so that
// token-wise manifests read as before windows existed, and out-of-range values named.
TEST(ManifestTest, WindowParsesRoundTripsAndIsChecked) {
  absl::StatusOr<Manifest> m = ParseManifest(WithLine(4, "window: 4"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->window, 4);
  absl::StatusOr<std::string> text = EmitManifest(*m);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("k: 2\nwindow: 4\n"), std::string::npos) << *text;
  absl::StatusOr<Manifest> back = ParseManifest(*text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->window, 4);
  m = ParseManifest(Join(ExampleLines()));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->window, 1);
  EXPECT_EQ(EmitManifest(*m)->find("window"), std::string::npos);
  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "window: 0")), StatusCode::kInvalidArgument,
                   ":4: window = 0 must be between 1 and 64");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "window: 65")), StatusCode::kInvalidArgument,
                   ":4: window = 65 must be between 1 and 64");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "window: two")), StatusCode::kInvalidArgument,
                   "window");
}

TEST(ManifestTest, MlpErrorsNameTheKey) {
  std::vector<std::string> lines = ExampleLines();
  lines[2] = "kind: mlp";
  const auto with_mlp = [&](const std::string& line4) {
    std::vector<std::string> edited = lines;
    edited[3] = line4;
    return ParseManifest(Join(edited));
  };
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":3: missing required key 'mlp' (kind: mlp needs");
  KVT_EXPECT_ERROR(with_mlp("mlp: {hidden: 0, granularity: per_layer}"),
                   StatusCode::kInvalidArgument, ":4: mlp.hidden must be >= 1, got 0");
  KVT_EXPECT_ERROR(with_mlp("mlp: {hidden: -3, granularity: per_layer}"),
                   StatusCode::kInvalidArgument, "mlp.hidden must be >= 1, got -3");
  KVT_EXPECT_ERROR(with_mlp("mlp: {hidden: wide, granularity: per_layer}"),
                   StatusCode::kInvalidArgument,
                   ":4: key 'mlp.hidden' must be an integer, got 'wide'");
  KVT_EXPECT_ERROR(with_mlp("mlp: {hidden: 8, granularity: per_token}"),
                   StatusCode::kInvalidArgument,
                   ":4: mlp.granularity 'per_token' must be per_layer or per_head");
  KVT_EXPECT_ERROR(with_mlp("mlp: {hidden: 8}"), StatusCode::kInvalidArgument,
                   "missing required key 'mlp.granularity'");
  KVT_EXPECT_ERROR(with_mlp("mlp: {granularity: per_head}"), StatusCode::kInvalidArgument,
                   "missing required key 'mlp.hidden'");
  KVT_EXPECT_ERROR(with_mlp("mlp: {hidden: 8, granularity: per_head, depth: 3}"),
                   StatusCode::kInvalidArgument,
                   ":4: unknown key 'mlp.depth' (allowed: hidden, granularity, activation)");
  KVT_EXPECT_ERROR(with_mlp("mlp: {hidden: 8, granularity: per_head, activation: gelu}"),
                   StatusCode::kInvalidArgument, "mlp.activation 'gelu' is not supported");
  KVT_EXPECT_ERROR(with_mlp("mlp: 1024"), StatusCode::kInvalidArgument,
                   ":4: key 'mlp' must be a map, got '1024'");
  // mlp with kind: ridge names the key.
  KVT_EXPECT_ERROR(ParseManifest(WithLine(4, "mlp: {hidden: 8, granularity: per_layer}")),
                   StatusCode::kInvalidArgument,
                   ":4: key 'mlp' is only valid with kind: mlp, but kind is ridge");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(3, "kind: lasso")), StatusCode::kInvalidArgument,
                   "unknown kind 'lasso' (expected ridge or mlp)");

  // The same rules for manifests built in code.
  absl::StatusOr<Manifest> m = ParseManifest(Join(ExampleLines()));
  ASSERT_TRUE(m.ok());
  m->kind = MapperKind::kMlp;
  KVT_EXPECT_ERROR(ValidateManifest(*m), StatusCode::kInvalidArgument,
                   "manifest: kind: mlp needs the 'mlp' map");
  m->mlp = MlpConfig{0, MlpGranularity::kPerLayer};
  KVT_EXPECT_ERROR(EmitManifest(*m), StatusCode::kInvalidArgument, "mlp.hidden must be >= 1");
  m->mlp->hidden = 16;
  EXPECT_TRUE(ValidateManifest(*m).ok());
  m->kind = MapperKind::kRidge;
  KVT_EXPECT_ERROR(ValidateManifest(*m), StatusCode::kInvalidArgument,
                   "key 'mlp' is only valid with kind: mlp");
}

TEST(ManifestTest, SigmaOutOfRangeNamesTheLayer) {
  KVT_EXPECT_ERROR(
      ParseManifest(WithLine(27, "  - {target_layer: 1, sigma_k: [0, 4], sigma_v: [2]}")),
      StatusCode::kInvalidArgument,
      ":27: layers[1].sigma_k[1] = 4 is out of range: source.num_layers is 4 (target layer 1)");
  KVT_EXPECT_ERROR(
      ParseManifest(WithLine(27, "  - {target_layer: 1, sigma_k: [0], sigma_v: [-1]}")),
      StatusCode::kInvalidArgument, "layers[1].sigma_v[0] = -1 is out of range");
}

TEST(ManifestTest, SigmaWithMultiLineLayerEntryPointsAtTheList) {
  std::vector<std::string> lines = ExampleLines();
  lines[27] = "  - target_layer: 2";
  lines.insert(lines.begin() + 28, {"    sigma_k: [2]", "    sigma_v: [9]"});
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":30: layers[2].sigma_v[0] = 9 is out of range");
}

TEST(ManifestTest, LayerStructureErrors) {
  KVT_EXPECT_ERROR(ParseManifest(WithLine(28, "")), StatusCode::kInvalidArgument,
                   "layers has 2 entries but target.num_layers is 3");
  KVT_EXPECT_ERROR(
      ParseManifest(WithLine(28, "  - {target_layer: 7, sigma_k: [2], sigma_v: [1]}")),
      StatusCode::kInvalidArgument, ":28: layers[2].target_layer is 7, expected 2");
  KVT_EXPECT_ERROR(
      ParseManifest(WithLine(28, "  - {target_layer: 2, sigma_k: [2, 2], sigma_v: [1]}")),
      StatusCode::kInvalidArgument, "lists source layer 2 twice");
  KVT_EXPECT_ERROR(
      ParseManifest(WithLine(28, "  - {target_layer: 2, sigma_k: [2, 1, 0], sigma_v: [1]}")),
      StatusCode::kInvalidArgument, "layers[2].sigma_k has 3 entries but k is 2");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(28, "  - {target_layer: 2, sigma_k: [], sigma_v: [1]}")),
                   StatusCode::kInvalidArgument, "layers[2].sigma_k is empty");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(21, "k: 3")), StatusCode::kInvalidArgument,
                   ":21: k = 3 but the longest sigma list has 2 entries");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(21, "k: 5")), StatusCode::kInvalidArgument,
                   "k = 5 must be between 1 and source.num_layers (4)");
}

TEST(ManifestTest, RopeIsValidated) {
  KVT_EXPECT_ERROR(
      ParseManifest(WithLine(10, "  rope: {theta: 10000, rotary_dim: 10, style: neox}")),
      StatusCode::kInvalidArgument, ":10: source.rope: ");
  KVT_EXPECT_ERROR(
      ParseManifest(WithLine(10, "  rope: {theta: 10000, rotary_dim: 8, style: neox, "
                                 "scaling: {type: dynamic, factor: 2}}")),
      StatusCode::kInvalidArgument, "dynamic");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(19, "    style: sideways")),
                   StatusCode::kInvalidArgument, ":19: target.rope.style");
  // Scaling absent means none.
  absl::StatusOr<Manifest> m =
      ParseManifest(WithLine(10, "  rope: {theta: 10000, rotary_dim: 4, style: neox}"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->source.rope.scaling.type, RopeScalingType::kNone);
  EXPECT_EQ(m->source.rope.rotary_dim, 4);
}

TEST(ManifestTest, WrongScalarTypes) {
  KVT_EXPECT_ERROR(ParseManifest(WithLine(21, "k: eight")), StatusCode::kInvalidArgument,
                   ":21: key 'k' must be an integer, got 'eight'");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(7, "  num_layers: [4]")), StatusCode::kInvalidArgument,
                   ":7: key 'source.num_layers' must be an integer, got a list");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(24, "weights: {file: weights.safetensors, dtype: int8}")),
                   StatusCode::kInvalidArgument, ":24: weights.dtype: unsupported dtype 'int8'");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(24, "weights: {file: ../x.safetensors, dtype: bf16}")),
                   StatusCode::kInvalidArgument, "must be a plain file name");
  KVT_EXPECT_ERROR(ParseManifest(WithLine(23, "lambda_scale: mean")),
                   StatusCode::kInvalidArgument, "lambda_scale 'mean' must be covariance or sum");
  std::vector<std::string> lines = ExampleLines();
  lines.erase(lines.begin() + 28, lines.begin() + 31);
  lines.insert(lines.begin() + 28, "calibration: 5");
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":29: calibration must be a map");
}

// Found by manifest_fuzzer: a calibration key starting with bytes FE FF (not UTF-8) parsed, but its
// dumped text read back as UTF-16, so the parsed manifest failed ValidateManifest and could not be
// emitted. The parser now refuses it, at the calibration line.
TEST(ManifestTest, CalibrationThatDoesNotReadBackIsRefusedByTheParser) {
  std::vector<std::string> lines = ExampleLines();
  lines[29] = "  \xfe\xff\xff\xff" "generator: random normal";
  lines[30] = "  seed: 1";
  lines.insert(lines.begin() + 31, "  weight_scale:: 0.01");
  KVT_EXPECT_ERROR(ParseManifest(Join(lines)), StatusCode::kInvalidArgument,
                   ":30: calibration must be a YAML map that reads back as one");
}

TEST(ManifestTest, YamlSyntaxErrorHasALine) {
  KVT_EXPECT_ERROR(ParseManifest(WithLine(26, "  - {target_layer: 0, sigma_k: [3, 1")),
                   StatusCode::kInvalidArgument, "invalid YAML");
  KVT_EXPECT_ERROR(ParseManifest("- 1\n- 2\n"), StatusCode::kInvalidArgument,
                   "must be a YAML map");
}

TEST(ManifestTest, ValidateNamesFieldsOfHandBuiltManifests) {
  absl::StatusOr<Manifest> m = ParseManifest(Join(ExampleLines()));
  ASSERT_TRUE(m.ok());
  KVT_EXPECT_OK(ValidateManifest(*m));
  Manifest bad = *m;
  bad.layers[2].sigma_v = {4};
  KVT_EXPECT_ERROR(ValidateManifest(bad), StatusCode::kInvalidArgument,
                   "layers[2].sigma_v[0] = 4 is out of range");
  KVT_EXPECT_ERROR(EmitManifest(bad), StatusCode::kInvalidArgument, "out of range");
  bad = *m;
  bad.format_version = 3;
  KVT_EXPECT_ERROR(ValidateManifest(bad), StatusCode::kInvalidArgument,
                   "unsupported format_version 3");
  bad = *m;
  bad.layers[0].r2_k = 1.5;
  KVT_EXPECT_ERROR(ValidateManifest(bad), StatusCode::kInvalidArgument, "not a valid R^2");
  bad = *m;
  bad.source.num_kv_heads = 0;
  KVT_EXPECT_ERROR(ValidateManifest(bad), StatusCode::kInvalidArgument,
                   "source.num_kv_heads must be >= 1");
  bad = *m;
  bad.calibration_yaml = "[1, 2]";
  KVT_EXPECT_ERROR(ValidateManifest(bad), StatusCode::kInvalidArgument, "calibration must be");
}

TEST(ManifestTest, FormatDoubleIsShortestRoundTrip) {
  EXPECT_EQ(FormatDouble(0.01), "0.01");
  EXPECT_EQ(FormatDouble(1e6), "1000000");
  EXPECT_EQ(FormatDouble(500000), "500000");
  EXPECT_EQ(FormatDouble(1e-7), "1e-07");
  EXPECT_EQ(FormatDouble(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(FormatDouble(-0.5), "-0.5");
}

}  // namespace
}  // namespace kvt
