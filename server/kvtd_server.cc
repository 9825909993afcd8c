#include "server/kvtd_server.h"

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/allocator.h"
#include "common/logging.h"
#include "server/mapper_store_setup.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace kvt {

namespace {
constexpr char kServiceName[] = "kvt.v1.KvTranslator";
constexpr char kPrefixServiceName[] = "kvt.v1.KvPrefixCache";

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* key) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(key, ": cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": '", path, "' is not a PEM file"));
  }
  return text.str();
}

// Plaintext, TLS, or mTLS (client certificates required and verified against the CA).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const KvtdConfig::Security& security) {
  if (security.tls_cert_file.empty()) return grpc::InsecureServerCredentials();
  absl::StatusOr<std::string> cert = ReadPem(security.tls_cert_file, "security.tls_cert_file");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(security.tls_key_file, "security.tls_key_file");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!security.tls_client_ca_file.empty()) {
    absl::StatusOr<std::string> ca =
        ReadPem(security.tls_client_ca_file, "security.tls_client_ca_file");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvtdServer>> KvtdServer::Start(const KvtdConfig& config,
                                                              MapperStore* store,
                                                              Backend* backend) {
  std::unique_ptr<KvtdServer> server(new KvtdServer(config));
  server->metrics_ = std::make_unique<Metrics>(backend->device());
  if (absl::Status status = server->metrics_->StartExposer(config.metrics.listen_address);
      !status.ok()) {
    return status;
  }
  server->metrics_->SetBackend(backend->name(), backend->device(), config.backend.type);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentials(config.security);
  if (!credentials.ok()) return credentials.status();
  if (config.security.auth_token_file.empty()) {
    server->auth_ = Authenticator::AllowAll();
  } else {
    absl::StatusOr<std::unique_ptr<Authenticator>> auth =
        Authenticator::FromFile(config.security.auth_token_file);
    if (!auth.ok()) return auth.status();
    server->auth_ = std::move(*auth);
  }
  if (config.prefix_cache.enabled) {
    PrefixCacheOptions options;
    options.max_bytes = config.prefix_cache.max_bytes;
    options.ttl = absl::Seconds(config.prefix_cache.ttl_seconds);
    options.block_tokens = static_cast<int>(config.prefix_cache.block_tokens);
    options.lease_duration = absl::Seconds(config.prefix_cache.lease_seconds);
    if (config.prefix_cache.digest_slots > 0) {
      PrefixDigestOptions digest;
      digest.slots = config.prefix_cache.digest_slots;
      digest.block_tokens = options.block_tokens;
      // Under auth the digest is kvtd's user's alone: who may ask LookupPrefix is a question
      // of tokens, and a world-readable digest would answer part of it without one.
      digest.mode = config.security.auth_token_file.empty() ? 0644 : 0600;
      absl::StatusOr<std::unique_ptr<PrefixDigest>> made = PrefixDigest::Create(digest);
      if (made.ok()) {
        server->prefix_digest_ = std::move(*made);
        options.digest = server->prefix_digest_.get();
      } else {
        // Only an optimisation: engines then ask LookupPrefix for every request, as without it.
        KVT_LOG(kWarning, "prefix digest unavailable; every lookup goes to LookupPrefix")
            .With("error", made.status().ToString());
      }
    }
    Metrics* metrics = server->metrics_.get();
    options.on_evict = [metrics](absl::string_view, absl::string_view reason, int64_t bytes) {
      metrics->RecordPrefixEviction(std::string(reason), bytes);
    };
    absl::StatusOr<std::unique_ptr<PrefixCache>> cache = PrefixCache::Create(std::move(options));
    if (!cache.ok()) return cache.status();
    server->prefix_cache_ = std::move(*cache);
  }
  server->service_ = std::make_unique<TranslatorService>(
      config, store, backend, server->metrics_.get(), server->auth_.get(),
      server->prefix_cache_.get());
  server->prefix_service_ = std::make_unique<PrefixCacheService>(
      config, store, server->prefix_cache_.get(), server->service_->system_memory(),
      server->service_->shift_stats(), server->metrics_.get(), server->auth_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC enables SO_REUSEPORT by default, which would let a second kvtd bind a port in use.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Read buffers stay below the allocator's mmap threshold, so they are reused warm.
  builder.AddChannelArgument(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE,
                             static_cast<int>(kGrpcMaxReadChunkBytes));
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.server.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.server.max_message_bytes));
  grpc::ResourceQuota quota("kvtd");
  quota.SetMaxThreads(static_cast<int>(config.server.max_sync_threads));
  builder.SetResourceQuota(quota);
  if (!config.server.listen_address.empty()) {
    builder.AddListeningPort(config.server.listen_address, *credentials, &server->port_);
  }
  if (!config.server.unix_socket.empty()) {
    builder.AddListeningPort(absl::StrCat("unix:", config.server.unix_socket), *credentials);
  }
  builder.RegisterService(server->service_.get());
  builder.RegisterService(server->prefix_service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr ||
      (!config.server.listen_address.empty() && server->port_ == 0)) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on server.listen_address='", config.server.listen_address, "'",
        config.server.unix_socket.empty()
            ? ""
            : absl::StrCat(" / server.unix_socket='", config.server.unix_socket, "'"),
        ": the port is in use or the address is invalid"));
  }
  grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService();
  health->SetServingStatus(kServiceName, true);
  health->SetServingStatus(kPrefixServiceName, config.prefix_cache.enabled);
  health->SetServingStatus(true);
  KVT_LOG(kInfo, "listening")
      .With("address", config.server.listen_address)
      .With("port", server->port_)
      .With("unix_socket", config.server.unix_socket)
      .With("backend", backend->name())
      .With("device", backend->device())
      .With("tls", config.security.tls_cert_file.empty()
                       ? "off"
                       : (config.security.tls_client_ca_file.empty() ? "tls" : "mtls"))
      .With("auth", server->auth_->enabled() ? "bearer" : "off")
      .With("prefix_cache", config.prefix_cache.enabled
                                ? absl::StrCat(config.prefix_cache.max_bytes, " bytes")
                                : std::string("off"))
      .With("prefix_digest", server->prefix_digest_ != nullptr
                                 ? absl::StrCat("/dev/shm", server->prefix_digest_->shm_name(),
                                                "; stale removed: ",
                                                server->prefix_digest_->stale_removed())
                                 : std::string("off"));
  TranslatorService* service = server->service_.get();
  server->metrics_->SetScrapeSources(store, [service] { return service->inflight_requests(); });
  server->store_ = store;
  store->SetEvents(MetricsEvents(server->metrics_.get()));
  if (!config.metrics.listen_address.empty()) {
    KVT_LOG(kInfo, "metrics listening")
        .With("address", config.metrics.listen_address)
        .With("port", server->metrics_->port())
        .With("path", "/metrics");
  }
  return server;
}

KvtdServer::~KvtdServer() {
  Shutdown();
  // Scrapes may still arrive until the metrics endpoint goes; they must not reach the service.
  if (metrics_ != nullptr) metrics_->SetScrapeSources(nullptr, nullptr);
  // The store outlives the server: it must stop reporting into these metrics.
  if (store_ != nullptr) store_->SetEvents({});
}

void KvtdServer::Shutdown() {
  // Start() failed to bind (port in use): nothing was served, so there is nothing to drain.
  if (server_ == nullptr) return;
  {
    MutexLock lock(&shutdown_mutex_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  KVT_LOG(kInfo, "draining")
      .With("inflight", service_->inflight_requests())
      .With("grace_s", config_.shutdown.drain_grace_seconds)
      .With("deadline_s", config_.shutdown.deadline_seconds);
  service_->StartDraining();
  server_->GetHealthCheckService()->SetServingStatus(false);
  absl::SleepFor(absl::Seconds(config_.shutdown.drain_grace_seconds));
  const auto deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(config_.shutdown.deadline_seconds * 1000));
  // grpc::Server::Shutdown also waits for idle client connections to go away, which an idle
  // C++ client only notices on its next connectivity check (seconds). Once no translation has
  // been in flight for a quiet period (long enough for the last one's final status to leave),
  // cut the remaining connections instead of waiting for the deadline.
  std::thread stopper([this, deadline] { server_->Shutdown(deadline); });
  const absl::Duration quiet_period = absl::Milliseconds(300);
  absl::Time quiet_since = absl::InfiniteFuture();
  while (std::chrono::system_clock::now() < deadline) {
    if (service_->inflight_requests() > 0) {
      quiet_since = absl::InfiniteFuture();
    } else if (quiet_since == absl::InfiniteFuture()) {
      quiet_since = absl::Now();
    } else if (absl::Now() - quiet_since >= quiet_period) {
      grpc_server_cancel_all_calls(server_->c_server());
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  stopper.join();
  server_->Wait();
  KVT_LOG(kInfo, "stopped");
}

}  // namespace kvt
