// kvt.v1.KvPrefixCache against a real kvtd on port 0: a published cache comes back through
// LookupPrefix + TranslateKV(header.input.cached) bit-identical to translating the same prefix
// inline; leases are single use; every miss reason, the quality gate, the byte budget, bad
// publishes, listing and eviction.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mapper_store/format/manifest_testing.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "mapper_store/mapper.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "proto/kvt/v1/prefix_cache.grpc.pb.h"
#include "server/kvtd_server.h"
#include "server/live_verifier.h"
#include "server/prefix_cache_service.h"
#include "server/server_metadata.h"
#include "tests/in_process_kvtd.h"
#include "transport/kv_chunks.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

constexpr int kSourceLayers = 3;
constexpr int kSourceHeads = 2;
constexpr int kSourceDim = 32;

std::string StoreDir() {
  SynthOptions options;
  options.source = NeoxModelSpec("test/src", kSourceLayers, kSourceHeads, kSourceDim, 10000);
  options.target = NeoxModelSpec("test/dst", 4, 3, 16, 500000);
  options.k = 2;
  options.dtype = DType::kFP32;
  options.seed = 5;
  return SynthStoreForTest("prefix_cache_store", options);
}

std::vector<uint32_t> Tokens(int n, uint32_t seed) {
  std::vector<uint32_t> tokens(n);
  std::mt19937 rng(seed);
  for (uint32_t& t : tokens) t = rng() % 256;
  return tokens;
}

class PrefixCacheServiceTest : public ::testing::Test {
 protected:
  void Start(KvtdConfig config, const std::string& store_dir = StoreDir()) {
    kvtd_ = StartKvtdForTest(store_dir, config);
    ASSERT_NE(kvtd_, nullptr);
    prefix_ = v1::KvPrefixCache::NewStub(
        grpc::CreateChannel(kvtd_->address(), grpc::InsecureChannelCredentials()));
  }
  void SetUp() override {
    KvtdConfig config;
    config.prefix_cache.enabled = true;
    config.prefix_cache.min_benefit_recovered = 0;  // records no benefit; not under test
    config.prefix_cache.block_tokens = 16;
    Start(config);
  }

  static HostCache Source(int64_t tokens, Layout layout, uint32_t seed) {
    HostCache cache = HostCache::Zeros(DType::kFP32, layout, kSourceLayers, kSourceHeads,
                                       kSourceDim, tokens);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (int l = 0; l < cache.num_layers; ++l) {
      for (std::vector<char>* buffer : {&cache.k[l], &cache.v[l]}) {
        float* x = reinterpret_cast<float*>(buffer->data());
        for (size_t i = 0; i < buffer->size() / sizeof(float); ++i) x[i] = normal(rng);
      }
    }
    return cache;
  }

  // The first `tokens` tokens of `cache` as a cache of its own (same layout).
  static HostCache Prefix(const HostCache& cache, int64_t tokens) {
    HostCache prefix = cache;
    prefix.num_tokens = tokens;
    prefix.Allocate();
    const LayerGeometry full{cache.layout, cache.num_kv_heads, cache.num_tokens, cache.head_dim,
                             4};
    for (int l = 0; l < cache.num_layers; ++l) {
      GatherChunk(full, 0, tokens, cache.k[l].data(), prefix.k[l].data());
      GatherChunk(full, 0, tokens, cache.v[l].data(), prefix.v[l].data());
    }
    return prefix;
  }

  grpc::Status Publish(const std::string& model, const std::vector<uint32_t>& tokens,
                       const HostCache& cache, v1::PublishResponse* response,
                       int skip_layer = -1, int shape_layers = kSourceLayers) {
    grpc::ClientContext context;
    auto stream = prefix_->Publish(&context, response);
    v1::PublishRequest request;
    v1::PublishHeader* header = request.mutable_header();
    header->set_model(model);
    for (uint32_t t : tokens) header->add_token_ids(t);
    header->set_dtype(v1::DTYPE_FP32);
    header->set_layout(cache.layout == Layout::kHND ? v1::LAYOUT_HND : v1::LAYOUT_NHD);
    header->mutable_shape()->set_num_layers(shape_layers);
    header->mutable_shape()->set_num_kv_heads(cache.num_kv_heads);
    header->mutable_shape()->set_head_dim(cache.head_dim);
    stream->Write(request);
    const LayerGeometry geometry{cache.layout, cache.num_kv_heads, cache.num_tokens,
                                 cache.head_dim, 4};
    for (int l = 0; l < cache.num_layers; ++l) {
      if (l == skip_layer) continue;
      for (int kind = 0; kind < 2; ++kind) {
        for (int64_t start = 0; start < cache.num_tokens; start += 23) {
          const int64_t count = std::min<int64_t>(23, cache.num_tokens - start);
          v1::KVChunk* chunk = request.mutable_chunk();
          chunk->set_layer(l);
          chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
          chunk->set_token_start(static_cast<uint32_t>(start));
          chunk->set_token_count(static_cast<uint32_t>(count));
          chunk->mutable_data()->resize(static_cast<size_t>(geometry.chunk_bytes(count)));
          GatherChunk(geometry, start, count, (kind == 0 ? cache.k : cache.v)[l].data(),
                      chunk->mutable_data()->data());
          if (!stream->Write(request)) break;
        }
      }
    }
    stream->WritesDone();
    return stream->Finish();
  }

  v1::LookupPrefixResponse Lookup(const std::vector<uint32_t>& tokens,
                                  const std::string& target = "test/dst",
                                  v1::ReusePolicy policy = v1::REUSE_POLICY_AUTO) {
    grpc::ClientContext context;
    v1::LookupPrefixRequest request;
    request.set_target_model(target);
    for (uint32_t t : tokens) request.add_token_ids(t);
    request.set_policy(policy);
    v1::LookupPrefixResponse response;
    grpc::Status status = prefix_->LookupPrefix(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  static v1::TranslateHeader CachedHeader(const v1::LookupPrefixResponse& hit) {
    v1::TranslateHeader header;
    header.set_mapper_id(hit.mapper_id());
    header.set_dtype(hit.dtype());
    header.set_layout(hit.layout());
    header.set_num_tokens(hit.matched_tokens());
    header.mutable_input()->mutable_cached()->set_lease_id(hit.lease_id());
    return header;
  }

  std::unique_ptr<InProcessKvtd> kvtd_;
  std::unique_ptr<v1::KvPrefixCache::Stub> prefix_;
};

// A client tests for "prefix_cache" before it relies on KvPrefixCache: listed only when enabled.
TEST_F(PrefixCacheServiceTest, ServerMetadataListsThePrefixCacheOnlyWhenEnabled) {
  absl::StatusOr<v1::ServerMetadataResponse> metadata = kvtd_->client().ServerMetadata();
  ASSERT_TRUE(metadata.ok()) << metadata.status();
  EXPECT_EQ(metadata->name(), "kvtd");
  EXPECT_EQ(metadata->version(), kKvtdVersion);
  EXPECT_THAT(metadata->extensions(), ::testing::Contains("prefix_cache"));
  EXPECT_THAT(metadata->extensions(), ::testing::Contains("paged_engine_order"));

  Start(KvtdConfig());  // prefix_cache.enabled false
  for (const auto& [name, listed] : std::vector<std::pair<std::string, bool>>{
           {"prefix_cache", false}, {"paged_engine_order", true}, {"no_such_extension", false}}) {
    absl::StatusOr<bool> has = kvtd_->client().HasExtension(name);
    ASSERT_TRUE(has.ok()) << has.status();
    EXPECT_EQ(*has, listed) << name;
  }
}

// The whole point: what LookupPrefix leases translates exactly as the same tokens sent inline.
TEST_F(PrefixCacheServiceTest, CachedTranslationEqualsInlineTranslationOfThePrefix) {
  for (Layout layout : {Layout::kNHD, Layout::kHND}) {
    SCOPED_TRACE(layout == Layout::kNHD ? "NHD" : "HND");
    const std::vector<uint32_t> tokens = Tokens(100, 1);
    const HostCache source = Source(100, layout, 2);
    v1::PublishResponse published;
    grpc::Status status = Publish("test/src", tokens, source, &published);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(published.stored_tokens(), 96u);  // whole blocks of 16
    EXPECT_EQ(published.block_tokens(), 16u);

    // The new request shares the first 100 tokens and goes on.
    std::vector<uint32_t> prompt = tokens;
    for (uint32_t t : Tokens(40, 3)) prompt.push_back(t);
    const v1::LookupPrefixResponse hit = Lookup(prompt);
    ASSERT_TRUE(hit.hit()) << hit.miss_reason() << ": " << hit.detail();
    EXPECT_EQ(hit.source_model(), "test/src");
    EXPECT_EQ(hit.mapper_id(), "m");
    EXPECT_EQ(hit.matched_tokens(), 96u);
    EXPECT_EQ(hit.layout(), v1::LAYOUT_NHD);
    EXPECT_TRUE(hit.gate().passed());

    v1::TranslateHeader header = CachedHeader(hit);
    header.set_output_layout(v1::LAYOUT_NHD);
    absl::StatusOr<TranslateResult> cached = kvtd_->client().TranslateCached(header);
    ASSERT_TRUE(cached.ok()) << cached.status();

    HostCache inline_source = Prefix(source, 96);
    v1::TranslateHeader inline_header;
    inline_header.set_mapper_id("m");
    inline_header.set_dtype(v1::DTYPE_FP32);
    inline_header.set_layout(layout == Layout::kHND ? v1::LAYOUT_HND : v1::LAYOUT_NHD);
    inline_header.set_output_layout(v1::LAYOUT_NHD);
    inline_header.set_num_tokens(96);
    absl::StatusOr<TranslateResult> direct =
        kvtd_->client().Translate(inline_header, inline_source);
    ASSERT_TRUE(direct.ok()) << direct.status();
    ASSERT_EQ(cached->target.num_layers, direct->target.num_layers);
    for (int l = 0; l < direct->target.num_layers; ++l) {
      EXPECT_EQ(cached->target.k[l], direct->target.k[l]) << "layer " << l;
      EXPECT_EQ(cached->target.v[l], direct->target.v[l]) << "layer " << l;
    }
    EXPECT_EQ(cached->trailer.num_tokens(), 96u);

    // Single use.
    absl::StatusOr<TranslateResult> again = kvtd_->client().TranslateCached(header);
    ASSERT_FALSE(again.ok());
    EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(again.status().message(), HasSubstr("header.input.cached.lease_id"));
    v1::EvictPrefixesRequest evict;
    v1::EvictPrefixesResponse evicted;
    grpc::ClientContext context;
    ASSERT_TRUE(prefix_->EvictPrefixes(&context, evict, &evicted).ok());
    EXPECT_EQ(evicted.evicted_entries(), 1u);
  }
}

TEST_F(PrefixCacheServiceTest, MissReasons) {
  const std::vector<uint32_t> tokens = Tokens(64, 4);
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", tokens, Source(64, Layout::kNHD, 5), &published).ok());

  EXPECT_EQ(Lookup(Tokens(64, 99)).miss_reason(), "no_prefix");
  EXPECT_EQ(Lookup(tokens, "test/dst", v1::REUSE_POLICY_FORBID).miss_reason(), "forbidden");
  const v1::LookupPrefixResponse no_mapper = Lookup(tokens, "test/elsewhere");
  EXPECT_FALSE(no_mapper.hit());
  EXPECT_EQ(no_mapper.miss_reason(), "no_mapper");
  ASSERT_EQ(no_mapper.candidates_size(), 1);
  EXPECT_EQ(no_mapper.candidates(0).matched_tokens(), 64u);
  // A prompt shorter than one block can never match.
  EXPECT_EQ(Lookup(std::vector<uint32_t>(tokens.begin(), tokens.begin() + 10)).miss_reason(),
            "no_prefix");
  // The source model itself is never its own source.
  EXPECT_EQ(Lookup(tokens, "test/src").miss_reason(), "no_prefix");
}

TEST_F(PrefixCacheServiceTest, GateRefusesUnlessForced) {
  KvtdConfig config;
  config.prefix_cache.enabled = true;
  config.prefix_cache.min_benefit_recovered = 0;  // records no benefit; not under test
  config.prefix_cache.pair_min_quality["test/src->test/dst"] = 0.9;  // synth mappers record none
  kvtd_.reset();
  Start(config);
  const std::vector<uint32_t> tokens = Tokens(48, 6);
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", tokens, Source(48, Layout::kNHD, 7), &published).ok());
  const v1::LookupPrefixResponse refused = Lookup(tokens);
  EXPECT_FALSE(refused.hit());
  EXPECT_EQ(refused.miss_reason(), "gate");
  EXPECT_FALSE(refused.gate().passed());
  EXPECT_EQ(refused.gate().min_mapper_quality(), 0.9);
  EXPECT_THAT(refused.gate().reason(), HasSubstr("no held-out quality"));
  const v1::LookupPrefixResponse forced = Lookup(tokens, "test/dst", v1::REUSE_POLICY_FORCE);
  EXPECT_TRUE(forced.hit());
  EXPECT_FALSE(forced.gate().passed());
  EXPECT_THAT(forced.detail(), HasSubstr("REUSE_POLICY_FORCE"));
}

// A store whose one mapper is the synth mapper of StoreDir() with a recorded held-out quality,
// as `kvt fit` writes it with target queries: attention cosine 0.95 with the 95% lower bound
// `lower95` (none: one held-out sequence), held-out R^2 0.2.
std::string StoreWithRecordedCosine(std::optional<double> lower95 = 0.94) {
  const std::string dir = absl::StrCat(StoreDir(), "_cosine", lower95 ? "" : "_unbounded");
  static std::set<std::string>* written_dirs = new std::set<std::string>;
  if (written_dirs->count(dir)) return dir;
  written_dirs->insert(dir);
  const bool written = [&] {
    absl::StatusOr<std::unique_ptr<LoadedMapper>> synth = LoadMapperDir(StoreDir() + "/m");
    if (!synth.ok()) return false;
    Manifest manifest = (*synth)->manifest();
    manifest.quality.attention_cosine_heldout = 0.95;
    manifest.quality.attention_cosine_heldout_all_layers = 0.96;
    manifest.quality.attention_cosine_heldout_lower95 = lower95;
    manifest.quality.heldout_sequences = lower95 ? 32 : 1;
    manifest.quality.heldout_tokens = lower95 ? 8192 : 256;
    for (LayerEntry& layer : manifest.layers) {
      layer.r2_k_heldout = layer.r2_v_heldout = 0.2;
      layer.attention_cosine_heldout = 0.95;
    }
    std::vector<TensorRef> tensors;
    for (const TensorInfo& info : (*synth)->weights().tensors()) {
      tensors.push_back({info.spec, (*synth)->weights().data(info)});
    }
    return WriteMapperDir(dir + "/m", manifest, tensors).ok();
  }();
  EXPECT_TRUE(written);
  return dir;
}

TEST_F(PrefixCacheServiceTest, GateComparesTheCosinesLowerBound) {
  const std::vector<uint32_t> tokens = Tokens(48, 10);
  // 0.945: the point estimate (0.95) would pass, the bound (0.94) does not.
  for (double floor : {0.9, 0.945, 0.97}) {
    SCOPED_TRACE(floor);
    KvtdConfig config;
    config.prefix_cache.enabled = true;
    config.prefix_cache.min_benefit_recovered = 0;  // records no benefit; not under test
    config.prefix_cache.min_mapper_quality = floor;  // R^2 0.2 would fail all
    kvtd_.reset();
    Start(config, StoreWithRecordedCosine());
    v1::PublishResponse published;
    ASSERT_TRUE(Publish("test/src", tokens, Source(48, Layout::kNHD, 11), &published).ok());
    const v1::LookupPrefixResponse response = Lookup(tokens);
    EXPECT_EQ(response.gate().mapper_quality_metric(), "attention_cosine_heldout_lower95");
    EXPECT_DOUBLE_EQ(response.gate().mapper_quality(), 0.94);
    EXPECT_EQ(response.gate().min_mapper_quality(), floor);
    EXPECT_EQ(response.hit(), floor < 0.94);
    EXPECT_EQ(response.gate().passed(), floor < 0.94);
    if (floor > 0.94) {
      EXPECT_EQ(response.miss_reason(), "gate");
      EXPECT_THAT(response.gate().reason(),
                  HasSubstr(absl::StrCat("held-out attention-output cosine (95% lower bound) "
                                         "0.94 < floor ", floor)));
    }
  }
}

// A store whose one mapper is the synth mapper of StoreDir() with a passing recorded cosine
// (lower bound 0.94) and the measured benefit `benefit` (quality.benefit), written under `name`.
std::string StoreWithBenefit(const std::string& name, const std::vector<BenefitRecord>& benefit) {
  const std::string dir = absl::StrCat(StoreDir(), "_benefit_", name);
  absl::StatusOr<std::unique_ptr<LoadedMapper>> cosine =
      LoadMapperDir(StoreWithRecordedCosine() + "/m");
  EXPECT_TRUE(cosine.ok()) << cosine.status();
  if (!cosine.ok()) return dir;
  Manifest manifest = (*cosine)->manifest();
  manifest.quality.benefit = benefit;
  std::vector<TensorRef> tensors;
  for (const TensorInfo& info : (*cosine)->weights().tensors()) {
    tensors.push_back({info.spec, (*cosine)->weights().data(info)});
  }
  const absl::Status written = WriteMapperDir(dir + "/m", manifest, tensors);
  EXPECT_TRUE(written.ok()) << written;
  return dir;
}


// The benefit gate on top of the cosine gate (which the store's 0.94 bound passes at 0.87):
// with kvtd's default floor a mapper must record a measured benefit, every text's lower95 at
// least the floor (or the pair's own), and floor 0 turns it off.
TEST_F(PrefixCacheServiceTest, BenefitGateHoldsEveryRecordedTextsBoundToTheFloor) {
  struct Case {
    const char* name;
    std::vector<BenefitRecord> benefit;
    std::map<std::string, double> pair_floors;
    double floor;
    bool passes;
    std::string reason;  // a substring of the refusal
  };
  const std::vector<Case> cases = {
      {"none", {}, {}, 0.5, false,
       "the mapper records no measured benefit (quality.benefit): measure it with "
       "`python -m kvt.qualify`"},
      {"one", {TestBenefitRecord("docs", 0.6, 0.55)}, {}, 0.5, true, ""},
      {"two", {TestBenefitRecord("docs", 0.6, 0.55), TestBenefitRecord("license", 0.4, 0.3)}, {}, 0.5, false,
       "mapper context benefit recovered on text 'license' (95% lower bound) 0.3 < floor 0.5 "
       "(prefix_cache.min_benefit_recovered)"},
      {"pair_lower", {TestBenefitRecord("docs", 0.6, 0.55), TestBenefitRecord("license", 0.4, 0.3)},
       {{"test/src->test/dst", 0.25}}, 0.5, true, ""},
      {"pair_higher", {TestBenefitRecord("docs", 0.6, 0.55)}, {{"test/src->test/dst", 0.6}}, 0.5, false,
       "on text 'docs' (95% lower bound) 0.55 < floor 0.6 (prefix_cache.pair_min_benefit "
       "\"test/src->test/dst\")"},
      {"other_pair", {TestBenefitRecord("docs", 0.6, 0.55)}, {{"test/src->test/other", 0.9}}, 0.5, true,
       ""},
      {"off", {}, {}, 0, true, ""},
  };
  uint32_t seed = 40;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    KvtdConfig config;
    config.prefix_cache.enabled = true;
    ASSERT_EQ(config.prefix_cache.min_benefit_recovered, 0.5);  // the default
    config.prefix_cache.min_benefit_recovered = c.floor;
    config.prefix_cache.pair_min_benefit = c.pair_floors;
    kvtd_.reset();
    Start(config, StoreWithBenefit(c.name, c.benefit));
    const std::vector<uint32_t> tokens = Tokens(48, ++seed);
    v1::PublishResponse published;
    ASSERT_TRUE(Publish("test/src", tokens, Source(48, Layout::kNHD, ++seed), &published).ok());
    const v1::LookupPrefixResponse response = Lookup(tokens);
    EXPECT_EQ(response.hit(), c.passes) << response.gate().reason();
    EXPECT_EQ(response.gate().passed(), c.passes);
    EXPECT_DOUBLE_EQ(response.gate().mapper_quality(), 0.94);  // the cosine gate passed
    const double floor =
        c.pair_floors.count("test/src->test/dst") ? c.pair_floors.at("test/src->test/dst")
                                                  : c.floor;
    EXPECT_EQ(response.gate().min_benefit_recovered(), floor);
    EXPECT_EQ(response.gate().has_benefit_lower95(), !c.benefit.empty());
    if (!c.benefit.empty()) {
      const BenefitRecord& worst =
          *std::min_element(c.benefit.begin(), c.benefit.end(),
                            [](const BenefitRecord& a, const BenefitRecord& b) {
                              return a.lower95 < b.lower95;
                            });
      EXPECT_EQ(response.gate().benefit_lower95(), worst.lower95);
      EXPECT_EQ(response.gate().benefit_text(), worst.text);
    }
    if (!c.passes) {
      EXPECT_EQ(response.miss_reason(), "gate");
      EXPECT_THAT(response.gate().reason(), HasSubstr(c.reason));
      EXPECT_THAT(response.detail(), HasSubstr(c.reason));
      ASSERT_EQ(response.candidates_size(), 1);
      EXPECT_THAT(response.candidates(0).rejected(), HasSubstr(c.reason));
      EXPECT_TRUE(Lookup(tokens, "test/dst", v1::REUSE_POLICY_FORCE).hit());
    }
  }
}

// Both gates must pass: a benefit above the floor does not rescue a cosine below its own.
TEST_F(PrefixCacheServiceTest, BenefitGateDoesNotReplaceTheCosineGate) {
  KvtdConfig config;
  config.prefix_cache.enabled = true;
  config.prefix_cache.min_mapper_quality = 0.97;  // above the store's 0.94 bound
  kvtd_.reset();
  Start(config, StoreWithBenefit("cosine_fails", {TestBenefitRecord("docs", 0.9, 0.85)}));
  const std::vector<uint32_t> tokens = Tokens(48, 60);
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", tokens, Source(48, Layout::kNHD, 61), &published).ok());
  const v1::LookupPrefixResponse response = Lookup(tokens);
  EXPECT_FALSE(response.hit());
  EXPECT_EQ(response.miss_reason(), "gate");
  EXPECT_THAT(response.gate().reason(), HasSubstr("0.94 < floor 0.97"));
  EXPECT_EQ(response.gate().benefit_lower95(), 0.85);
}

TEST_F(PrefixCacheServiceTest, GateRefusesACosineWithoutABound) {
  // One held-out sequence: a point estimate of 0.95 above the floor, and still refused.
  const std::vector<uint32_t> tokens = Tokens(48, 14);
  KvtdConfig config;
  config.prefix_cache.enabled = true;
  config.prefix_cache.min_benefit_recovered = 0;  // records no benefit; not under test
  config.prefix_cache.min_mapper_quality = 0.5;
  kvtd_.reset();
  Start(config, StoreWithRecordedCosine(std::nullopt));
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", tokens, Source(48, Layout::kNHD, 15), &published).ok());
  const v1::LookupPrefixResponse response = Lookup(tokens);
  EXPECT_FALSE(response.hit());
  EXPECT_EQ(response.miss_reason(), "gate");
  EXPECT_EQ(response.gate().mapper_quality_metric(), "attention_cosine_heldout_lower95");
  EXPECT_THAT(response.gate().reason(), HasSubstr("rests on one held-out sequence"));
  EXPECT_TRUE(Lookup(tokens, "test/dst", v1::REUSE_POLICY_FORCE).hit());
}

TEST_F(PrefixCacheServiceTest, GateFallsBackToHeldoutR2) {
  // The synth mapper records no cosine: the metric named is the R^2 fallback.
  const std::vector<uint32_t> tokens = Tokens(48, 12);
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", tokens, Source(48, Layout::kNHD, 13), &published).ok());
  EXPECT_EQ(Lookup(tokens).gate().mapper_quality_metric(), "r2_heldout");
}

TEST_F(PrefixCacheServiceTest, BadPublishesNameTheField) {
  const std::vector<uint32_t> tokens = Tokens(40, 8);
  const HostCache source = Source(40, Layout::kNHD, 9);
  v1::PublishResponse response;
  grpc::Status unknown = Publish("test/nobody", tokens, source, &response);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(unknown.error_message(), HasSubstr("header.model"));
  grpc::Status shape = Publish("test/src", tokens, source, &response, -1, kSourceLayers + 1);
  EXPECT_EQ(shape.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(shape.error_message(), HasSubstr("header.shape"));
  grpc::Status gap = Publish("test/src", tokens, source, &response, /*skip_layer=*/1);
  EXPECT_EQ(gap.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(gap.error_message(), HasSubstr("layer 1"));
  // Nothing half-stored: the failed publishes left no entry.
  EXPECT_EQ(Lookup(tokens).miss_reason(), "no_prefix");
  // Shorter than a block: accepted, nothing stored.
  v1::PublishResponse tiny;
  ASSERT_TRUE(Publish("test/src", Tokens(10, 10), Source(10, Layout::kNHD, 11), &tiny).ok());
  EXPECT_EQ(tiny.stored_tokens(), 0u);
}

TEST_F(PrefixCacheServiceTest, FullBudgetRefusesThePublishAndLeasedPrefixesSurvive) {
  KvtdConfig config;
  config.prefix_cache.enabled = true;
  config.prefix_cache.min_benefit_recovered = 0;  // records no benefit; not under test
  // One 64-token entry of the source: 3 layers x 2 x 64 x 2 x 32 x 4 bytes = 98304.
  config.prefix_cache.max_bytes = 100000;
  kvtd_.reset();
  Start(config);
  const std::vector<uint32_t> first = Tokens(64, 12);
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", first, Source(64, Layout::kNHD, 13), &published).ok());
  const v1::LookupPrefixResponse hit = Lookup(first);  // leased: may not be evicted
  ASSERT_TRUE(hit.hit());
  grpc::Status full = Publish("test/src", Tokens(64, 14), Source(64, Layout::kNHD, 15),
                              &published);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(full.error_message(), HasSubstr("prefix_cache.max_bytes"));
  // The leased prefix still translates.
  absl::StatusOr<TranslateResult> cached = kvtd_->client().TranslateCached(CachedHeader(hit));
  EXPECT_TRUE(cached.ok()) << cached.status();
  // Unleased now: the next publish evicts it (LRU) and fits.
  ASSERT_TRUE(Publish("test/src", Tokens(64, 14), Source(64, Layout::kNHD, 15), &published).ok());
  EXPECT_EQ(published.evicted_entries(), 1u);
  EXPECT_EQ(Lookup(first).miss_reason(), "no_prefix");
}

TEST_F(PrefixCacheServiceTest, CachedInputChecksTheHeader) {
  const std::vector<uint32_t> tokens = Tokens(32, 16);
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", tokens, Source(32, Layout::kNHD, 17), &published).ok());
  v1::TranslateHeader header = CachedHeader(Lookup(tokens));
  header.set_num_tokens(16);
  absl::StatusOr<TranslateResult> wrong = kvtd_->client().TranslateCached(header);
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("header.num_tokens"));
  v1::TranslateHeader unknown = CachedHeader(Lookup(tokens));
  unknown.mutable_input()->mutable_cached()->set_lease_id("not-a-lease");
  absl::StatusOr<TranslateResult> missing = kvtd_->client().TranslateCached(unknown);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(PrefixCacheServiceTest, ListShowsEntries) {
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", Tokens(50, 18), Source(50, Layout::kNHD, 19), &published).ok());
  grpc::ClientContext context;
  v1::ListPrefixesResponse listed;
  ASSERT_TRUE(prefix_->ListPrefixes(&context, v1::ListPrefixesRequest(), &listed).ok());
  ASSERT_EQ(listed.entries_size(), 1);
  EXPECT_EQ(listed.entries(0).model(), "test/src");
  EXPECT_EQ(listed.entries(0).num_tokens(), 48u);
  EXPECT_EQ(listed.entries(0).bytes(), listed.bytes_held());
  EXPECT_EQ(listed.block_tokens(), 16u);
  EXPECT_FALSE(listed.entries(0).first_block_hash().empty());
}

// Operators size prefix_cache.digest_slots from these gauges: the keys the digest holds and the
// share of unstored prompts it would still send to LookupPrefix.
TEST_F(PrefixCacheServiceTest, MetricsShowTheDigestsKeysAndFalsePositiveRate) {
  auto gauge = [this](const std::string& name) {
    const std::string text = kvtd_->server().metrics()->Serialize();
    const size_t at = text.find("\n" + name + " ");
    EXPECT_NE(at, std::string::npos) << name;
    if (at == std::string::npos) return -1.0;
    return std::strtod(text.c_str() + at + name.size() + 2, nullptr);
  };
  v1::PublishResponse published;
  ASSERT_TRUE(Publish("test/src", Tokens(50, 18), Source(50, Layout::kNHD, 19), &published).ok());
  ASSERT_TRUE(Publish("test/src", Tokens(40, 7), Source(40, Layout::kNHD, 8), &published).ok());
  EXPECT_EQ(gauge("kvt_prefix_digest_keys"), 2.0);
  // At most 6 of the default 2^20 counters are set: (6 / 2^20)^3 ~ 2e-16.
  const double rate = gauge("kvt_prefix_digest_false_positive_ratio");
  EXPECT_GT(rate, 0.0);
  EXPECT_LT(rate, 1e-15);
}

TEST(PrefixCacheDisabledTest, LookupMissesAndCachedInputIsRefused) {
  std::unique_ptr<InProcessKvtd> kvtd = StartKvtdForTest(StoreDir());
  ASSERT_NE(kvtd, nullptr);
  auto stub = v1::KvPrefixCache::NewStub(
      grpc::CreateChannel(kvtd->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::LookupPrefixRequest request;
  request.set_target_model("test/dst");
  request.add_token_ids(1);
  v1::LookupPrefixResponse response;
  ASSERT_TRUE(stub->LookupPrefix(&context, request, &response).ok());
  EXPECT_EQ(response.miss_reason(), "disabled");
  v1::TranslateHeader header;
  header.set_mapper_id("m");
  header.set_dtype(v1::DTYPE_FP32);
  header.set_layout(v1::LAYOUT_NHD);
  header.set_num_tokens(16);
  header.mutable_input()->mutable_cached()->set_lease_id("x");
  absl::StatusOr<TranslateResult> refused = kvtd->client().TranslateCached(header);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("prefix_cache.enabled"));
}


// Mapper `synth_dir` rewritten into `out_dir` with the held-out figures `kvt fit` records,
// K/V cosine 0.99 among them (what live verification compares with).
absl::Status WriteWithRecordedQuality(const std::string& synth_dir, const std::string& out_dir,
                                      bool overwrite) {
  absl::StatusOr<std::unique_ptr<LoadedMapper>> synth = LoadMapperDir(synth_dir);
  if (!synth.ok()) return synth.status();
  Manifest manifest = (*synth)->manifest();
  manifest.quality.attention_cosine_heldout = 0.95;
  manifest.quality.attention_cosine_heldout_lower95 = 0.94;
  manifest.quality.heldout_sequences = 32;
  manifest.quality.heldout_tokens = 8192;
  manifest.quality.kv_cosine_heldout = 0.99;
  std::vector<TensorRef> tensors;
  for (const TensorInfo& info : (*synth)->weights().tensors()) {
    tensors.push_back({info.spec, (*synth)->weights().data(info)});
  }
  WriteOptions options;
  options.overwrite = overwrite;
  return WriteMapperDir(out_dir, manifest, tensors, options);
}

SynthOptions SrcToDst(uint64_t seed) {
  SynthOptions options;
  options.source = NeoxModelSpec("test/src", kSourceLayers, kSourceHeads, kSourceDim, 10000);
  options.target = NeoxModelSpec("test/dst", 4, 3, 16, 500000);
  options.k = 2;
  options.dtype = DType::kFP32;
  options.seed = seed;
  return options;
}

// Live verification end to end over gRPC, with real safetensors mappers: sampled lookups answer
// "verify" (no lease); the target publishes its own prefill of the prompt; kvtd translates the
// stored source prefix through the same mapper version and compares. A mapper whose weights are
// replaced under the same id by worse ones is out of service after at most verify_window
// samples of the new version (here 3 samples = 6 applicable lookups at fraction 0.5); lookups
// then answer "live_quality"; a restore puts it back.
TEST_F(PrefixCacheServiceTest, LiveVerificationTakesASwappedMapperOutOfServiceUntilRestored) {
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(root ? root : "/tmp", "/live_verification");
  const std::string store = dir + "/store";
  ASSERT_TRUE(WriteSynthMapper(dir + "/good_synth", SrcToDst(5)).ok());
  ASSERT_TRUE(WriteSynthMapper(dir + "/bad_synth", SrcToDst(77)).ok());
  ASSERT_TRUE(WriteWithRecordedQuality(dir + "/good_synth", store + "/m", false).ok());
  // The target must be publishable: some mapper reads it.
  SynthOptions reverse = SrcToDst(9);
  std::swap(reverse.source, reverse.target);
  ASSERT_TRUE(WriteSynthMapper(store + "/r", reverse).ok());

  KvtdConfig config;
  config.prefix_cache.enabled = true;
  config.prefix_cache.min_benefit_recovered = 0;  // records no benefit; not under test
  config.prefix_cache.block_tokens = 16;
  config.prefix_cache.verify_sample_fraction = 0.5;  // every 2nd applicable lookup
  config.prefix_cache.verify_window = 3;
  config.prefix_cache.verify_tolerance = 0.05;
  config.mapper_store.reload_interval_seconds = 0;  // the test rescans when it swaps
  kvtd_.reset();
  Start(config, store);
  LiveVerifier* verifier = kvtd_->server().prefix_service()->verifier();
  ASSERT_NE(verifier, nullptr);

  // The target engine's own caches: what the good mapper makes of each prompt's source cache
  // (so the good mapper's live cosine is 1 and a different mapper's is far below 0.94).
  constexpr int kPrompts = 16;
  std::vector<std::vector<uint32_t>> prompts;
  std::vector<HostCache> sources, owns;
  for (int i = 0; i < kPrompts; ++i) {
    prompts.push_back(Tokens(48, 100 + i));
    sources.push_back(Source(48, Layout::kNHD, 200 + i));
    v1::TranslateHeader header;
    header.set_mapper_id("m");
    header.set_dtype(v1::DTYPE_FP32);
    header.set_layout(v1::LAYOUT_NHD);
    header.set_output_layout(v1::LAYOUT_NHD);
    header.set_num_tokens(48);
    absl::StatusOr<TranslateResult> own = kvtd_->client().Translate(header, sources.back());
    ASSERT_TRUE(own.ok()) << own.status();
    owns.push_back(std::move(own->target));
  }
  // One engine request: the source member has published the prompt; the target looks up and,
  // when asked to verify, prefills (its own cache) and publishes it.
  int next = 0;
  auto request = [&]() -> v1::LookupPrefixResponse {
    const int i = next++ % kPrompts;
    v1::PublishResponse published;
    EXPECT_TRUE(Publish("test/src", prompts[i], sources[i], &published).ok());
    const v1::LookupPrefixResponse response = Lookup(prompts[i]);
    if (response.verify()) {
      EXPECT_FALSE(response.hit());
      EXPECT_TRUE(response.lease_id().empty());
      EXPECT_EQ(response.miss_reason(), "verification_sample");
      EXPECT_EQ(response.mapper_id(), "m");
      EXPECT_EQ(response.matched_tokens(), 48u);
      grpc::Status own = Publish("test/dst", prompts[i], owns[i], &published, -1, 4);
      EXPECT_TRUE(own.ok()) << own.error_message();
      verifier->Drain();  // the comparison runs off the request path
    }
    return response;
  };
  auto state = [&]() {
    std::vector<VerificationState> states = verifier->List();
    EXPECT_EQ(states.size(), 1u);
    return states.empty() ? VerificationState() : states.front();
  };

  // The good mapper: 4 samples in 8 requests, every one passes.
  int samples = 0;
  for (int r = 0; r < 8; ++r) {
    const v1::LookupPrefixResponse response = request();
    samples += response.verify();
    EXPECT_TRUE(response.hit() || response.verify()) << response.detail();
  }
  EXPECT_EQ(samples, 4);
  EXPECT_EQ(state().samples, 3);  // the window
  ASSERT_TRUE(state().live.has_value());
  EXPECT_GT(*state().live, 0.999);
  EXPECT_FALSE(state().out_of_service);
  const std::string metrics = kvtd_->server().metrics()->Serialize();
  EXPECT_THAT(metrics, HasSubstr(R"(kvt_live_verifications_total{mapper="m",result="pass",source="test/src",target="test/dst"} 4)"));

  // Worse weights under the same id, same manifest figures (staged beside the store, written
  // over it in one step, then rescanned): a new version.
  ASSERT_TRUE(WriteWithRecordedQuality(dir + "/bad_synth", store + "/m", true).ok());
  ASSERT_TRUE(kvtd_->store().Scan().ok());
  ASSERT_EQ(kvtd_->client().GetMapper("m")->generation(), 2);

  // Out of service within verify_window samples of the new version, i.e. 2 * 3 requests.
  int requests = 0;
  while (!state().out_of_service && requests < 6) {
    request();
    ++requests;
  }
  EXPECT_TRUE(state().out_of_service);
  EXPECT_EQ(requests, 6);
  EXPECT_LT(*state().live, 0.94);
  const v1::LookupPrefixResponse refused = request();
  EXPECT_FALSE(refused.hit());
  EXPECT_FALSE(refused.verify());
  EXPECT_EQ(refused.miss_reason(), "live_quality");
  EXPECT_FALSE(refused.gate().passed());
  EXPECT_THAT(refused.gate().reason(), HasSubstr("live_quality: mean K/V cosine"));
  EXPECT_THAT(kvtd_->server().metrics()->Serialize(),
              HasSubstr(R"(kvt_mapper_out_of_service{mapper="m",source="test/src",target="test/dst"} 1)"));

  // The operator restores it (admin RPC): lookups apply it again.
  {
    grpc::ClientContext context;
    v1::RestoreMapperRequest restore;
    restore.set_mapper_id("m");
    v1::RestoreMapperResponse restored;
    grpc::Status status = prefix_->RestoreMapper(&context, restore, &restored);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_TRUE(restored.restored());
    EXPECT_EQ(restored.verification().generation(), 2);
    EXPECT_FALSE(restored.verification().out_of_service());
  }
  const v1::LookupPrefixResponse back = request();
  EXPECT_TRUE(back.hit() || back.verify()) << back.miss_reason() << ": " << back.detail();
  {
    grpc::ClientContext context;
    v1::ListVerificationsResponse listed;
    ASSERT_TRUE(prefix_->ListVerifications(&context, v1::ListVerificationsRequest(), &listed).ok());
    ASSERT_EQ(listed.mappers_size(), 1);
    EXPECT_EQ(listed.mappers(0).mapper_id(), "m");
    EXPECT_DOUBLE_EQ(listed.mappers(0).recorded(), 0.99);
    EXPECT_EQ(listed.pending(), 0u);
  }
}

}  // namespace
}  // namespace kvt
