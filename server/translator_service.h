// The kvt.v1.KvTranslator gRPC service: validates and admits TranslateKV streams, assembles
// inline source chunks, runs the backend layer by layer on the compute executor and streams
// target chunks back while the next layer computes; model control over the mapper store.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "mapper_store/store.h"
#include "proto/kvt/v1/service.grpc.pb.h"
#include "prefix_cache/prefix_cache.h"
#include "quality/input_shift.h"
#include "quality/input_shift_cache.h"
#include "server/admission.h"
#include "server/compute_executor.h"
#include "server/auth.h"
#include "server/config.h"
#include "transport/buffer_pool.h"
#include "transport/chunk_wire.h"
#include "transport/cuda_registry.h"
#include "transport/shm_registry.h"
#include "server/metrics.h"

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
  SystemMemoryRegistry* system_memory() { return &system_memory_; }
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

 private:
  // What a request computes with: the mapper's copy on a compute device, pinned in the
  // request's handle (paged in first if needed), and the mapper's input-shift statistics.
  struct Derived {
    const PreparedMapper* prepared = nullptr;      // valid while the handle is held
    Backend* backend = nullptr;                    // the device's backend
    std::shared_ptr<const InputShiftStats> shift;  // null: the mapper carries no statistics
  };
  absl::StatusOr<Derived> Prepared(MapperHandle* handle, absl::Time deadline);
  // How long a request may wait for a mapper load or for room in a budget.
  AcquireOptions MapperWait(const grpc::ServerContext* context) const;

  // The RPC bodies; the public methods record their outcome (every exit path) in metrics_.
  grpc::Status TranslateKVImpl(grpc::ServerContext* context, TranslateKVStreamType* stream,
                               TranslateRecord* record);
  grpc::Status ValidateKVImpl(grpc::ServerContext* context,
                              grpc::ServerReader<v1::ValidateKVRequest>* reader,
                              v1::ValidateKVResponse* response, ValidateRecord* record);
  std::string RequestId(const std::string& from_header);
  // header.input.cached: the lease taken (single use) and checked against the header.
  absl::StatusOr<PrefixLease> TakePrefixLease(const v1::TranslateHeader& header);
  static absl::Status CheckLeaseFitsMapper(const PrefixLease& lease,
                                           const MapperView& view);
  // OK, or UNAUTHENTICATED / PERMISSION_DENIED when `auth_` is set and the call lacks `role`.
  grpc::Status Authorize(const grpc::ServerContext* context, Role role) const;
  // FAILED_PRECONDITION unless shared_memory.allow_client_regions.
  grpc::Status SharedMemoryEnabled() const;

  const KvtdConfig config_;
  MapperStore* const store_;
  Backend* const backend_;
  Metrics* const metrics_;
  const Authenticator* const auth_;
  SystemMemoryRegistry system_memory_;
  CudaMemoryRegistry cuda_memory_;
  AdmissionController admission_;
  ComputeExecutor compute_;
  std::shared_ptr<BufferPool> buffers_;  // layer buffers reused across requests
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> next_request_id_{1};
  bool added_device_ = false;  // the store had no device for backend_: this service added it
  PrefixCache* const prefix_cache_;
  InputShiftCache shift_stats_;

};

}  // namespace kvt
