// Mapper control of kvt.v1.KvTranslator (ListMappers, GetMapper, LoadMapper, UnloadMapper) over
// the mapper store; TranslatorService forwards those RPCs here.
#pragma once

#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "mapper_store/store.h"
#include "proto/kvt/v1/service.grpc.pb.h"
#include "server/auth.h"
#include "server/config.h"

namespace kvt {

class MapperControlService {
 public:
  // `store` and `auth` (optional: null allows every call) must outlive the service.
  MapperControlService(const KvtdConfig& config, MapperStore* store, const Authenticator* auth)
      : config_(config), store_(store), auth_(auth) {}

  grpc::Status ListMappers(grpc::ServerContext* context, const v1::ListMappersRequest* request,
                           v1::ListMappersResponse* response);
  grpc::Status GetMapper(grpc::ServerContext* context, const v1::GetMapperRequest* request,
                         v1::MapperInfo* response);
  grpc::Status LoadMapper(grpc::ServerContext* context, const v1::LoadMapperRequest* request,
                          v1::LoadMapperResponse* response);
  grpc::Status UnloadMapper(grpc::ServerContext* context, const v1::UnloadMapperRequest* request,
                            v1::UnloadMapperResponse* response);

 private:
  grpc::Status Authorize(const grpc::ServerContext* context, Role role) const;

  const KvtdConfig config_;
  MapperStore* const store_;
  const Authenticator* const auth_;
};

// MapperInfo as the proto reports it (also the body of GetMapper).
void FillMapperInfo(const MapperInfo& info, v1::MapperInfo* out);

}  // namespace kvt
