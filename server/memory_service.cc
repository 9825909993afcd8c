#include "server/memory_service.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/logging.h"

namespace kvt {

grpc::Status MemoryService::AdminWithSharedMemory(const grpc::ServerContext* context) const {
  if (auth_ != nullptr) {
    if (grpc::Status allowed = auth_->Authorize(*context, Role::kAdmin); !allowed.ok()) {
      return allowed;
    }
  }
  if (config_.shared_memory.allow_client_regions) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "client shared memory is disabled on this server "
                      "(shared_memory.allow_client_regions: false)");
}

absl::Time MemoryService::UnregisterDeadline(const grpc::ServerContext* context) const {
  return std::min(absl::FromChrono(context->deadline()),
                  absl::Now() + absl::Seconds(config_.shutdown.deadline_seconds));
}

grpc::Status MemoryService::RegisterSystemMemory(grpc::ServerContext* context,
                                                 const v1::RegisterSystemMemoryRequest* request,
                                                 v1::RegisterSystemMemoryResponse*) {
  if (grpc::Status allowed = AdminWithSharedMemory(context); !allowed.ok()) return allowed;
  if (cuda_memory_.Contains(request->name())) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat("name: a CUDA memory region named '", request->name(),
                                     "' is registered (names are shared by both kinds)"));
  }
  absl::Status status = system_memory_.Register(request->name(), request->key(),
                                                request->offset(), request->byte_size());
  if (status.ok()) {
    KVT_LOG(kInfo, "system memory registered")
        .With("name", request->name())
        .With("key", request->key())
        .With("bytes", request->byte_size());
  }
  return ToGrpcStatus(status);
}

grpc::Status MemoryService::UnregisterSystemMemory(
    grpc::ServerContext* context, const v1::UnregisterSystemMemoryRequest* request,
    v1::UnregisterSystemMemoryResponse*) {
  if (grpc::Status allowed = AdminWithSharedMemory(context); !allowed.ok()) return allowed;
  // Waits for the requests using the region, within the caller's deadline.
  return ToGrpcStatus(system_memory_.Unregister(request->name(), UnregisterDeadline(context)));
}

grpc::Status MemoryService::SystemMemoryStatus(grpc::ServerContext* context,
                                               const v1::SystemMemoryStatusRequest* request,
                                               v1::SystemMemoryStatusResponse* response) {
  if (grpc::Status allowed = AdminWithSharedMemory(context); !allowed.ok()) return allowed;
  absl::StatusOr<std::vector<SystemMemoryRegistry::RegionInfo>> regions =
      system_memory_.Status(request->name());
  if (!regions.ok()) return ToGrpcStatus(regions.status());
  for (const SystemMemoryRegistry::RegionInfo& info : *regions) {
    v1::SystemMemoryStatusResponse::Region* region = response->add_regions();
    region->set_name(info.name);
    region->set_key(info.key);
    region->set_offset(info.offset);
    region->set_byte_size(info.byte_size);
    region->set_in_use(info.in_use);
  }
  return grpc::Status::OK;
}

grpc::Status MemoryService::RegisterCudaMemory(grpc::ServerContext* context,
                                               const v1::RegisterCudaMemoryRequest* request,
                                               v1::RegisterCudaMemoryResponse*) {
  if (grpc::Status allowed = AdminWithSharedMemory(context); !allowed.ok()) return allowed;
  if (system_memory_.Contains(request->name())) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat("name: a system memory region named '", request->name(),
                                     "' is registered (names are shared by both kinds)"));
  }
  absl::Status status = cuda_memory_.Register(request->name(), request->raw_handle(),
                                              request->device_id(), request->byte_size());
  if (status.ok()) {
    KVT_LOG(kInfo, "CUDA memory registered")
        .With("name", request->name())
        .With("device_id", request->device_id())
        .With("bytes", request->byte_size());
  }
  return ToGrpcStatus(status);
}

grpc::Status MemoryService::UnregisterCudaMemory(grpc::ServerContext* context,
                                                 const v1::UnregisterCudaMemoryRequest* request,
                                                 v1::UnregisterCudaMemoryResponse*) {
  if (grpc::Status allowed = AdminWithSharedMemory(context); !allowed.ok()) return allowed;
  // Waits for the requests using the region, within the caller's deadline.
  return ToGrpcStatus(cuda_memory_.Unregister(request->name(), UnregisterDeadline(context)));
}

grpc::Status MemoryService::CudaMemoryStatus(grpc::ServerContext* context,
                                             const v1::CudaMemoryStatusRequest* request,
                                             v1::CudaMemoryStatusResponse* response) {
  if (grpc::Status allowed = AdminWithSharedMemory(context); !allowed.ok()) return allowed;
  absl::StatusOr<std::vector<CudaMemoryRegistry::RegionInfo>> regions =
      cuda_memory_.Status(request->name());
  if (!regions.ok()) return ToGrpcStatus(regions.status());
  for (const CudaMemoryRegistry::RegionInfo& info : *regions) {
    v1::CudaMemoryStatusResponse::Region* region = response->add_regions();
    region->set_name(info.name);
    region->set_device_id(info.device_id);
    region->set_byte_size(info.byte_size);
    region->set_in_use(info.in_use);
  }
  return grpc::Status::OK;
}

}  // namespace kvt
