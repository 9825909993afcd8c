#include "server/mapper_control_service.h"

#include <algorithm>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "transport/proto_convert.h"

namespace kvt {
namespace {

v1::MapperState StateToProto(MapperState state) {
  switch (state) {
    case MapperState::kDiscovered:
      return v1::MAPPER_STATE_DISCOVERED;
    case MapperState::kLoading:
      return v1::MAPPER_STATE_LOADING;
    case MapperState::kHostResident:
      return v1::MAPPER_STATE_HOST_RESIDENT;
    case MapperState::kDeviceResident:
      return v1::MAPPER_STATE_DEVICE_RESIDENT;
    case MapperState::kFailed:
      return v1::MAPPER_STATE_FAILED;
  }
  return v1::MAPPER_STATE_UNSPECIFIED;
}

void FillShape(const ModelSpec& model, v1::CacheShape* shape) {
  shape->set_num_layers(model.num_layers);
  shape->set_num_kv_heads(model.num_kv_heads);
  shape->set_head_dim(model.head_dim);
}

}  // namespace

void FillMapperInfo(const MapperInfo& info, v1::MapperInfo* out) {
  out->set_mapper_id(info.id);
  out->set_source_model(info.source_model);
  out->set_target_model(info.target_model);
  out->set_kind(info.kind);
  out->set_k(info.k);
  out->set_window(info.window);
  out->set_state(StateToProto(info.state));
  out->set_state_reason(info.state_reason);
  out->set_weight_bytes(info.weight_bytes);
  if (info.state != MapperState::kFailed) out->set_weight_dtype(DTypeToProto(info.weight_dtype));
  FillShape(info.source, out->mutable_source_shape());
  FillShape(info.target, out->mutable_target_shape());
  for (const std::string& device : info.devices) out->add_devices(device);
  out->set_last_used_unix_ms(info.last_used_unix_ms);
  out->set_hits(info.hits);
  out->set_page_ins(info.page_ins);
  out->set_synthetic(info.synthetic);
  out->set_path(info.path);
  for (const Placement& placement : info.placements) {
    v1::Residency* residency = out->add_residency();
    residency->set_device(placement.device);
    residency->set_bytes(placement.bytes);
    residency->set_pins(static_cast<uint32_t>(placement.pins));
    residency->set_ready(placement.ready);
  }
  out->set_loads(info.loads);
  out->set_evictions(info.evictions);
  out->set_generation(info.generation);
}

grpc::Status MapperControlService::Authorize(const grpc::ServerContext* context,
                                             Role role) const {
  if (auth_ == nullptr) return grpc::Status::OK;
  return auth_->Authorize(*context, role);
}

grpc::Status MapperControlService::ListMappers(grpc::ServerContext* context,
                                               const v1::ListMappersRequest*,
                                               v1::ListMappersResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kClient); !allowed.ok()) return allowed;
  for (const MapperInfo& info : store_->List()) FillMapperInfo(info, response->add_mappers());
  return grpc::Status::OK;
}

grpc::Status MapperControlService::GetMapper(grpc::ServerContext* context,
                                             const v1::GetMapperRequest* request,
                                             v1::MapperInfo* response) {
  if (grpc::Status allowed = Authorize(context, Role::kClient); !allowed.ok()) return allowed;
  if (request->mapper_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "mapper_id is required");
  }
  absl::StatusOr<MapperInfo> info = store_->Info(request->mapper_id());
  if (!info.ok()) return ToGrpcStatus(info.status());
  FillMapperInfo(*info, response);
  return grpc::Status::OK;
}

grpc::Status MapperControlService::LoadMapper(grpc::ServerContext* context,
                                              const v1::LoadMapperRequest* request,
                                              v1::LoadMapperResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (request->mapper_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "mapper_id is required");
  }
  absl::StatusOr<MapperInfo> info = store_->Load(request->mapper_id(), request->device(),
                                                 absl::FromChrono(context->deadline()));
  if (!info.ok()) return ToGrpcStatus(info.status());
  KVT_LOG(kInfo, "mapper loaded")
      .With("mapper", info->id)
      .With("device", request->device().empty() ? "host" : request->device())
      .With("state", MapperStateName(info->state));
  FillMapperInfo(*info, response->mutable_mapper());
  return grpc::Status::OK;
}

grpc::Status MapperControlService::UnloadMapper(grpc::ServerContext* context,
                                                const v1::UnloadMapperRequest* request,
                                                v1::UnloadMapperResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (request->mapper_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "mapper_id is required");
  }
  // Waits for the requests holding the copy, within the caller's deadline.
  const absl::Time deadline =
      std::min(absl::FromChrono(context->deadline()),
               absl::Now() + absl::Seconds(config_.shutdown.deadline_seconds));
  absl::StatusOr<MapperInfo> info =
      store_->Unload(request->mapper_id(), request->device(), deadline);
  if (!info.ok()) return ToGrpcStatus(info.status());
  KVT_LOG(kInfo, "mapper unloaded")
      .With("mapper", info->id)
      .With("device", request->device().empty() ? "host" : request->device());
  FillMapperInfo(*info, response->mutable_mapper());
  return grpc::Status::OK;
}

}  // namespace kvt
