// MapperControlService over a real mapper store holding a synthetic mapper: list, get, load to
// host and unload, and the errors for a missing id; calls carry a plain grpc::ServerContext.
#include "server/mapper_control_service.h"

#include "gtest/gtest.h"
#include "mapper_store/format/test_util.h"
#include "mapper_store/synth.h"

namespace kvt {
namespace {

std::unique_ptr<MapperStore> OneMapperStore() {
  const std::string root = testing::MakeTempDir("mapper-control");
  absl::StatusOr<SynthOptions> options = SynthPreset("demo-tiny");
  EXPECT_TRUE(options.ok()) << options.status();
  KVT_EXPECT_OK(WriteSynthMapper(root + "/tiny", *options));
  absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(root);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(*store);
}

TEST(MapperControlServiceTest, ListGetLoadUnload) {
  std::unique_ptr<MapperStore> store = OneMapperStore();
  MapperControlService service(KvtdConfig(), store.get(), nullptr);
  grpc::ServerContext context;

  v1::ListMappersResponse list;
  ASSERT_TRUE(service.ListMappers(&context, nullptr, &list).ok());
  ASSERT_EQ(list.mappers_size(), 1);
  EXPECT_EQ(list.mappers(0).mapper_id(), "tiny");
  EXPECT_EQ(list.mappers(0).target_shape().num_layers(), 6u);
  EXPECT_TRUE(list.mappers(0).synthetic());

  v1::LoadMapperRequest load;
  load.set_mapper_id("tiny");
  v1::LoadMapperResponse loaded;
  ASSERT_TRUE(service.LoadMapper(&context, &load, &loaded).ok());
  EXPECT_EQ(loaded.mapper().state(), v1::MAPPER_STATE_HOST_RESIDENT);

  v1::GetMapperRequest get;
  get.set_mapper_id("tiny");
  v1::MapperInfo info;
  ASSERT_TRUE(service.GetMapper(&context, &get, &info).ok());
  EXPECT_EQ(info.state(), v1::MAPPER_STATE_HOST_RESIDENT);
  EXPECT_GE(info.loads(), 1u);
  EXPECT_EQ(info.weight_dtype(), v1::DTYPE_FP32);

  v1::UnloadMapperRequest unload;
  unload.set_mapper_id("tiny");
  v1::UnloadMapperResponse unloaded;
  ASSERT_TRUE(service.UnloadMapper(&context, &unload, &unloaded).ok());
  EXPECT_EQ(unloaded.mapper().state(), v1::MAPPER_STATE_DISCOVERED);
}

TEST(MapperControlServiceTest, MissingOrUnknownIds) {
  std::unique_ptr<MapperStore> store = OneMapperStore();
  MapperControlService service(KvtdConfig(), store.get(), nullptr);
  grpc::ServerContext context;
  v1::GetMapperRequest get;
  v1::MapperInfo info;
  grpc::Status status = service.GetMapper(&context, &get, &info);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "mapper_id is required");
  get.set_mapper_id("nope");
  EXPECT_EQ(service.GetMapper(&context, &get, &info).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::LoadMapperRequest load;
  v1::LoadMapperResponse loaded;
  EXPECT_EQ(service.LoadMapper(&context, &load, &loaded).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

}  // namespace
}  // namespace kvt
