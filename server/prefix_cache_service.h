// The kvt.v1.KvPrefixCache gRPC service: engines publish their caches into the prefix cache,
// LookupPrefix picks the longest stored prefix of another model with a served mapper into the
// target, applies the quality gate and leases it for one TranslateKV (header.input.cached).
#pragma once

#include <memory>
#include <string>

#include "mapper_store/store.h"
#include "prefix_cache/prefix_cache.h"
#include "proto/kvt/v1/prefix_cache.grpc.pb.h"
#include "quality/input_shift_cache.h"
#include "server/auth.h"
#include "server/config.h"
#include "server/live_verifier.h"
#include "server/metrics.h"
#include "transport/shm_registry.h"

namespace kvt {

class PrefixCacheService final : public v1::KvPrefixCache::Service {
 public:
  // Everything passed must outlive the service. `cache` null: prefix_cache.enabled is false and
  // every call answers FAILED_PRECONDITION (a lookup answers a miss "disabled"). `metrics`
  // and `auth` may be null (record nothing / allow every call). `system_memory` holds the
  // regions a Publish may read from (shared with KvTranslator's registration RPCs).
  PrefixCacheService(const KvtdConfig& config, MapperStore* store, PrefixCache* cache,
                     SystemMemoryRegistry* system_memory, InputShiftCache* shift_stats,
                     Metrics* metrics = nullptr, const Authenticator* auth = nullptr);

  grpc::Status Publish(grpc::ServerContext* context,
                       grpc::ServerReader<v1::PublishRequest>* reader,
                       v1::PublishResponse* response) override;
  grpc::Status LookupPrefix(grpc::ServerContext* context,
                            const v1::LookupPrefixRequest* request,
                            v1::LookupPrefixResponse* response) override;
  grpc::Status ListPrefixes(grpc::ServerContext* context, const v1::ListPrefixesRequest* request,
                            v1::ListPrefixesResponse* response) override;
  grpc::Status EvictPrefixes(grpc::ServerContext* context,
                             const v1::EvictPrefixesRequest* request,
                             v1::EvictPrefixesResponse* response) override;
  grpc::Status ListVerifications(grpc::ServerContext* context,
                                 const v1::ListVerificationsRequest* request,
                                 v1::ListVerificationsResponse* response) override;
  grpc::Status RestoreMapper(grpc::ServerContext* context,
                             const v1::RestoreMapperRequest* request,
                             v1::RestoreMapperResponse* response) override;

  // Live verification (null when prefix_cache.verify_sample_fraction is 0 or the cache is off).
  LiveVerifier* verifier() { return verifier_.get(); }

 private:
  absl::Status PublishImpl(grpc::ServerReader<v1::PublishRequest>* reader,
                           v1::PublishResponse* response, std::string* model_label);
  absl::Status LookupImpl(const v1::LookupPrefixRequest& request,
                          v1::LookupPrefixResponse* response);
  // The quality gate's verdict on leasing `match` for translation through `mapper`.
  // `version`: the mapper as live verification keys it (out of service refuses it).
  v1::GateVerdict Gate(const std::shared_ptr<const LoadedMapper>& mapper,
                       const PrefixMatch& match, const VerifiedMapper& version);
  // Live verification's measurement of one sample (runs on the verifier's worker).
  absl::StatusOr<double> MeasureSample(const PendingSample& sample, const PrefixEntry& own);
  grpc::Status Authorize(const grpc::ServerContext* context, Role role) const;
  void UpdateUsage();

  const KvtdConfig config_;
  MapperStore* const store_;
  PrefixCache* const cache_;
  SystemMemoryRegistry* const system_memory_;
  InputShiftCache* const shift_stats_;
  Metrics* const metrics_;
  const Authenticator* const auth_;
  std::unique_ptr<LiveVerifier> verifier_;  // last: its worker calls MeasureSample
};

}  // namespace kvt
