// The kvt.v1.KvTranslator gRPC service, the one stub clients use: TranslateKV (run by
// server/translate/translate_kv.h, step by step in server/translate/), ValidateKV, and the
// mapper-control and memory-registration RPCs, forwarded to MapperControlService and
// MemoryService, and ServerMetadata.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "kernels/backend.h"
#include "mapper_store/store.h"
#include "prefix_cache/prefix_cache.h"
#include "proto/kvt/v1/service.grpc.pb.h"
#include "quality/input_shift.h"
#include "quality/input_shift_cache.h"
#include "server/admission.h"
#include "server/auth.h"
#include "server/compute_executor.h"
#include "server/config.h"
#include "server/mapper_control_service.h"
#include "server/memory_service.h"
#include "server/metrics.h"
#include "server/server_metadata.h"
#include "server/translate/request_plan.h"
#include "server/translate/translate_kv.h"
#include "transport/buffer_pool.h"
#include "transport/chunk_wire.h"
#include "transport/cuda_registry.h"
#include "transport/shm_registry.h"

namespace kvt {

class TranslatorService final : public v1::KvTranslator::Service {
 public:
  // `store`, `backend`, `metrics` (optional: null records nothing) and `auth` (optional: null
  // allows every call) must outlive the service.
  // `prefix_cache` (optional) resolves TranslateKV inputs that name a leased stored prefix
  // (header.input.cached); null refuses them.
  TranslatorService(const KvtdConfig& config, MapperStore* store, Backend* backend,
                    Metrics* metrics = nullptr, const Authenticator* auth = nullptr,
                    PrefixCache* prefix_cache = nullptr);
  ~TranslatorService() override;

  // After this, new translations are refused with UNAVAILABLE; in-flight ones continue.
  void StartDraining() { draining_.store(true); }
  bool draining() const { return draining_.load(); }
  int64_t inflight_requests() const { return admission_.inflight_requests(); }
  // Shared with KvPrefixCache: the regions a Publish reads, the mappers' shift statistics.
  SystemMemoryRegistry* system_memory() { return memory_.system_memory(); }
  InputShiftCache* shift_stats() { return &shift_stats_; }

  // TranslateKV, registered in place of the generated handler: its messages are
  // transport/chunk_wire.h's, whose chunk data moves as gRPC slices (no protobuf copies); the
  // bytes on the wire are the same protobuf.
  using TranslateKVStreamType =
      grpc::ServerReaderWriter<TranslateResponseMessage, TranslateRequestMessage>;
  grpc::Status TranslateKVStream(grpc::ServerContext* context, TranslateKVStreamType* stream);
  grpc::Status ValidateKV(grpc::ServerContext* context,
                          grpc::ServerReader<v1::ValidateKVRequest>* reader,
                          v1::ValidateKVResponse* response) override;
  grpc::Status ListMappers(grpc::ServerContext* context, const v1::ListMappersRequest* request,
                           v1::ListMappersResponse* response) override;
  grpc::Status GetMapper(grpc::ServerContext* context, const v1::GetMapperRequest* request,
                         v1::MapperInfo* response) override;
  grpc::Status LoadMapper(grpc::ServerContext* context, const v1::LoadMapperRequest* request,
                          v1::LoadMapperResponse* response) override;
  grpc::Status UnloadMapper(grpc::ServerContext* context, const v1::UnloadMapperRequest* request,
                            v1::UnloadMapperResponse* response) override;
  grpc::Status RegisterSystemMemory(grpc::ServerContext* context,
                                    const v1::RegisterSystemMemoryRequest* request,
                                    v1::RegisterSystemMemoryResponse* response) override;
  grpc::Status UnregisterSystemMemory(grpc::ServerContext* context,
                                      const v1::UnregisterSystemMemoryRequest* request,
                                      v1::UnregisterSystemMemoryResponse* response) override;
  grpc::Status SystemMemoryStatus(grpc::ServerContext* context,
                                  const v1::SystemMemoryStatusRequest* request,
                                  v1::SystemMemoryStatusResponse* response) override;
  grpc::Status RegisterCudaMemory(grpc::ServerContext* context,
                                  const v1::RegisterCudaMemoryRequest* request,
                                  v1::RegisterCudaMemoryResponse* response) override;
  grpc::Status UnregisterCudaMemory(grpc::ServerContext* context,
                                    const v1::UnregisterCudaMemoryRequest* request,
                                    v1::UnregisterCudaMemoryResponse* response) override;
  grpc::Status CudaMemoryStatus(grpc::ServerContext* context,
                                const v1::CudaMemoryStatusRequest* request,
                                v1::CudaMemoryStatusResponse* response) override;
  // kvtd's release and extensions (server/server_metadata.h); client role under auth.
  grpc::Status ServerMetadata(grpc::ServerContext* context,
                              const v1::ServerMetadataRequest* request,
                              v1::ServerMetadataResponse* response) override;

 private:
  grpc::Status ValidateKVImpl(grpc::ServerContext* context,
                              grpc::ServerReader<v1::ValidateKVRequest>* reader,
                              v1::ValidateKVResponse* response, ValidateRecord* record);
  // OK, or UNAUTHENTICATED / PERMISSION_DENIED when `auth_` is set and the call lacks `role`.
  grpc::Status Authorize(const grpc::ServerContext* context, Role role) const;

  const KvtdConfig config_;
  MapperStore* const store_;
  Backend* const backend_;
  Metrics* const metrics_;
  const Authenticator* const auth_;
  PrefixCache* const prefix_cache_;
  MemoryService memory_;
  MapperControlService mapper_control_;
  AdmissionController admission_;
  ComputeExecutor compute_;
  std::shared_ptr<BufferPool> buffers_;  // layer buffers reused across requests
  std::atomic<bool> draining_{false};
  RequestIds request_ids_;
  InputShiftCache shift_stats_;
  TranslateServices translate_;  // points at the members above
  bool added_device_ = false;  // the store had no device for backend_: this service added it
};

}  // namespace kvt
