#include "kernels/backend.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class FakePrepared : public PreparedMapper {
 public:
  explicit FakePrepared(MapperView view) : view_(std::move(view)) {}
  const MapperView& view() const override { return view_; }
  uint64_t bytes() const override { return 0; }

 private:
  MapperView view_;
};

// Records TranslateLayer calls; fails on `fail_layer`.
class FakeBackend : public Backend {
 public:
  std::string name() const override { return "fake"; }
  std::string device() const override { return "none"; }
  absl::StatusOr<std::shared_ptr<PreparedMapper>> Prepare(const MapperView& mapper) override {
    return std::make_shared<FakePrepared>(mapper);
  }
  absl::Status TranslateLayer(const PreparedMapper&, int target_layer, const CacheView&,
                              const Positions&, const TranslateOptions&,
                              MutableCacheView*) override {
    calls.push_back(target_layer);
    if (target_layer == fail_layer) return absl::InternalError("layer failed");
    return absl::OkStatus();
  }
  std::vector<int> calls;
  int fail_layer = -1;
};

struct Fixture {
  Fixture() {
    mapper.source = {"s", 3, 2, 4, {}};
    mapper.target = {"t", 2, 1, 8, {}};
    mapper.layers.resize(2);
    mapper.layers[0].sigma_k = {2, 0};
    mapper.layers[0].sigma_v = {1};
    mapper.layers[1].sigma_k = {1};
    mapper.layers[1].sigma_v = {1};
    source.num_kv_heads = 2;
    source.head_dim = 4;
    source.num_tokens = 5;
    source.k = {&dummy, &dummy, &dummy};
    source.v = {&dummy, &dummy, &dummy};
    target.num_kv_heads = 1;
    target.head_dim = 8;
    target.num_tokens = 5;
    target.k = {&dummy, &dummy};
    target.v = {&dummy, &dummy};
  }
  MapperView mapper;
  CacheView source;
  MutableCacheView target;
  int dummy = 0;
};

TEST(BackendTest, TranslateLoopsOverTargetLayers) {
  Fixture f;
  FakeBackend backend;
  FakePrepared prepared(f.mapper);
  EXPECT_TRUE(backend.Translate(prepared, f.source, Positions(), TranslateOptions(), &f.target)
                  .ok());
  EXPECT_THAT(backend.calls, ElementsAre(0, 1));
}

TEST(BackendTest, TranslateStopsAtTheFirstError) {
  Fixture f;
  FakeBackend backend;
  backend.fail_layer = 0;
  FakePrepared prepared(f.mapper);
  EXPECT_EQ(
      backend.Translate(prepared, f.source, Positions(), TranslateOptions(), &f.target).code(),
      absl::StatusCode::kInternal);
  EXPECT_THAT(backend.calls, ElementsAre(0));
}

TEST(BackendTest, TranslateChecksShapesBeforeAnyLayer) {
  Fixture f;
  FakeBackend backend;
  FakePrepared prepared(f.mapper);
  f.source.v[2] = nullptr;  // used by no sigma list, but Translate reads whole caches
  const absl::Status status =
      backend.Translate(prepared, f.source, Positions(), TranslateOptions(), &f.target);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("source.v[2] is null"));
  EXPECT_TRUE(backend.calls.empty());
  EXPECT_EQ(backend.Translate(prepared, f.source, Positions(), TranslateOptions(), nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BackendTest, CheckCacheShapesNamesTheField) {
  Fixture f;
  EXPECT_TRUE(CheckCacheShapes(f.mapper, f.source, f.target).ok());
  const auto message = [&] {
    return std::string(CheckCacheShapes(f.mapper, f.source, f.target).message());
  };
  f.source.num_kv_heads = 4;
  EXPECT_EQ(message(), "source.num_kv_heads=4 but mapper source model has 2");
  f.source.num_kv_heads = 2;
  f.target.head_dim = 16;
  EXPECT_EQ(message(), "target.head_dim=16 but mapper target model has 8");
  f.target.head_dim = 8;
  f.source.k[1] = nullptr;
  EXPECT_EQ(message(), "source.k[1] is null");
  f.source.k[1] = &f.dummy;
  f.target.k.push_back(&f.dummy);
  EXPECT_EQ(message(), "target.k has 3 layers but mapper target model has 2");
  f.target.k.pop_back();
  f.target.num_tokens = 4;
  EXPECT_EQ(message(), "target.num_tokens=4 but source.num_tokens=5");
  f.target.num_tokens = f.source.num_tokens = -1;
  EXPECT_EQ(message(), "source.num_tokens=-1 is negative");
  // Zero tokens: null pointers are acceptable (nothing is read or written).
  f.target.num_tokens = f.source.num_tokens = 0;
  f.source.k[0] = nullptr;
  EXPECT_TRUE(CheckCacheShapes(f.mapper, f.source, f.target).ok());
}

TEST(BackendTest, CheckLayerCacheShapesNeedsOnlyThatLayersInputs) {
  Fixture f;
  // Layer 1 reads source layer 1 only and writes target layer 1.
  f.source.k[0] = f.source.k[2] = f.source.v[0] = f.source.v[2] = nullptr;
  f.target.k[0] = f.target.v[0] = nullptr;
  EXPECT_TRUE(CheckLayerCacheShapes(f.mapper, 1, f.source, f.target).ok());
  EXPECT_EQ(std::string(CheckLayerCacheShapes(f.mapper, 0, f.source, f.target).message()),
            "source.k[0] is null");
  EXPECT_THAT(std::string(CheckLayerCacheShapes(f.mapper, 2, f.source, f.target).message()),
              HasSubstr("target_layer=2 out of range [0, 2)"));
  f.mapper.layers[1].sigma_v = {3};
  EXPECT_THAT(std::string(CheckLayerCacheShapes(f.mapper, 1, f.source, f.target).message()),
              HasSubstr("source layer 3 out of range [0, 3)"));
}

}  // namespace
}  // namespace kvt
