// Layer-pipelined TranslateKV and incremental sessions, end to end in process: a real kvtd on
// port 0, a real channel, a synthetic mapper on disk. Pipelining must hand back a target layer
// before the caller has sent the source layers it does not read; sessions that translate only
// the tokens added since the last handoff must match translating everything at once (with a
// window mapper too: the session re-sends the window's overlap, where naive pieces differ); every
// result is checked against the float64 reference.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/session.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "host_cache/host_cache_testing.h"
#include "kernels/testing/reference.h"
#include "mapper_store/mapper.h"
#include "mapper_store/store.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/synth.h"
#include "server/kvtd_server.h"
#include "tests/in_process_kvtd.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

constexpr int kSourceLayers = 8;

// The token-wise pair every store here serves (fp32, k = 2), its weights drawn from `seed`.
SynthOptions TestPair(uint64_t seed) {
  SynthOptions options;
  options.source = NeoxModelSpec("test/src", kSourceLayers, 2, 32, 10000);
  options.target = NeoxModelSpec("test/dst", 6, 4, 16, 500000);
  options.k = 2;
  options.dtype = DType::kFP32;
  options.seed = seed;
  return options;
}

std::string StoreDir() { return SynthStoreForTest("pipelined_store", TestPair(11)); }

// The same source model into a window mapper (window 3): each output token reads its source
// token and the two before it in the request.
constexpr int kWindow = 3;
constexpr char kWindowTarget[] = "test/dst-window";

std::string WindowStoreDir() {
  SynthOptions options = TestPair(12);
  options.target.name = kWindowTarget;
  options.window = kWindow;
  return SynthStoreForTest("pipelined_window_store", options);
}

// A kvtd over the test store with the given pipelining threshold, and a client that sends many
// chunks per layer.
struct Kvtd {
  explicit Kvtd(int64_t pipeline_min_tokens, int64_t response_chunk_bytes = 4 << 20,
                const std::string& store_dir = StoreDir()) {
    KvtdConfig config;
    config.transport.pipeline_min_tokens = pipeline_min_tokens;
    config.limits.response_chunk_bytes = response_chunk_bytes;
    InProcessKvtdOptions options;
    options.client.chunk_bytes = 64 << 10;
    kvtd = StartKvtdForTest(store_dir, config, std::move(options));
    client = kvtd != nullptr ? &kvtd->client() : nullptr;
  }
  const MapperView& view() {
    mapper = *kvtd->store().Get("m");
    return mapper->view();
  }

  std::unique_ptr<InProcessKvtd> kvtd;
  Client* client = nullptr;
  std::shared_ptr<const LoadedMapper> mapper;
};

HostCache RandomSource(int64_t tokens, DType dtype, Layout layout, const char* what) {
  return testing::ToHostCache(testing::MakeRandomCache(kSourceLayers, 2, 32, tokens, dtype,
                                                       layout, testing::FreshSeed(what)));
}

// Max relative error of every target layer against the float64 reference.
double ErrorAgainstReference(const MapperView& mapper, const HostCache& source,
                             const HostCache& target, const Positions& positions) {
  double worst = 0;
  for (int layer = 0; layer < mapper.target.num_layers; ++layer) {
    for (testing::Kind kind : {testing::Kind::kK, testing::Kind::kV}) {
      worst = std::max(
          worst, testing::MaxRelError(
                     testing::ReadLayer(target.view(), layer, kind),
                     testing::ReferenceTranslate(mapper, layer, kind, source.view(), positions)));
    }
  }
  return worst;
}

v1::TranslateHeader Header() {
  v1::TranslateHeader header;
  header.set_mapper_id("m");
  header.set_output_dtype(v1::DTYPE_FP32);
  return header;
}

TEST(PipelinedTranslateTest, TargetLayerComesBackBeforeTheUnreadSourceLayersAreSent) {
  Kvtd kvtd(/*pipeline_min_tokens=*/64);
  const MapperView& view = kvtd.view();
  // Source layers target layer 0 reads, in the order the caller pushes them.
  std::set<int> needed(view.layers[0].sigma_k.begin(), view.layers[0].sigma_k.end());
  needed.insert(view.layers[0].sigma_v.begin(), view.layers[0].sigma_v.end());
  ASSERT_LT(static_cast<int>(needed.size()), kSourceLayers);
  const HostCache source = RandomSource(300, DType::kBF16, Layout::kNHD, "pipelined source");

  std::mutex mutex;
  std::condition_variable arrived;
  std::vector<int> layers_back;
  TranslateStreamOptions options;
  options.on_target_layer = [&](int layer, const HostCache&) {
    std::lock_guard<std::mutex> lock(mutex);
    layers_back.push_back(layer);
    arrived.notify_all();
  };
  absl::StatusOr<std::unique_ptr<TranslateStream>> stream =
      kvtd.client->StartTranslate(Header(), source, options);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (int layer : needed) {
    ASSERT_TRUE((*stream)->PushLayer(layer, source.k[layer].data(), source.v[layer].data()).ok());
  }
  {
    // Without pipelining nothing comes back until every layer is sent: this would time out.
    std::unique_lock<std::mutex> lock(mutex);
    ASSERT_TRUE(arrived.wait_for(lock, std::chrono::seconds(60),
                                 [&] { return !layers_back.empty(); }))
        << "no target layer came back while source layers were still missing";
    // Only target layers whose sources have all been sent can be back yet (layer 0 at least
    // qualifies; the server takes ready layers in any order).
    for (int layer : layers_back) {
      for (const std::vector<int>* sigma :
           {&view.layers[layer].sigma_k, &view.layers[layer].sigma_v}) {
        for (int s : *sigma) EXPECT_EQ(needed.count(s), 1u) << "target layer " << layer;
      }
    }
  }
  for (int layer = 0; layer < kSourceLayers; ++layer) {
    if (needed.count(layer) > 0) continue;
    ASSERT_TRUE((*stream)->PushLayer(layer, source.k[layer].data(), source.v[layer].data()).ok());
  }
  absl::StatusOr<TranslateResult> result = (*stream)->Finish();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->trailer.pipelined());
  EXPECT_EQ(layers_back.size(), 6u);
  EXPECT_GT(result->trailer.timings().first_output_ms(), 0);
  EXPECT_LE(result->first_layer_ms, result->last_byte_ms);
  EXPECT_LE(ErrorAgainstReference(view, source, result->target, Positions{}), 1e-5);

  // The same request below the threshold is not pipelined and gives the same bytes.
  Kvtd plain(/*pipeline_min_tokens=*/100000);
  absl::StatusOr<TranslateResult> unpipelined = plain.client->Translate(Header(), source);
  ASSERT_TRUE(unpipelined.ok()) << unpipelined.status();
  EXPECT_FALSE(unpipelined->trailer.pipelined());
  for (int layer = 0; layer < 6; ++layer) {
    EXPECT_EQ(unpipelined->target.k[layer], result->target.k[layer]) << "layer " << layer;
    EXPECT_EQ(unpipelined->target.v[layer], result->target.v[layer]) << "layer " << layer;
  }
}

// A caller that writes everything before reading anything: a pipelined server must not
// deadlock on its output (far more than the flow-control window) and errors still name the
// field.
TEST(PipelinedTranslateTest, WriteAllThenReadCallersStillWork) {
  Kvtd kvtd(/*pipeline_min_tokens=*/0, /*response_chunk_bytes=*/64 << 10);
  const MapperView& view = kvtd.view();
  const HostCache source = RandomSource(4096, DType::kFP32, Layout::kHND, "write-all source");
  v1::TranslateHeader header = Header();
  header.set_dtype(v1::DTYPE_FP32);
  header.set_layout(v1::LAYOUT_HND);
  header.set_num_tokens(4096);
  for (bool corrupt : {false, true}) {
    grpc::ClientContext context;
    auto stream = kvtd.client->stub()->TranslateKV(&context);
    v1::TranslateKVRequest request;
    *request.mutable_header() = header;
    ASSERT_TRUE(stream->Write(request));
    for (int layer = 0; layer < kSourceLayers; ++layer) {
      for (int kind = 0; kind < 2; ++kind) {
        v1::KVChunk* chunk = request.mutable_chunk();
        chunk->set_layer(layer);
        chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
        chunk->set_token_start(0);
        chunk->set_token_count(4096);
        const std::vector<char>& bytes = (kind == 0 ? source.k : source.v)[layer];
        chunk->set_data(bytes.data(), bytes.size());
        // The corrupt run repeats layer 6's K instead of sending its V.
        if (corrupt && layer == 6 && kind == 1) chunk->set_kind(v1::CACHE_KIND_K);
        if (!stream->Write(request)) break;
      }
    }
    stream->WritesDone();
    v1::TranslateKVResponse response;
    HostCache target;
    target.dtype = DType::kFP32;
    target.num_layers = 6;
    target.num_kv_heads = 4;
    target.head_dim = 16;
    target.num_tokens = 4096;
    target.Allocate();
    int64_t received = 0;
    while (stream->Read(&response)) {
      if (!response.has_chunk()) continue;
      const v1::KVChunk& chunk = response.chunk();
      std::vector<char>& layer = (chunk.kind() == v1::CACHE_KIND_K ? target.k : target.v)
          [chunk.layer()];
      // HND chunk [heads, count, dim] into the HND layer [heads, 4096, dim], fp32.
      const int64_t row = 16 * 4;
      for (int head = 0; head < 4; ++head) {
        std::memcpy(layer.data() + (head * 4096 + chunk.token_start()) * row,
                    chunk.data().data() + head * chunk.token_count() * row,
                    chunk.token_count() * row);
      }
      received += chunk.token_count();
    }
    grpc::Status status = stream->Finish();
    if (corrupt) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(status.error_message(), HasSubstr("repeats token 0"));
    } else {
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(received, 2 * 6 * 4096);
      EXPECT_LE(ErrorAgainstReference(view, source, target, Positions{}), 1e-5);
    }
  }
}

// A recycled target (the previous result moved back in) is written in place when its buffers
// have the size, reshaped when they do not, and never leaks the old bytes into the result.
TEST(PipelinedTranslateTest, RecycledTargetIsReusedInPlaceAndFullyOverwritten) {
  Kvtd kvtd(/*pipeline_min_tokens=*/0, /*response_chunk_bytes=*/64 << 10);
  const MapperView& view = kvtd.view();
  v1::TranslateHeader header = Header();
  HostCache recycled;
  for (int64_t tokens : {777, 777, 300}) {
    const HostCache source =
        RandomSource(tokens, DType::kBF16, Layout::kNHD, "recycled-target source");
    std::vector<const char*> old_buffers;
    for (std::vector<char>& buffer : recycled.k) {
      std::memset(buffer.data(), 0x7f, buffer.size());  // would show if any survived
      old_buffers.push_back(buffer.data());
    }
    TranslateStreamOptions options;
    options.recycled_target = std::move(recycled);
    absl::StatusOr<TranslateResult> result =
        kvtd.client->Translate(header, source, std::move(options));
    ASSERT_TRUE(result.ok()) << result.status();
    const HostCache& target = result->target;
    ASSERT_EQ(target.num_tokens, tokens);
    ASSERT_EQ(target.k.size(), 6u);
    for (int layer = 0; layer < 6; ++layer) {
      EXPECT_EQ(static_cast<int64_t>(target.k[layer].size()), target.layer_bytes());
      EXPECT_EQ(static_cast<int64_t>(target.v[layer].size()), target.layer_bytes());
    }
    // Same shape as the previous call: the same memory, written in place.
    if (!old_buffers.empty() && tokens == 777) {
      for (int layer = 0; layer < 6; ++layer) EXPECT_EQ(target.k[layer].data(), old_buffers[layer]);
    }
    EXPECT_LE(ErrorAgainstReference(view, source, target, Positions{}), 1e-5) << tokens;
    recycled = std::move(result->target);
  }
}

TEST(TranslateSessionTest, TurnByTurnEqualsAllAtOnce) {
  Kvtd kvtd(/*pipeline_min_tokens=*/64);
  const MapperView& view = kvtd.view();
  for (Layout layout : {Layout::kHND, Layout::kNHD}) {
    const HostCache whole = RandomSource(170, DType::kBF16, layout, "session source");
    const std::vector<int64_t> turns = {37, 120, 13};
    v1::TranslateHeader base = Header();
    base.set_output_layout(layout == Layout::kHND ? v1::LAYOUT_NHD : v1::LAYOUT_HND);
    base.set_session_id("conversation-1");
    TranslateSession session(kvtd.client, base);
    int64_t begin = 0;
    for (int64_t count : turns) {
      testing::OwnedCache owned_part = testing::SliceTokens(whole.view(), begin, begin + count);
      const HostCache part = testing::ToHostCache(owned_part);
      absl::StatusOr<TranslateResult> turn = session.Extend(part);
      ASSERT_TRUE(turn.ok()) << turn.status();
      EXPECT_EQ(turn->target.num_tokens, count);
      // Each turn on its own, at its absolute positions.
      EXPECT_LE(ErrorAgainstReference(view, part, turn->target,
                                      Positions{static_cast<uint64_t>(begin)}),
                1e-5);
      begin += count;
    }
    EXPECT_EQ(session.tokens(), 170);
    EXPECT_EQ(session.turns(), 3u);
    // Token-wise: nothing is kept or re-sent.
    EXPECT_EQ(session.window(), 1);
    EXPECT_EQ(session.kept_tokens(), 0);
    absl::StatusOr<TranslateResult> at_once = kvtd.client->Translate(base, whole);
    ASSERT_TRUE(at_once.ok()) << at_once.status();
    const double session_error =
        ErrorAgainstReference(view, whole, session.target(), Positions{});
    const double at_once_error = ErrorAgainstReference(view, whole, at_once->target, Positions{});
    EXPECT_LE(session_error, 1e-5);
    EXPECT_LE(at_once_error, 1e-5);
    // The map is per token: the two differ at most by float rounding.
    double worst = 0;
    for (int layer = 0; layer < 6; ++layer) {
      for (testing::Kind kind : {testing::Kind::kK, testing::Kind::kV}) {
        worst = std::max(worst,
                         testing::MaxRelError(
                             testing::ReadLayer(session.target().view(), layer, kind),
                             testing::ReadLayer(at_once->target.view(), layer, kind)));
      }
    }
    EXPECT_LE(worst, 1e-5) << LayoutName(layout);
  }
}

TEST(TranslateSessionTest, ExplicitPositionsEqualTheOffsetAndShapeChangesAreRefused) {
  Kvtd kvtd(/*pipeline_min_tokens=*/64);
  const MapperView& view = kvtd.view();
  const HostCache part = RandomSource(20, DType::kFP32, Layout::kNHD, "positions source");
  v1::TranslateHeader by_offset = Header();
  by_offset.set_position_offset(1000);
  v1::TranslateHeader by_list = Header();
  for (uint64_t p = 1000; p < 1020; ++p) by_list.add_positions(p);
  absl::StatusOr<TranslateResult> a = kvtd.client->Translate(by_offset, part);
  absl::StatusOr<TranslateResult> b = kvtd.client->Translate(by_list, part);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  for (int layer = 0; layer < 6; ++layer) {
    EXPECT_EQ(a->target.k[layer], b->target.k[layer]);
    EXPECT_EQ(a->target.v[layer], b->target.v[layer]);
  }
  EXPECT_LE(ErrorAgainstReference(view, part, a->target, Positions{1000}), 1e-5);

  TranslateSession session(kvtd.client, Header());
  ASSERT_TRUE(session.Extend(part).ok());
  const HostCache other_layout = RandomSource(5, DType::kFP32, Layout::kHND, "other layout");
  absl::StatusOr<TranslateResult> refused = session.Extend(other_layout);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(session.tokens(), 20);
  HostCache none = part;
  none.num_tokens = 0;
  for (auto* layers : {&none.k, &none.v}) {
    for (std::vector<char>& layer : *layers) layer.clear();
  }
  absl::StatusOr<TranslateResult> empty = session.Extend(none);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr("turn 2 adds no tokens"));

  v1::TranslateHeader unknown = Header();
  unknown.set_mapper_id("no-such-mapper");
  TranslateSession missing(kvtd.client, unknown);
  absl::StatusOr<TranslateResult> not_found = missing.Extend(part);
  EXPECT_EQ(not_found.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(not_found.status().message()), HasSubstr("no-such-mapper"));
  EXPECT_EQ(missing.turns(), 0u);
}

// Every target layer and kind of `cache` as doubles [token][head][dim].
std::vector<std::vector<double>> Layers(const HostCache& cache) {
  std::vector<std::vector<double>> layers;
  for (int layer = 0; layer < cache.num_layers; ++layer) {
    for (testing::Kind kind : {testing::Kind::kK, testing::Kind::kV}) {
      layers.push_back(testing::ReadLayer(cache.view(), layer, kind));
    }
  }
  return layers;
}

double MaxError(const std::vector<std::vector<double>>& actual,
                const std::vector<std::vector<double>>& expected) {
  EXPECT_EQ(actual.size(), expected.size());
  double worst = 0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) {
    worst = std::max(worst, testing::MaxRelError(actual[i], expected[i]));
  }
  return worst;
}

// A window mapper reads each token's w - 1 predecessors in the request: the session re-sends
// them in front of every later turn (turns shorter than w - 1 included, and a 70-token turn the
// server pipelines) and keeps only the added tokens' outputs, so the turns equal one request.
// The same pieces sent naively (each at its positions, no overlap) do not.
TEST(TranslateSessionTest, WindowMapperTurnsEqualOneTranslation) {
  Kvtd kvtd(/*pipeline_min_tokens=*/64, 4 << 20, WindowStoreDir());
  const MapperView& view = kvtd.view();
  ASSERT_EQ(view.window, kWindow);
  const std::vector<std::vector<int64_t>> splits = {{1, 1, 70, 1, 2, 75},
                                                    {37, 1, 1, 90, 21}};
  int variant = 0;
  for (Layout layout : {Layout::kHND, Layout::kNHD}) {
    for (const std::vector<int64_t>& turns : splits) {
      ++variant;
      const HostCache whole = RandomSource(150, DType::kFP32, layout, "window session source");
      v1::TranslateHeader base = Header();
      if (variant % 2 == 0) {
        // By pair: the window is learned from the mapper the first response names.
        base.clear_mapper_id();
        base.set_source_model("test/src");
        base.set_target_model(kWindowTarget);
      }
      base.set_output_layout(layout == Layout::kHND ? v1::LAYOUT_NHD : v1::LAYOUT_HND);
      base.set_session_id(absl::StrCat("window-conversation-", variant));
      SCOPED_TRACE(absl::StrCat(LayoutName(layout), " variant ", variant));
      absl::StatusOr<TranslateResult> at_once = kvtd.client->Translate(base, whole);
      ASSERT_TRUE(at_once.ok()) << at_once.status();
      EXPECT_LE(ErrorAgainstReference(view, whole, at_once->target, Positions{}), 1e-5);

      TranslateSession session(kvtd.client, base);
      std::vector<std::vector<double>> naive;
      int64_t begin = 0;
      for (int64_t count : turns) {
        const HostCache part =
            testing::ToHostCache(testing::SliceTokens(whole.view(), begin, begin + count));
        absl::StatusOr<TranslateResult> turn = session.Extend(part);
        ASSERT_TRUE(turn.ok()) << turn.status();
        EXPECT_EQ(turn->header.mapper_id(), "m");
        EXPECT_EQ(turn->header.window(), static_cast<uint32_t>(kWindow));
        EXPECT_EQ(turn->target.num_tokens, count);
        EXPECT_EQ(turn->header.num_tokens(), static_cast<uint32_t>(count));
        // The request carried the overlap: min(w - 1, tokens before the turn) more.
        EXPECT_EQ(turn->trailer.num_tokens(),
                  static_cast<uint64_t>(count + std::min<int64_t>(kWindow - 1, begin)));
        EXPECT_EQ(session.window(), kWindow);
        EXPECT_EQ(session.kept_tokens(), std::min<int64_t>(kWindow - 1, begin + count));

        v1::TranslateHeader alone = base;
        alone.set_position_offset(static_cast<uint64_t>(begin));
        absl::StatusOr<TranslateResult> piece = kvtd.client->Translate(alone, part);
        ASSERT_TRUE(piece.ok()) << piece.status();
        std::vector<std::vector<double>> layers = Layers(piece->target);
        if (naive.empty()) {
          naive = std::move(layers);
        } else {
          for (size_t i = 0; i < naive.size(); ++i) {
            naive[i].insert(naive[i].end(), layers[i].begin(), layers[i].end());
          }
        }
        begin += count;
      }
      ASSERT_EQ(begin, 150);
      EXPECT_EQ(session.tokens(), 150);
      EXPECT_EQ(session.turns(), static_cast<uint32_t>(turns.size()));
      EXPECT_EQ(session.target().num_tokens, 150);
      EXPECT_LE(ErrorAgainstReference(view, whole, session.target(), Positions{}), 1e-5);
      const std::vector<std::vector<double>> expected = Layers(at_once->target);
      EXPECT_LE(MaxError(Layers(session.target()), expected), 1e-5);
      // Without the overlap each piece's first tokens read zeros for the tokens before it.
      EXPECT_GT(MaxError(naive, expected), 1e-3);
    }
  }
}

// The response header names the serving version's window, and the session checks it every
// turn: a mapper hot-reloaded under the same id with a wider window is refused on the next turn
// (the overlap it carried is too short; the session unchanged), one reloaded with a narrower
// window serves on, the kept tokens dropped with their outputs.
TEST(TranslateSessionTest, AMapperReloadedWithAnotherWindowIsNoticed) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string store_dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/reload_store");
  const SynthOptions token_wise = TestPair(21);
  SynthOptions windowed = token_wise;
  windowed.window = kWindow;
  windowed.seed = 22;
  WriteOptions overwrite;
  overwrite.overwrite = true;
  KVT_ASSERT_OK(WriteSynthMapper(store_dir + "/m", token_wise, overwrite));
  Kvtd kvtd(/*pipeline_min_tokens=*/64, 4 << 20, store_dir);
  ASSERT_NE(kvtd.client, nullptr);
  const HostCache whole = RandomSource(40, DType::kFP32, Layout::kNHD, "reload session source");
  auto part = [&](int64_t begin, int64_t end) {
    return testing::ToHostCache(testing::SliceTokens(whole.view(), begin, end));
  };
  auto reload = [&](const SynthOptions& options, int64_t generation) {
    KVT_ASSERT_OK(WriteSynthMapper(store_dir + "/m", options, overwrite));
    KVT_ASSERT_OK(kvtd.kvtd->store().Scan());
    ASSERT_EQ(kvtd.kvtd->store().Info("m")->generation, generation);
  };

  TranslateSession widened(kvtd.client, Header());
  absl::StatusOr<TranslateResult> first = widened.Extend(part(0, 20));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->header.window(), 1u);
  EXPECT_EQ(widened.kept_tokens(), 0);
  reload(windowed, 2);
  absl::StatusOr<TranslateResult> refused = widened.Extend(part(20, 30));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("turn 2 was served by mapper 'm' with window 3, earlier turns by 'm' "
                        "with window 1"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("start a new session"));
  EXPECT_EQ(widened.tokens(), 20);
  EXPECT_EQ(widened.turns(), 1u);

  TranslateSession narrowed(kvtd.client, Header());
  ASSERT_TRUE(narrowed.Extend(part(0, 20)).ok());
  EXPECT_EQ(narrowed.window(), kWindow);
  EXPECT_EQ(narrowed.kept_tokens(), kWindow - 1);
  reload(token_wise, 3);
  absl::StatusOr<TranslateResult> second = narrowed.Extend(part(20, 30));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->header.window(), 1u);
  EXPECT_EQ(second->target.num_tokens, 10);
  EXPECT_EQ(narrowed.window(), 1);
  EXPECT_EQ(narrowed.kept_tokens(), 0);
  // The turn is the token-wise version's translation of its tokens at their positions.
  EXPECT_LE(ErrorAgainstReference(kvtd.view(), part(20, 30), second->target, Positions{20}),
            1e-5);
}

}  // namespace
}  // namespace kvt
