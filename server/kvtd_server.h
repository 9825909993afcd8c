// The kvtd gRPC server: listeners (TCP, optional unix socket), message limits, health
// (grpc.health.v1 Check and Watch), server reflection, and the drain-then-stop shutdown.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "grpcpp/server.h"
#include "kernels/backend.h"
#include "mapper_store/store.h"
#include "prefix_cache/prefix_cache.h"
#include "server/auth.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/prefix_cache_service.h"
#include "server/translator_service.h"

namespace kvt {

class KvtdServer {
 public:
  // Binds and starts serving. A port in use or a bad address is an error saying which.
  static absl::StatusOr<std::unique_ptr<KvtdServer>> Start(const KvtdConfig& config,
                                                           MapperStore* store, Backend* backend);
  ~KvtdServer();

  // The bound TCP port (the OS's choice when the config asked for port 0); 0 without TCP.
  int port() const { return port_; }
  TranslatorService* service() { return service_.get(); }
  // Null unless prefix_cache.enabled.
  PrefixCache* prefix_cache() { return prefix_cache_.get(); }
  PrefixCacheService* prefix_service() { return prefix_service_.get(); }
  Metrics* metrics() { return metrics_.get(); }
  // The bound port of the Prometheus endpoint (metrics.listen_address); 0 when it is off.
  int metrics_port() const { return metrics_->port(); }

  // Graceful stop: health NOT_SERVING and new translations refused at once; after
  // shutdown.drain_grace_seconds the listeners close; in-flight requests get
  // shutdown.deadline_seconds more, then are cancelled. Returns when the server has stopped.
  void Shutdown();

 private:
  KvtdServer(const KvtdConfig& config) : config_(config) {}

  const KvtdConfig config_;
  MapperStore* store_ = nullptr;  // reports into metrics_ while the server lives
  // Declared before the service, which records into it, so it is destroyed after it.
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Authenticator> auth_;
  // Declared before the cache, which writes it, and both services, which read them.
  std::unique_ptr<PrefixDigest> prefix_digest_;
  std::unique_ptr<PrefixCache> prefix_cache_;
  std::unique_ptr<TranslatorService> service_;
  std::unique_ptr<PrefixCacheService> prefix_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  Mutex shutdown_mutex_;  // kvt::Mutex: TSan sees it, unlike Debian's absl::Mutex
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mutex_) = false;
};

}  // namespace kvt
