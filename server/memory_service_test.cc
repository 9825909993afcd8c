// MemoryService: a real POSIX shm object registered, listed and unregistered; names shared with
// the CUDA registry; everything refused while client regions are disabled.
#include "server/memory_service.h"

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/shm_object.h"

namespace kvt {
namespace {

KvtdConfig RegionsAllowed(bool allowed) {
  KvtdConfig config;
  config.shared_memory.allow_client_regions = allowed;
  return config;
}

TEST(MemoryServiceTest, RegisterStatusUnregister) {
  MemoryService service(RegionsAllowed(true), nullptr);
  grpc::ServerContext context;
  test::ShmObject object(4096);
  v1::RegisterSystemMemoryRequest reg;
  reg.set_name("r1");
  reg.set_key(object.key());
  reg.set_byte_size(4096);
  v1::RegisterSystemMemoryResponse registered;
  ASSERT_TRUE(service.RegisterSystemMemory(&context, &reg, &registered).ok());
  EXPECT_TRUE(service.system_memory()->Contains("r1"));

  v1::SystemMemoryStatusRequest status_request;
  v1::SystemMemoryStatusResponse status;
  ASSERT_TRUE(service.SystemMemoryStatus(&context, &status_request, &status).ok());
  ASSERT_EQ(status.regions_size(), 1);
  EXPECT_EQ(status.regions(0).name(), "r1");
  EXPECT_EQ(status.regions(0).byte_size(), 4096u);

  // One namespace for both kinds of region.
  v1::RegisterCudaMemoryRequest cuda;
  cuda.set_name("r1");
  v1::RegisterCudaMemoryResponse cuda_registered;
  const grpc::Status taken = service.RegisterCudaMemory(&context, &cuda, &cuda_registered);
  EXPECT_EQ(taken.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(taken.error_message().find("names are shared by both kinds"), std::string::npos);

  v1::UnregisterSystemMemoryRequest unreg;
  unreg.set_name("r1");
  v1::UnregisterSystemMemoryResponse unregistered;
  ASSERT_TRUE(service.UnregisterSystemMemory(&context, &unreg, &unregistered).ok());
  EXPECT_FALSE(service.system_memory()->Contains("r1"));
  EXPECT_EQ(service.UnregisterSystemMemory(&context, &unreg, &unregistered).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST(MemoryServiceTest, DisabledRefusesEveryCall) {
  MemoryService service(RegionsAllowed(false), nullptr);
  grpc::ServerContext context;
  v1::RegisterSystemMemoryRequest reg;
  v1::RegisterSystemMemoryResponse registered;
  const grpc::Status status = service.RegisterSystemMemory(&context, &reg, &registered);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(status.error_message().find("shared_memory.allow_client_regions: false"),
            std::string::npos);
  v1::CudaMemoryStatusRequest cuda_status;
  v1::CudaMemoryStatusResponse cuda_regions;
  EXPECT_EQ(service.CudaMemoryStatus(&context, &cuda_status, &cuda_regions).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

}  // namespace
}  // namespace kvt
