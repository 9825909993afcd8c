#include "server/metrics.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <string>

#include "common/testing/http_get.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A store with one small synthetic mapper test/src -> test/dst.
std::unique_ptr<MapperStore> OneMapperStore() {
  const std::string root = testing::MakeTempDir("metrics-store");
  absl::StatusOr<SynthOptions> options = SynthPreset("demo-tiny");
  EXPECT_TRUE(options.ok());
  options->source.name = "test/src";
  options->target.name = "test/dst";
  KVT_EXPECT_OK(WriteSynthMapper(root + "/tiny", *options));
  absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(root);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(*store);
}

PairLabels PairOf(MapperStore& store) { return PairLabels::Of((*store.Get("tiny"))->view()); }

// `promtool check metrics` over `exposition`: "" when it passes, else its complaint.
std::string PromtoolCheck(const std::string& exposition) {
  const std::string path = testing::MakeTempDir("promtool") + "/metrics.txt";
  std::ofstream(path) << exposition;
  const std::string command = "/usr/bin/promtool check metrics < '" + path + "' 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) output.append(buffer, n);
  const int status = pclose(pipe);
  return status == 0 ? "" : "promtool: " + output;
}

TEST(MetricsTest, TranslateRecordsEveryOutcomeButTimesOnlySuccesses) {
  std::unique_ptr<MapperStore> store = OneMapperStore();
  Metrics metrics("cpu");
  TranslateRecord ok;
  ok.pair = PairOf(*store);
  ok.code = absl::StatusCode::kOk;
  ok.queue_s = 0.001, ok.stage_in_s = 0.002, ok.compute_s = 0.003, ok.stage_out_s = 0.004;
  ok.total_s = 0.01;
  ok.tokens = 512;
  ok.speedup = 12.5;
  ok.input_shift = 1.05;
  metrics.RecordTranslate(ok);
  TranslateRecord rejected;  // the header never named a servable mapper
  rejected.code = absl::StatusCode::kInvalidArgument;
  metrics.RecordTranslate(rejected);

  const std::string text = metrics.Serialize();
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_requests_total{code="OK",source="test/src",target="test/dst"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_requests_total{code="INVALID_ARGUMENT",source="unknown",target="unknown"} 1)"));
  for (const char* stage : {"queue", "stage_in", "compute", "stage_out", "total"}) {
    EXPECT_THAT(text, HasSubstr(absl::StrCat(R"(kvt_translate_duration_seconds_count{device="cpu",source="test/src",stage=")",
                                             stage, R"(",target="test/dst"} 1)")));
  }
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_duration_seconds_bucket{device="cpu",source="test/src",stage="total",target="test/dst",le="0.01"} 1)"));
  EXPECT_THAT(text, Not(HasSubstr(R"(kvt_translate_duration_seconds_count{device="cpu",source="unknown")")));
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_tokens_total{source="test/src",target="test/dst"} 512)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_translate_speedup_ratio_sum{device="cpu",source="test/src",target="test/dst"} 12.5)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_input_shift_score_count{source="test/src",target="test/dst"} 1)"));
  EXPECT_THAT(text, HasSubstr("kvt_build_info{"));
  EXPECT_EQ(PromtoolCheck(text), "");
}

TEST(MetricsTest, ValidateQualityGoesIntoTurnBuckets) {
  std::unique_ptr<MapperStore> store = OneMapperStore();
  Metrics metrics("cpu");
  ValidateRecord record;
  record.pair = PairOf(*store);
  record.code = absl::StatusCode::kOk;
  record.turn = 14;
  record.total_s = 0.2;
  record.has_quality = true;
  record.r2_k = 0.8, record.r2_v = 0.6, record.cosine_k = 0.97, record.cosine_v = 0.9;
  record.attention_cosine = 0.991;
  record.c_k = 1.2;
  metrics.RecordValidate(record);
  const std::string text = metrics.Serialize();
  EXPECT_THAT(text, HasSubstr(R"(kvt_validate_requests_total{code="OK",source="test/src",target="test/dst"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_quality_attention_cosine_bucket{source="test/src",target="test/dst",turn="10-19",le="0.995"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_quality_attention_cosine_bucket{source="test/src",target="test/dst",turn="10-19",le="0.99"} 0)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_quality_r2_sum{kind="v",source="test/src",target="test/dst",turn="10-19"} 0.6)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_quality_kv_cosine_sum{kind="k",source="test/src",target="test/dst",turn="10-19"} 0.97)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_quality_error_concentration_count{kind="k",source="test/src",target="test/dst",turn="10-19"} 1)"));
  EXPECT_THAT(text, Not(HasSubstr(R"(kvt_quality_error_concentration_count{kind="v")")));
  EXPECT_EQ(PromtoolCheck(text), "");
}

TEST(MetricsTest, TurnBucketsAreBounded) {
  EXPECT_EQ(Metrics::TurnBucket(0), "0");
  EXPECT_EQ(Metrics::TurnBucket(9), "9");
  EXPECT_EQ(Metrics::TurnBucket(10), "10-19");
  EXPECT_EQ(Metrics::TurnBucket(19), "10-19");
  EXPECT_EQ(Metrics::TurnBucket(20), "20+");
  EXPECT_EQ(Metrics::TurnBucket(4000000000u), "20+");
}

TEST(MetricsTest, ScrapeTimeValuesComeFromTheStoreAndTheService) {
  std::unique_ptr<MapperStore> store = OneMapperStore();
  Metrics metrics("cpu");
  metrics.SetBackend("cpu", "cpu", "auto");
  metrics.SetCpuGemmPath("onednn_bf16", "avx512_core_bf16", "auto");
  metrics.SetCpuGemmProbe("onednn_bf16", 226.5);
  metrics.SetCpuGemmProbe("sgemm", 101.25);
  int64_t inflight = 3;
  metrics.SetScrapeSources(store.get(), [&inflight] { return inflight; });
  const uint64_t bytes = (*store->Get("tiny"))->weight_bytes();
  std::string text = metrics.Serialize();
  EXPECT_THAT(text, HasSubstr("kvt_inflight_requests 3"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(R"(kvt_mapper_device_resident_bytes{device="host",mapper="tiny",source="test/src",target="test/dst"} )", bytes)));
  EXPECT_THAT(text, HasSubstr(R"(kvt_backend_info{backend="cpu",device="cpu",requested="auto"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_cpu_gemm_path{isa="avx512_core_bf16",path="onednn_bf16",requested="auto"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_cpu_gemm_probe_gflops{engine="onednn_bf16"} 226.5)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_cpu_gemm_probe_gflops{engine="sgemm"} 101.25)"));
  // Zero series exist before the first event, so rate() and the alerts have something to read.
  EXPECT_THAT(text, HasSubstr(R"(kvt_mapper_page_ins_total{device="cpu",source="test/src",target="test/dst"} 0)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_mapper_evictions_total{device="cpu",source="test/src",target="test/dst"} 0)"));
  metrics.RecordPageIn(PairOf(*store), "cpu", 0.3);
  metrics.RecordEviction(PairOf(*store), "cpu");
  metrics.SetPrefixDigestUsage(7, 0.25);
  inflight = 0;
  text = metrics.Serialize();
  EXPECT_THAT(text, HasSubstr("kvt_prefix_digest_keys 7"));
  EXPECT_THAT(text, HasSubstr("kvt_prefix_digest_false_positive_ratio 0.25"));
  EXPECT_THAT(text, HasSubstr("kvt_inflight_requests 0"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_mapper_page_ins_total{device="cpu",source="test/src",target="test/dst"} 1)"));
  EXPECT_THAT(text, HasSubstr(R"(kvt_mapper_page_in_duration_seconds_count{device="cpu",source="test/src",target="test/dst"} 1)"));
  EXPECT_EQ(PromtoolCheck(text), "");
  metrics.SetScrapeSources(nullptr, nullptr);
  EXPECT_THAT(metrics.Serialize(), HasSubstr("kvt_inflight_requests 0"));
}

TEST(MetricsTest, FamilyNamesListEveryFamilyOnceWithOrWithoutSeries) {
  Metrics metrics("cpu");
  const std::vector<std::string> names = metrics.FamilyNames();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());
  for (const char* name : {"kvt_translate_requests_total", "kvt_prefix_lookups_total",
                           "kvt_prefix_digest_keys", "kvt_prefix_digest_false_positive_ratio",
                           "kvt_inflight_requests", "kvt_mapper_device_resident_bytes"}) {
    EXPECT_THAT(names, ::testing::Contains(name));
  }
  // Series appear only once recorded; the name list does not wait for them.
  EXPECT_THAT(metrics.Serialize(), Not(HasSubstr("kvt_prefix_digest_keys")));
}

TEST(MetricsTest, EndpointServesTheRegistryOnAnOsChosenPort) {
  Metrics metrics("cpu");
  ASSERT_EQ(metrics.port(), 0);
  KVT_ASSERT_OK(metrics.StartExposer("127.0.0.1:0"));
  ASSERT_GT(metrics.port(), 0);
  metrics.SetScrapeSources(nullptr, [] { return int64_t{2}; });
  absl::StatusOr<testing::HttpResponse> response =
      testing::HttpGet("127.0.0.1", metrics.port(), "/metrics");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 200);
  EXPECT_THAT(response->body, HasSubstr("kvt_build_info{"));
  EXPECT_THAT(response->body, HasSubstr("kvt_inflight_requests 2"));
  absl::StatusOr<testing::HttpResponse> elsewhere =
      testing::HttpGet("127.0.0.1", metrics.port(), "/");
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  EXPECT_EQ(elsewhere->status, 404);

  // The same port again cannot be bound: an error naming the key.
  Metrics second("cpu");
  KVT_EXPECT_ERROR(second.StartExposer(absl::StrCat("127.0.0.1:", metrics.port())),
                   absl::StatusCode::kUnavailable, "metrics.listen_address");
  // Empty: no endpoint, not an error.
  KVT_EXPECT_OK(second.StartExposer(""));
  EXPECT_EQ(second.port(), 0);
}

}  // namespace
}  // namespace kvt
