// kvt::Client: the C++ client library of kvt.v1 for routers, the CLI and the load tester.
// Splits a host-memory cache into stream chunks, reassembles the translated cache, and turns
// every gRPC failure into an absl::Status carrying the server's message.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/impl/rpc_method.h"
#include "host_cache/host_cache.h"
#include "kernels/backend.h"
#include "kernels/types.h"
#include "proto/kvt/v1/prefix_cache.grpc.pb.h"
#include "proto/kvt/v1/service.grpc.pb.h"

namespace kvt {

struct ClientOptions {
  // Per-call deadline (0 = none).
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Largest message either way; must match the server's server.max_message_bytes or less.
  int max_message_bytes = 64 << 20;
  // Bytes of KV per request chunk.
  int64_t chunk_bytes = 4 << 20;

  // TLS: set root_ca_pem (the CA that signed kvtd's certificate) to connect over TLS; add a
  // client certificate and key (PEM) for mTLS. Empty: plaintext.
  std::string tls_root_ca_pem;
  std::string tls_client_cert_pem;
  std::string tls_client_key_pem;
  // Sent as "authorization: Bearer <token>" on every call when set.
  std::string bearer_token;
};

struct TranslateResult {
  v1::TranslateResponseHeader header;
  v1::TranslateTrailer trailer;
  HostCache target;
  // Measured by the client from the start of the call: until the first target layer (K and V)
  // was complete here, and until the last byte of the result arrived.
  double first_layer_ms = 0;
  double last_byte_ms = 0;
};

struct TranslateStreamOptions {
  // Called on the stream's reading thread as soon as target layer `layer` (K and V) is complete
  // in `target` (that layer's buffers may be read; others may still be filling). Optional.
  std::function<void(int layer, const HostCache& target)> on_target_layer;
  // Buffers to write the target into, typically the previous result's target moved in: kept
  // where they already have the size. Fresh memory costs a page fault per 4 KiB on first touch
  // (on a VM slower than the transfer itself), so a caller translating repeatedly recycles.
  HostCache recycled_target;
};

// One TranslateKV call fed layer by layer while the source model produces them (prefill runs
// layer after layer). Responses are read on a background thread from the start, so a server
// that pipelines returns target layers while later source layers are still being pushed.
// Create with Client::StartTranslate; not thread-safe (one producer).
class TranslateStream {
 public:
  ~TranslateStream();  // cancels the call unless Finish() completed it
  TranslateStream(const TranslateStream&) = delete;
  TranslateStream& operator=(const TranslateStream&) = delete;

  // Sends source layer `layer`: `k` and `v` each hold the layer in the stream's layout and
  // dtype (source.layer_bytes() bytes). They are sent without copying, so they must stay valid
  // and unchanged until Finish() returns or the stream is destroyed. Each layer once; in order 0, 1, ... lets the server
  // start soonest. INVALID_ARGUMENT for a bad layer index or a repeated layer; a server that
  // has ended the stream is reported by Finish(), not here.
  absl::Status PushLayer(int layer, const void* k, const void* v);

  // Half-closes (every layer must have been pushed, else the server reports the gap), waits
  // for the whole result and the call's status.
  absl::StatusOr<TranslateResult> Finish();

 private:
  friend class Client;
  struct State;
  explicit TranslateStream(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class Client {
 public:
  // `target`: "host:port" or "unix:/path". Connects lazily.
  static std::unique_ptr<Client> Create(const std::string& target,
                                        const ClientOptions& options = ClientOptions());

  // grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... for `service` ("" = the server).
  absl::StatusOr<std::string> Health(const std::string& service = "");

  // kvtd's release and protocol extensions. UNIMPLEMENTED: a kvtd older than the RPC, which
  // has none of the extensions a newer client tests for (HasExtension).
  absl::StatusOr<v1::ServerMetadataResponse> ServerMetadata();
  // Whether kvtd lists `extension` in ServerMetadata; false for a kvtd older than the RPC.
  absl::StatusOr<bool> HasExtension(const std::string& extension);

  absl::StatusOr<v1::ListMappersResponse> ListMappers();
  absl::StatusOr<v1::MapperInfo> GetMapper(const std::string& mapper_id);
  // KvPrefixCache.RestoreMapper (admin role): puts a mapper that live verification took out of
  // service back (docs/OPERATIONS.md, "Live verification").
  absl::StatusOr<v1::RestoreMapperResponse> RestoreMapper(const std::string& mapper_id);

  // Sends `source` (its dtype, layout and token count override the header's) and returns the
  // target cache in the header's output dtype/layout. The header names the pair or mapper.
  absl::StatusOr<TranslateResult> Translate(
      v1::TranslateHeader header, const HostCache& source,
      TranslateStreamOptions stream_options = TranslateStreamOptions());

  // Starts a TranslateKV call whose source layers the caller pushes as they are produced. Only
  // the shape fields of `source_shape` are read (dtype, layout, layers, heads, head_dim,
  // tokens; they override the header's); its buffers may be empty.
  absl::StatusOr<std::unique_ptr<TranslateStream>> StartTranslate(
      v1::TranslateHeader header, const HostCache& source_shape,
      TranslateStreamOptions stream_options = TranslateStreamOptions());

  // ValidateKV: `source` and the target's own cache for the same tokens (and optionally the
  // target's post-RoPE queries: a HostCache whose num_kv_heads is the query head count, K only)
  // in; SPEC 5 quality per layer and overall out. The three must share dtype, layout and token
  // count, which (with num_query_heads) override the header's.
  absl::StatusOr<v1::ValidateKVResponse> Validate(v1::ValidateHeader header,
                                                  const HostCache& source,
                                                  const HostCache& target_true,
                                                  const HostCache* queries = nullptr);

  // Shared-memory transport (the server must allow client regions; admin role with auth).
  absl::Status RegisterSystemMemory(const std::string& name, const std::string& key,
                                    uint64_t offset, uint64_t byte_size);
  absl::Status UnregisterSystemMemory(const std::string& name);
  // CUDA IPC regions: `raw_handle` is the 64-byte cudaIpcMemHandle_t of a device allocation
  // this process exported (cuda::ExportIpcHandle); kvtd opens it on `device_id` (its own
  // numbering) and checks `byte_size`, counted from the allocation base, against the real
  // allocation. RegionRef offsets into it count from that base too (IpcExport::offset). Same switch and role as
  // system memory; FAILED_PRECONDITION / UNAVAILABLE when kvtd has no CUDA.
  absl::Status RegisterCudaMemory(const std::string& name, const std::string& raw_handle,
                                  int device_id, uint64_t byte_size);
  absl::Status UnregisterCudaMemory(const std::string& name);
  absl::StatusOr<v1::CudaMemoryStatusResponse> CudaMemoryStatus(const std::string& name = "");
  // A translation whose input and/or output live in registered regions (header.input.region /
  // header.output.region set by the caller); inline sides are not supported here. The result's
  // target cache is empty: the bytes are in the output region.
  absl::StatusOr<TranslateResult> TranslateRegions(const v1::TranslateHeader& header);

  // A translation of a stored prefix (header.input.cached: the lease of a
  // KvPrefixCache.LookupPrefix) with inline output, reassembled into the result's target.
  absl::StatusOr<TranslateResult> TranslateCached(const v1::TranslateHeader& header);

  v1::KvTranslator::Stub* stub() { return stub_.get(); }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }

 private:
  Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options);
  absl::StatusOr<TranslateResult> HeaderOnlyTranslate(
      const v1::TranslateHeader& header,
      const std::function<bool(const v1::TranslateKVResponse&, TranslateResult*)>& on_response);
  // Deadline and credentials of one call.
  void Prepare(grpc::ClientContext* context) const;

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvTranslator::Stub> stub_;
  // TranslateKV with transport/chunk_wire.h's messages (zero-copy chunk data).
  const grpc::internal::RpcMethod translate_method_;
};

}  // namespace kvt
