// Client memory registration of kvt.v1.KvTranslator (Register/Unregister/Status of system
// shared memory and CUDA IPC regions): owns the two registries TranslateKV leases regions from;
// TranslatorService forwards those RPCs here.
#pragma once

#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "proto/kvt/v1/service.grpc.pb.h"
#include "server/auth.h"
#include "server/config.h"
#include "transport/cuda_registry.h"
#include "transport/shm_registry.h"

namespace kvt {

class MemoryService {
 public:
  // `auth` (optional: null allows every call) must outlive the service.
  MemoryService(const KvtdConfig& config, const Authenticator* auth)
      : config_(config), auth_(auth) {}

  SystemMemoryRegistry* system_memory() { return &system_memory_; }
  CudaMemoryRegistry* cuda_memory() { return &cuda_memory_; }

  grpc::Status RegisterSystemMemory(grpc::ServerContext* context,
                                    const v1::RegisterSystemMemoryRequest* request,
                                    v1::RegisterSystemMemoryResponse* response);
  grpc::Status UnregisterSystemMemory(grpc::ServerContext* context,
                                      const v1::UnregisterSystemMemoryRequest* request,
                                      v1::UnregisterSystemMemoryResponse* response);
  grpc::Status SystemMemoryStatus(grpc::ServerContext* context,
                                  const v1::SystemMemoryStatusRequest* request,
                                  v1::SystemMemoryStatusResponse* response);
  grpc::Status RegisterCudaMemory(grpc::ServerContext* context,
                                  const v1::RegisterCudaMemoryRequest* request,
                                  v1::RegisterCudaMemoryResponse* response);
  grpc::Status UnregisterCudaMemory(grpc::ServerContext* context,
                                    const v1::UnregisterCudaMemoryRequest* request,
                                    v1::UnregisterCudaMemoryResponse* response);
  grpc::Status CudaMemoryStatus(grpc::ServerContext* context,
                                const v1::CudaMemoryStatusRequest* request,
                                v1::CudaMemoryStatusResponse* response);

 private:
  // OK, or UNAUTHENTICATED / PERMISSION_DENIED, or FAILED_PRECONDITION unless
  // shared_memory.allow_client_regions.
  grpc::Status AdminWithSharedMemory(const grpc::ServerContext* context) const;
  // How long an unregister waits for the requests using the region.
  absl::Time UnregisterDeadline(const grpc::ServerContext* context) const;

  const KvtdConfig config_;
  const Authenticator* const auth_;
  SystemMemoryRegistry system_memory_;
  CudaMemoryRegistry cuda_memory_;
};

}  // namespace kvt
