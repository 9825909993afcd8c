#include "mapper_store/store.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

using ::absl::StatusCode;

ModelSpec Model(const std::string& name, int layers) {
  ModelSpec m;
  m.name = name;
  m.num_layers = layers;
  m.num_kv_heads = 2;
  m.head_dim = 8;
  m.rope.theta = 10000;
  m.rope.rotary_dim = 8;
  return m;
}

SynthOptions Pair(const std::string& source, const std::string& target, uint64_t seed = 1) {
  SynthOptions o;
  o.source = Model(source, 3);
  o.target = Model(target, 2);
  o.k = 2;
  o.dtype = DType::kFP16;
  o.seed = seed;
  return o;
}

void Corrupt(const std::string& dir) {
  const std::string path = JoinPath(dir, kDefaultWeightsFileName);
  std::string bytes = *ReadFileToString(path);
  bytes[bytes.size() - 1] ^= 0x40;
  ASSERT_TRUE(WriteStringToFile(path, bytes).ok());
}

class StoreTest : public ::testing::Test {
 protected:
  void Write(const std::string& id, const SynthOptions& options, bool overwrite = false) {
    WriteOptions w;
    w.overwrite = overwrite;
    KVT_ASSERT_OK(WriteSynthMapper(JoinPath(root_, id), options, w));
  }

  std::string root_ = testing::MakeTempDir("store");
};

TEST_F(StoreTest, ScanServesTheGoodMapperAndListsTheBrokenOneAsFailed) {
  Write("good", Pair("Qwen/Qwen3-14B", "Qwen/Qwen3-32B"));
  Write("broken", Pair("Qwen/Qwen3-32B", "Qwen/Qwen3-14B"));
  Corrupt(JoinPath(root_, "broken"));
  // Not mappers: no manifest, a writer's hidden temporary, a plain file.
  ASSERT_TRUE(MakeDirs(JoinPath(root_, "notes")).ok());
  Write(".half.tmp-1-0", Pair("a", "b"));
  ASSERT_TRUE(WriteStringToFile(JoinPath(root_, "README"), "hi").ok());

  absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(root_);
  ASSERT_TRUE(store.ok()) << store.status();
  const std::vector<MapperInfo> infos = (*store)->List();
  ASSERT_EQ(infos.size(), 2u);

  const MapperInfo& broken = infos[0];
  EXPECT_EQ(broken.id, "broken");
  EXPECT_EQ(broken.state, MapperState::kFailed);
  EXPECT_STREQ(MapperStateName(broken.state), "FAILED");
  EXPECT_NE(broken.state_reason.find("checksum mismatch for"), std::string::npos)
      << broken.state_reason;
  EXPECT_NE(broken.state_reason.find("weights.safetensors"), std::string::npos);
  EXPECT_EQ(broken.source_model, "Qwen/Qwen3-32B");  // from its (intact) manifest
  EXPECT_EQ(broken.weight_bytes, 0u);
  EXPECT_TRUE(broken.devices.empty());

  const MapperInfo& good = infos[1];
  EXPECT_EQ(good.id, "good");
  EXPECT_EQ(good.path, JoinPath(root_, "good"));
  EXPECT_EQ(good.state, MapperState::kHostResident);
  EXPECT_TRUE(good.state_reason.empty());
  EXPECT_EQ(good.source_model, "Qwen/Qwen3-14B");
  EXPECT_EQ(good.target_model, "Qwen/Qwen3-32B");
  EXPECT_EQ(good.kind, "ridge");
  EXPECT_EQ(good.k, 2);
  EXPECT_TRUE(good.synthetic);
  EXPECT_EQ(good.weight_dtype, DType::kFP16);
  EXPECT_EQ(good.source.num_layers, 3);
  EXPECT_EQ(good.target.head_dim, 8);
  // 2 target layers x 2 (K, V) x ([2*2*8, 16] + [16]) x 2 bytes.
  EXPECT_EQ(good.num_params, 2 * 2 * (32 * 16 + 16));
  EXPECT_EQ(good.weight_bytes, 2u * good.num_params);
  EXPECT_EQ(good.devices, (std::vector<std::string>{"host"}));
  EXPECT_EQ(good.hits, 0u);
  EXPECT_EQ(good.last_used_unix_ms, 0);

  // The good one serves, by pair and by id; the broken one never does.
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> found =
      (*store)->Find("Qwen/Qwen3-14B", "Qwen/Qwen3-32B");
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ((*found)->id(), "good");
  EXPECT_EQ((*found)->view().layers.size(), 2u);
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> by_id = (*store)->Get("good");
  ASSERT_TRUE(by_id.ok());
  EXPECT_EQ(by_id->get(), found->get());
  KVT_EXPECT_ERROR((*store)->Get("broken"), StatusCode::kFailedPrecondition,
                   "mapper 'broken' failed to load and cannot serve: ");
  KVT_EXPECT_ERROR((*store)->Find("Qwen/Qwen3-32B", "Qwen/Qwen3-14B"), StatusCode::kNotFound,
                   "no mapper for Qwen/Qwen3-32B -> Qwen/Qwen3-14B; mapper 'broken' for this "
                   "pair FAILED: ");

  absl::StatusOr<MapperInfo> info = (*store)->Info("good");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->hits, 2u);
  EXPECT_GT(info->last_used_unix_ms, 0);
}

TEST_F(StoreTest, NotFoundAndAmbiguousErrors) {
  Write("a", Pair("s", "t", 1));
  Write("b", Pair("s", "t", 2));
  absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(root_);
  ASSERT_TRUE(store.ok()) << store.status();
  KVT_EXPECT_ERROR((*store)->Find("Qwen/Qwen3-14B", "Qwen/Qwen3-32B"), StatusCode::kNotFound,
                   "no mapper for Qwen/Qwen3-14B -> Qwen/Qwen3-32B");
  KVT_EXPECT_ERROR((*store)->Find("t", "s"), StatusCode::kNotFound, "no mapper for t -> s");
  KVT_EXPECT_ERROR((*store)->Find("s", "t"), StatusCode::kFailedPrecondition,
                   "ambiguous: 2 mappers serve s -> t (a, b)");
  KVT_EXPECT_ERROR((*store)->Get("c"), StatusCode::kNotFound, "no mapper with id 'c'");
  KVT_EXPECT_ERROR((*store)->Info("c"), StatusCode::kNotFound, "no mapper with id 'c'");
  EXPECT_TRUE((*store)->Get("b").ok());
}

TEST_F(StoreTest, OpenRequiresTheRootDirectory) {
  KVT_EXPECT_ERROR(MapperStore::Open(JoinPath(root_, "missing")), StatusCode::kNotFound,
                   "does not exist");
  absl::StatusOr<std::unique_ptr<MapperStore>> empty = MapperStore::Open(root_);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE((*empty)->List().empty());
}

TEST_F(StoreTest, RescanAddsRetriesAndDropsWhileHandlesStayValid) {
  Write("one", Pair("s", "t"));
  Write("two", Pair("x", "y"));
  Corrupt(JoinPath(root_, "two"));
  MapperStore store(root_);
  KVT_ASSERT_OK(store.Scan());
  ASSERT_EQ(store.List().size(), 2u);
  EXPECT_EQ(store.List()[1].state, MapperState::kFailed);

  absl::StatusOr<std::shared_ptr<const LoadedMapper>> held = store.Get("one");
  ASSERT_TRUE(held.ok());
  const std::vector<uint8_t> before(
      static_cast<const uint8_t*>((*held)->view().layers[0].w_k.data),
      static_cast<const uint8_t*>((*held)->view().layers[0].w_k.data) + 64);

  ASSERT_TRUE(RemoveTree(JoinPath(root_, "one")).ok());  // dropped
  Write("two", Pair("x", "y"), /*overwrite=*/true);      // repaired: retried
  Write("three", Pair("p", "q"));                        // new
  KVT_ASSERT_OK(store.Scan());
  const std::vector<MapperInfo> infos = store.List();
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_EQ(infos[0].id, "three");
  EXPECT_EQ(infos[1].id, "two");
  EXPECT_EQ(infos[1].state, MapperState::kHostResident);
  EXPECT_TRUE(store.Find("x", "y").ok());
  KVT_EXPECT_ERROR(store.Get("one"), StatusCode::kNotFound, "no mapper with id 'one'");

  // The in-flight handle still owns its weights.
  const uint8_t* data = static_cast<const uint8_t*>((*held)->view().layers[0].w_k.data);
  EXPECT_EQ(std::vector<uint8_t>(data, data + 64), before);
}

TEST_F(StoreTest, ConcurrentLookupsDuringScans) {
  Write("m0", Pair("s0", "t0"));
  MapperStore store(root_);
  KVT_ASSERT_OK(store.Scan());
  std::atomic<bool> stop{false};
  std::atomic<int> served{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        if (store.Find("s0", "t0").ok()) ++served;
        store.List();
        store.Get("m1").IgnoreError();
      }
    });
  }
  for (int i = 1; i <= 4; ++i) {
    Write(absl::StrCat("m", i), Pair(absl::StrCat("s", i), absl::StrCat("t", i)));
    KVT_EXPECT_OK(store.Scan());
  }
  stop = true;
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(store.List().size(), 5u);
  EXPECT_GT(served.load(), 0);
  EXPECT_EQ(store.Info("m0")->hits, static_cast<uint64_t>(served.load()));
}

}  // namespace
}  // namespace kvt
