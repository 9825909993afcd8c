#include "server/translator_service.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "grpcpp/support/method_handler.h"
#include "server/mapper_store_setup.h"

namespace kvt {

TranslatorService::TranslatorService(const KvtdConfig& config, MapperStore* store,
                                     Backend* backend, Metrics* metrics,
                                     const Authenticator* auth, PrefixCache* prefix_cache)
    : config_(config),
      store_(store),
      backend_(backend),
      metrics_(metrics),
      auth_(auth),
      prefix_cache_(prefix_cache),
      memory_(config, auth),
      mapper_control_(config, store, auth),
      admission_(config.limits.max_inflight_requests, config.limits.max_inflight_bytes),
      compute_(1),
      // Idle layer buffers kept for the next request: a quarter of what admitted requests may
      // hold, so an idle kvtd keeps at most that much.
      buffers_(BufferPool::Create(config.limits.max_inflight_bytes / 4)) {
  translate_.config = &config_;
  translate_.store = store_;
  translate_.prefix_cache = prefix_cache_;
  translate_.shift_stats = &shift_stats_;
  translate_.system_memory = memory_.system_memory();
  translate_.cuda_memory = memory_.cuda_memory();
  translate_.admission = &admission_;
  translate_.compute = &compute_;
  translate_.buffers = buffers_.get();
  translate_.request_ids = &request_ids_;
  translate_.draining = &draining_;
  // Method 0 of kvt.v1.KvTranslator is TranslateKV (service.proto lists it first).
  MarkMethodStreamed(
      0, new grpc::internal::BidiStreamingHandler<TranslatorService, TranslateRequestMessage,
                                                  TranslateResponseMessage>(
             [](TranslatorService* service, grpc::ServerContext* context,
                TranslateKVStreamType* stream) {
               return service->TranslateKVStream(context, stream);
             },
             this));
  // The backend computes on a device of the store; a store opened without one (tests, tools)
  // gets this backend as its device.
  const std::vector<std::string> devices = store_->DeviceNames();
  if (std::find(devices.begin(), devices.end(), backend_->device()) == devices.end()) {
    added_device_ =
        store_->AddDevice({backend_, DeviceBudgetBytes(config_, *backend_)}).ok();
  }
}

TranslatorService::~TranslatorService() {
  // The store may outlive this service and its backend: take back the device lent to it.
  if (added_device_) {
    absl::Status removed = store_->RemoveDevice(
        backend_->device(), absl::Now() + absl::Seconds(config_.shutdown.deadline_seconds));
    if (!removed.ok()) {
      KVT_LOG(kWarning, "mapper store device not removed").With("error", removed.message());
    }
  }
}

grpc::Status TranslatorService::Authorize(const grpc::ServerContext* context, Role role) const {
  if (auth_ == nullptr) return grpc::Status::OK;
  return auth_->Authorize(*context, role);
}

grpc::Status TranslatorService::TranslateKVStream(grpc::ServerContext* context,
                                                 TranslateKVStreamType* stream) {
  TranslateRecord record;
  grpc::Status status = Authorize(context, Role::kClient);
  if (status.ok()) {
    TranslateCall call;
    call.read = [stream](TranslateRequestMessage* message) { return stream->Read(message); };
    call.write = [stream](const TranslateResponseMessage& message) {
      return stream->Write(message);
    };
    call.cancelled = [context] { return context->IsCancelled(); };
    call.deadline = absl::FromChrono(context->deadline());
    call.closed = [context] { return CancelledOrDeadline(context); };
    status = ::kvt::TranslateKV(translate_, call, &record);
  }
  record.code = static_cast<absl::StatusCode>(status.error_code());
  if (metrics_ != nullptr) metrics_->RecordTranslate(record);
  return status;
}

grpc::Status TranslatorService::ListMappers(grpc::ServerContext* context,
                                            const v1::ListMappersRequest* request,
                                            v1::ListMappersResponse* response) {
  return mapper_control_.ListMappers(context, request, response);
}
grpc::Status TranslatorService::GetMapper(grpc::ServerContext* context,
                                          const v1::GetMapperRequest* request,
                                          v1::MapperInfo* response) {
  return mapper_control_.GetMapper(context, request, response);
}
grpc::Status TranslatorService::LoadMapper(grpc::ServerContext* context,
                                           const v1::LoadMapperRequest* request,
                                           v1::LoadMapperResponse* response) {
  return mapper_control_.LoadMapper(context, request, response);
}
grpc::Status TranslatorService::UnloadMapper(grpc::ServerContext* context,
                                             const v1::UnloadMapperRequest* request,
                                             v1::UnloadMapperResponse* response) {
  return mapper_control_.UnloadMapper(context, request, response);
}

grpc::Status TranslatorService::RegisterSystemMemory(
    grpc::ServerContext* context, const v1::RegisterSystemMemoryRequest* request,
    v1::RegisterSystemMemoryResponse* response) {
  return memory_.RegisterSystemMemory(context, request, response);
}
grpc::Status TranslatorService::UnregisterSystemMemory(
    grpc::ServerContext* context, const v1::UnregisterSystemMemoryRequest* request,
    v1::UnregisterSystemMemoryResponse* response) {
  return memory_.UnregisterSystemMemory(context, request, response);
}
grpc::Status TranslatorService::SystemMemoryStatus(grpc::ServerContext* context,
                                                   const v1::SystemMemoryStatusRequest* request,
                                                   v1::SystemMemoryStatusResponse* response) {
  return memory_.SystemMemoryStatus(context, request, response);
}
grpc::Status TranslatorService::RegisterCudaMemory(grpc::ServerContext* context,
                                                   const v1::RegisterCudaMemoryRequest* request,
                                                   v1::RegisterCudaMemoryResponse* response) {
  return memory_.RegisterCudaMemory(context, request, response);
}
grpc::Status TranslatorService::UnregisterCudaMemory(
    grpc::ServerContext* context, const v1::UnregisterCudaMemoryRequest* request,
    v1::UnregisterCudaMemoryResponse* response) {
  return memory_.UnregisterCudaMemory(context, request, response);
}
grpc::Status TranslatorService::CudaMemoryStatus(grpc::ServerContext* context,
                                                 const v1::CudaMemoryStatusRequest* request,
                                                 v1::CudaMemoryStatusResponse* response) {
  return memory_.CudaMemoryStatus(context, request, response);
}

grpc::Status TranslatorService::ServerMetadata(grpc::ServerContext* context,
                                               const v1::ServerMetadataRequest* /*request*/,
                                               v1::ServerMetadataResponse* response) {
  grpc::Status status = Authorize(context, Role::kClient);
  if (!status.ok()) return status;
  *response = ServerMetadataOf(/*prefix_cache_enabled=*/prefix_cache_ != nullptr,
                               prefix_cache_ != nullptr ? prefix_cache_->digest() : nullptr);
  return grpc::Status::OK;
}

}  // namespace kvt
