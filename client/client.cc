#include "client/client.h"

#include <algorithm>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/allocator.h"
#include "common/grpc_status.h"
#include "common/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/sync_stream.h"
#include "transport/chunk_wire.h"
#include "transport/kv_chunks.h"
#include "transport/proto_convert.h"

namespace kvt {
namespace {

// Splits every layer of `cache` (K, then V unless `keys_only`) into chunks of about
// `chunk_bytes`, filling `*chunk` and calling `send` for each until it returns false (the
// server ended the stream). INVALID_ARGUMENT when a buffer does not match the cache's shape.
absl::Status SendChunks(const HostCache& cache, bool keys_only, int64_t chunk_bytes,
                        v1::KVChunk* chunk, const std::function<bool()>& send) {
  const LayerGeometry geometry{cache.layout, cache.num_kv_heads, cache.num_tokens,
                               cache.head_dim, static_cast<int64_t>(DTypeSize(cache.dtype))};
  const int64_t tokens_per_chunk = TokensPerChunk(geometry, chunk_bytes);
  for (int layer = 0; layer < cache.num_layers; ++layer) {
    for (int kind = 0; kind < (keys_only ? 1 : 2); ++kind) {
      const std::vector<char>& buffer = (kind == 0 ? cache.k : cache.v)[layer];
      if (static_cast<int64_t>(buffer.size()) != geometry.layer_bytes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cache layer ", layer, kind == 0 ? " K" : " V", " has ", buffer.size(),
            " bytes, expected ", geometry.layer_bytes()));
      }
      for (int64_t first = 0; first < cache.num_tokens; first += tokens_per_chunk) {
        const int64_t count = std::min(tokens_per_chunk, cache.num_tokens - first);
        chunk->set_layer(layer);
        chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
        chunk->set_token_start(static_cast<uint32_t>(first));
        chunk->set_token_count(static_cast<uint32_t>(count));
        std::string* data = chunk->mutable_data();
        data->resize(static_cast<size_t>(geometry.chunk_bytes(count)));
        GatherChunk(geometry, first, count, buffer.data(), data->data());
        if (!send()) return absl::OkStatus();
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<Client> Client::Create(const std::string& target, const ClientOptions& options) {
  grpc::ChannelArguments arguments;
  // Read buffers stay below kvtd's mmap threshold (common/allocator.h), reused warm when the
  // host process tunes its allocator the same way.
  arguments.SetInt(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, static_cast<int>(kGrpcMaxReadChunkBytes));
  arguments.SetMaxReceiveMessageSize(options.max_message_bytes);
  arguments.SetMaxSendMessageSize(options.max_message_bytes);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.tls_root_ca_pem.empty()) {
    grpc::SslCredentialsOptions tls;
    tls.pem_root_certs = options.tls_root_ca_pem;
    tls.pem_cert_chain = options.tls_client_cert_pem;
    tls.pem_private_key = options.tls_client_key_pem;
    credentials = grpc::SslCredentials(tls);
  }
  auto channel = grpc::CreateCustomChannel(target, credentials, arguments);
  return std::unique_ptr<Client>(new Client(std::move(channel), options));
}

Client::Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : options_(options),
      channel_(std::move(channel)),
      stub_(v1::KvTranslator::NewStub(channel_)),
      translate_method_("/kvt.v1.KvTranslator/TranslateKV",
                        grpc::internal::RpcMethod::BIDI_STREAMING, channel_) {}

void Client::Prepare(grpc::ClientContext* context) const {
  if (options_.timeout.count() > 0) {
    context->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  }
  if (!options_.bearer_token.empty()) {
    context->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
}

absl::StatusOr<std::string> Client::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  Prepare(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = health->Check(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
}

absl::StatusOr<v1::ServerMetadataResponse> Client::ServerMetadata() {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ServerMetadataResponse response;
  grpc::Status status = stub_->ServerMetadata(&context, v1::ServerMetadataRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<bool> Client::HasExtension(const std::string& extension) {
  absl::StatusOr<v1::ServerMetadataResponse> metadata = ServerMetadata();
  if (absl::IsUnimplemented(metadata.status())) return false;
  if (!metadata.ok()) return metadata.status();
  return std::find(metadata->extensions().begin(), metadata->extensions().end(), extension) !=
         metadata->extensions().end();
}

absl::StatusOr<v1::ListMappersResponse> Client::ListMappers() {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ListMappersResponse response;
  grpc::Status status = stub_->ListMappers(&context, v1::ListMappersRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::MapperInfo> Client::GetMapper(const std::string& mapper_id) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::GetMapperRequest request;
  request.set_mapper_id(mapper_id);
  v1::MapperInfo response;
  grpc::Status status = stub_->GetMapper(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::StatusOr<v1::RestoreMapperResponse> Client::RestoreMapper(const std::string& mapper_id) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::RestoreMapperRequest request;
  request.set_mapper_id(mapper_id);
  v1::RestoreMapperResponse response;
  grpc::Status status =
      v1::KvPrefixCache::NewStub(channel_)->RestoreMapper(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

// Signals when gRPC has dropped the last slice pointing into the caller's source buffers.
struct SendRelease {
  Mutex mutex;
  CondVar changed;
  bool released ABSL_GUARDED_BY(mutex) = false;
  void Wait() ABSL_LOCKS_EXCLUDED(mutex) {
    MutexLock lock(&mutex);
    while (!released) changed.Wait(&mutex);
  }
};

struct TranslateStream::State {
  // Owned separately so that ReleaseSource can destroy it: the context owns the grpc_call, and
  // gRPC keeps the slices of a write the server never took until that call is destroyed.
  std::unique_ptr<grpc::ClientContext> context = std::make_unique<grpc::ClientContext>();
  std::unique_ptr<grpc::ClientReaderWriter<TranslateRequestMessage, TranslateResponseMessage>>
      stream;
  // Held by every slice of the caller's source memory that gRPC may still read; when the last
  // reference goes, `release` is signalled. Chunks are sent without copying them.
  std::shared_ptr<SendRelease> release = std::make_shared<SendRelease>();
  std::shared_ptr<const void> source_lease;
  TranslateStreamOptions options;
  HostCache shape;  // source shape, no buffers
  LayerGeometry source_geometry;
  int64_t tokens_per_chunk = 0;
  std::vector<bool> pushed;
  bool sending = true;   // false once a Write failed: the server ended the stream
  bool finished = false;
  TranslateRequestMessage request;
  std::chrono::steady_clock::time_point start;

  // Written by the reading thread, read by Finish() after joining it.
  std::thread reader;
  TranslateResult result;
  bool have_header = false, have_trailer = false;
  std::unique_ptr<CoverageTracker> coverage;
  absl::Status protocol_error;

  double MsSinceStart() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
  }
  void Read();
  // Ends the call (the stream must be finished or cancelled) and waits until gRPC no longer
  // reads the caller's source buffers.
  void ReleaseSource() {
    stream.reset();
    context.reset();
    source_lease.reset();
    release->Wait();
  }
};

void TranslateStream::State::Read() {
  TranslateResponseMessage message;
  const v1::TranslateKVResponse& response = message.proto;
  LayerGeometry target_geometry;
  while (stream->Read(&message)) {
    if (!protocol_error.ok()) continue;  // drain, then report
    if (!message.error.ok()) {
      protocol_error = absl::InternalError(
          absl::StrCat("server sent a malformed message: ", message.error.message()));
      continue;
    }
    if (response.has_header()) {
      result.header = response.header();
      HostCache& target = result.target;
      target = std::move(options.recycled_target);
      absl::StatusOr<DType> dtype = DTypeFromProto(result.header.output_dtype(), "output_dtype");
      absl::StatusOr<Layout> layout =
          LayoutFromProto(result.header.output_layout(), "output_layout");
      if (!dtype.ok() || !layout.ok()) {
        protocol_error = absl::InternalError("server sent a response header without dtype/layout");
        continue;
      }
      target.dtype = *dtype;
      target.layout = *layout;
      target.num_layers = static_cast<int>(result.header.target_shape().num_layers());
      target.num_kv_heads = static_cast<int>(result.header.target_shape().num_kv_heads());
      target.head_dim = static_cast<int>(result.header.target_shape().head_dim());
      target.num_tokens = result.header.num_tokens();
      target.Resize();
      target_geometry = LayerGeometry{target.layout, target.num_kv_heads, target.num_tokens,
                                      target.head_dim,
                                      static_cast<int64_t>(DTypeSize(target.dtype))};
      coverage = std::make_unique<CoverageTracker>(target.num_layers, target.num_tokens);
      have_header = true;
    } else if (response.has_chunk()) {
      const v1::KVChunk& chunk = response.chunk();
      const int64_t end = static_cast<int64_t>(chunk.token_start()) + chunk.token_count();
      if (!have_header || chunk.layer() >= static_cast<uint32_t>(result.target.num_layers) ||
          end > result.target.num_tokens || chunk.token_count() == 0 ||
          static_cast<int64_t>(message.data.size()) !=
              target_geometry.chunk_bytes(chunk.token_count())) {
        protocol_error = absl::InternalError(
            absl::StrCat("server sent a malformed target chunk (layer ", chunk.layer(), ")"));
        continue;
      }
      const int kind = chunk.kind() == v1::CACHE_KIND_K ? 0 : 1;
      if (absl::Status added =
              coverage->Add(chunk.layer(), kind, chunk.token_start(), chunk.token_count());
          !added.ok()) {
        protocol_error = absl::InternalError(absl::StrCat("server: ", added.message()));
        continue;
      }
      ScatterChunkBytes(target_geometry, chunk.token_start(), chunk.token_count(), message.data,
                        (kind == 0 ? result.target.k : result.target.v)[chunk.layer()].data());
      if (coverage->LayerComplete(chunk.layer())) {
        if (result.first_layer_ms == 0) result.first_layer_ms = MsSinceStart();
        result.last_byte_ms = MsSinceStart();
        if (options.on_target_layer) {
          options.on_target_layer(static_cast<int>(chunk.layer()), result.target);
        }
      }
    } else if (response.has_trailer()) {
      result.trailer = response.trailer();
      have_trailer = true;
    }
  }
}

TranslateStream::TranslateStream(std::unique_ptr<State> state) : state_(std::move(state)) {}

TranslateStream::~TranslateStream() {
  if (state_ == nullptr || state_->finished) return;
  state_->context->TryCancel();
  if (state_->reader.joinable()) state_->reader.join();
  state_->stream->Finish().ok();
  state_->ReleaseSource();
}

absl::Status TranslateStream::PushLayer(int layer, const void* k, const void* v) {
  State& s = *state_;
  if (s.finished) return absl::FailedPreconditionError("PushLayer after Finish");
  if (layer < 0 || layer >= s.shape.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("PushLayer: layer ", layer,
                                                   " outside the source's ", s.shape.num_layers,
                                                   " layers"));
  }
  if (s.pushed[layer]) {
    return absl::InvalidArgumentError(absl::StrCat("PushLayer: layer ", layer, " pushed twice"));
  }
  s.pushed[layer] = true;
  v1::KVChunk* chunk = s.request.proto.mutable_chunk();
  for (int kind = 0; kind < 2 && s.sending; ++kind) {
    const void* buffer = kind == 0 ? k : v;
    for (int64_t first = 0; first < s.shape.num_tokens && s.sending;
         first += s.tokens_per_chunk) {
      const int64_t count = std::min(s.tokens_per_chunk, s.shape.num_tokens - first);
      chunk->set_layer(layer);
      chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
      chunk->set_token_start(static_cast<uint32_t>(first));
      chunk->set_token_count(static_cast<uint32_t>(count));
      s.request.data = ChunkBytesOfLayer(s.source_geometry, first, count,
                                         static_cast<const char*>(buffer), s.source_lease);
      // A failed write means the server already ended the stream; Finish() says why.
      s.sending = s.stream->Write(s.request);
    }
  }
  s.request.data = ChunkBytes();
  return absl::OkStatus();
}

absl::StatusOr<TranslateResult> TranslateStream::Finish() {
  State& s = *state_;
  if (s.finished) return absl::FailedPreconditionError("Finish called twice");
  s.finished = true;
  s.stream->WritesDone();
  s.reader.join();
  grpc::Status status = s.stream->Finish();
  s.ReleaseSource();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!s.protocol_error.ok()) return s.protocol_error;
  if (!s.have_header || !s.have_trailer || !s.coverage->Complete()) {
    return absl::InternalError(absl::StrCat(
        "server ended the stream without a complete result",
        s.coverage ? absl::StrCat(": ", s.coverage->FirstGap()) : std::string()));
  }
  s.result.last_byte_ms = s.MsSinceStart();
  return std::move(s.result);
}

absl::StatusOr<std::unique_ptr<TranslateStream>> Client::StartTranslate(
    v1::TranslateHeader header, const HostCache& source_shape,
    TranslateStreamOptions stream_options) {
  auto state = std::make_unique<TranslateStream::State>();
  state->start = std::chrono::steady_clock::now();
  state->options = std::move(stream_options);
  state->shape.dtype = source_shape.dtype;
  state->shape.layout = source_shape.layout;
  state->shape.num_layers = source_shape.num_layers;
  state->shape.num_kv_heads = source_shape.num_kv_heads;
  state->shape.head_dim = source_shape.head_dim;
  state->shape.num_tokens = source_shape.num_tokens;
  if (state->shape.num_layers <= 0 || state->shape.num_kv_heads <= 0 ||
      state->shape.head_dim <= 0 || state->shape.num_tokens <= 0) {
    return absl::InvalidArgumentError(
        "source shape: num_layers, num_kv_heads, head_dim and num_tokens must be > 0");
  }
  state->source_geometry =
      LayerGeometry{state->shape.layout, state->shape.num_kv_heads, state->shape.num_tokens,
                    state->shape.head_dim, static_cast<int64_t>(DTypeSize(state->shape.dtype))};
  state->tokens_per_chunk = TokensPerChunk(state->source_geometry, options_.chunk_bytes);
  state->pushed.assign(state->shape.num_layers, false);
  header.set_dtype(DTypeToProto(state->shape.dtype));
  header.set_layout(LayoutToProto(state->shape.layout));
  header.set_num_tokens(static_cast<uint32_t>(state->shape.num_tokens));

  std::shared_ptr<SendRelease> release = state->release;
  state->source_lease = std::shared_ptr<const void>(new char(0), [release](const void* token) {
    delete static_cast<const char*>(token);
    {
      MutexLock lock(&release->mutex);
      release->released = true;
    }
    release->changed.SignalAll();
  });

  Prepare(state->context.get());
  state->stream.reset(
      grpc::internal::ClientReaderWriterFactory<TranslateRequestMessage,
                                                TranslateResponseMessage>::
          Create(channel_.get(), translate_method_, state->context.get()));
  *state->request.proto.mutable_header() = header;
  state->sending = state->stream->Write(state->request);
  state->reader = std::thread([s = state.get()] { s->Read(); });
  return std::unique_ptr<TranslateStream>(new TranslateStream(std::move(state)));
}

absl::StatusOr<TranslateResult> Client::Translate(v1::TranslateHeader header,
                                                  const HostCache& source,
                                                  TranslateStreamOptions stream_options) {
  if (static_cast<int>(source.k.size()) != source.num_layers ||
      static_cast<int>(source.v.size()) != source.num_layers) {
    return absl::InvalidArgumentError("source cache: k/v buffers do not match num_layers");
  }
  for (int layer = 0; layer < source.num_layers; ++layer) {
    for (const std::vector<char>* buffer : {&source.k[layer], &source.v[layer]}) {
      if (static_cast<int64_t>(buffer->size()) != source.layer_bytes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cache layer ", layer, buffer == &source.k[layer] ? " K" : " V", " has ",
            buffer->size(), " bytes, expected ", source.layer_bytes()));
      }
    }
  }
  absl::StatusOr<std::unique_ptr<TranslateStream>> stream =
      StartTranslate(std::move(header), source, std::move(stream_options));
  if (!stream.ok()) return stream.status();
  for (int layer = 0; layer < source.num_layers; ++layer) {
    absl::Status pushed =
        (*stream)->PushLayer(layer, source.k[layer].data(), source.v[layer].data());
    if (!pushed.ok()) return pushed;
  }
  return (*stream)->Finish();
}

absl::StatusOr<v1::ValidateKVResponse> Client::Validate(v1::ValidateHeader header,
                                                       const HostCache& source,
                                                       const HostCache& target_true,
                                                       const HostCache* queries) {
  for (const HostCache* cache : {&source, &target_true}) {
    if (static_cast<int>(cache->k.size()) != cache->num_layers ||
        static_cast<int>(cache->v.size()) != cache->num_layers) {
      return absl::InvalidArgumentError("cache: k/v buffers do not match num_layers");
    }
  }
  if (target_true.dtype != source.dtype || target_true.layout != source.layout ||
      target_true.num_tokens != source.num_tokens ||
      (queries != nullptr &&
       (queries->dtype != source.dtype || queries->layout != source.layout ||
        queries->num_tokens != source.num_tokens))) {
    return absl::InvalidArgumentError(
        "source, target_true and queries must share dtype, layout and token count");
  }
  header.set_dtype(DTypeToProto(source.dtype));
  header.set_layout(LayoutToProto(source.layout));
  header.set_num_tokens(static_cast<uint32_t>(source.num_tokens));
  header.set_num_query_heads(queries != nullptr ? queries->num_kv_heads : 0);

  grpc::ClientContext context;
  Prepare(&context);
  v1::ValidateKVResponse response;
  auto writer = stub_->ValidateKV(&context, &response);
  v1::ValidateKVRequest request;
  *request.mutable_header() = header;
  bool sending = writer->Write(request);
  auto write = [&] { return sending = writer->Write(request); };
  const std::pair<v1::ValidateRole, const HostCache*> parts[] = {
      {v1::VALIDATE_ROLE_SOURCE, &source},
      {v1::VALIDATE_ROLE_TARGET_TRUE, &target_true},
      {v1::VALIDATE_ROLE_TARGET_QUERY, queries}};
  for (const auto& [role, cache] : parts) {
    if (!sending || cache == nullptr) continue;
    request.mutable_chunk()->set_role(role);
    absl::Status sent = SendChunks(*cache, role == v1::VALIDATE_ROLE_TARGET_QUERY,
                                   options_.chunk_bytes, request.mutable_chunk()->mutable_chunk(),
                                   write);
    if (!sent.ok()) return sent;
  }
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

absl::Status Client::RegisterSystemMemory(const std::string& name, const std::string& key,
                                          uint64_t offset, uint64_t byte_size) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::RegisterSystemMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  v1::RegisterSystemMemoryResponse response;
  return FromGrpcStatus(stub_->RegisterSystemMemory(&context, request, &response));
}

absl::Status Client::UnregisterSystemMemory(const std::string& name) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::UnregisterSystemMemoryRequest request;
  request.set_name(name);
  v1::UnregisterSystemMemoryResponse response;
  return FromGrpcStatus(stub_->UnregisterSystemMemory(&context, request, &response));
}

absl::Status Client::RegisterCudaMemory(const std::string& name, const std::string& raw_handle,
                                        int device_id, uint64_t byte_size) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::RegisterCudaMemoryRequest request;
  request.set_name(name);
  request.set_raw_handle(raw_handle);
  request.set_device_id(device_id);
  request.set_byte_size(byte_size);
  v1::RegisterCudaMemoryResponse response;
  return FromGrpcStatus(stub_->RegisterCudaMemory(&context, request, &response));
}

absl::Status Client::UnregisterCudaMemory(const std::string& name) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::UnregisterCudaMemoryRequest request;
  request.set_name(name);
  v1::UnregisterCudaMemoryResponse response;
  return FromGrpcStatus(stub_->UnregisterCudaMemory(&context, request, &response));
}

absl::StatusOr<v1::CudaMemoryStatusResponse> Client::CudaMemoryStatus(const std::string& name) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::CudaMemoryStatusRequest request;
  request.set_name(name);
  v1::CudaMemoryStatusResponse response;
  grpc::Status status = stub_->CudaMemoryStatus(&context, request, &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return response;
}

// A TranslateKV whose stream carries only the header (inputs in regions or the prefix cache):
// every response message goes to `on_response` (header and trailer are also kept in the result);
// it returns false to abandon the call with `error`.
absl::StatusOr<TranslateResult> Client::HeaderOnlyTranslate(
    const v1::TranslateHeader& header,
    const std::function<bool(const v1::TranslateKVResponse&, TranslateResult*)>& on_response) {
  grpc::ClientContext context;
  Prepare(&context);
  auto stream = stub_->TranslateKV(&context);
  v1::TranslateKVRequest request;
  *request.mutable_header() = header;
  stream->Write(request);
  stream->WritesDone();
  TranslateResult result;
  bool have_header = false, have_trailer = false;
  v1::TranslateKVResponse response;
  while (stream->Read(&response)) {
    if (response.has_header()) {
      result.header = response.header();
      have_header = true;
    } else if (response.has_trailer()) {
      result.trailer = response.trailer();
      have_trailer = true;
    }
    if (!on_response(response, &result)) {
      context.TryCancel();
      stream->Finish();
      return absl::InternalError("server sent a response outside the announced target shape");
    }
  }
  grpc::Status status = stream->Finish();
  if (!status.ok()) return FromGrpcStatus(status);
  if (!have_header || !have_trailer) {
    return absl::InternalError("server ended the stream without header and trailer");
  }
  return result;
}

absl::StatusOr<TranslateResult> Client::TranslateRegions(const v1::TranslateHeader& header) {
  if (!header.input().has_region() || !header.output().has_region()) {
    return absl::InvalidArgumentError(
        "TranslateRegions needs header.input.region and header.output.region");
  }
  return HeaderOnlyTranslate(header, [](const v1::TranslateKVResponse&, TranslateResult*) {
    return true;
  });
}

absl::StatusOr<TranslateResult> Client::TranslateCached(const v1::TranslateHeader& header) {
  if (!header.input().has_cached() || header.output().has_region()) {
    return absl::InvalidArgumentError(
        "TranslateCached needs header.input.cached and an inline output");
  }
  LayerGeometry geometry;
  return HeaderOnlyTranslate(header, [&geometry](const v1::TranslateKVResponse& response,
                                                 TranslateResult* result) {
    HostCache& target = result->target;
    if (response.has_header()) {
      absl::StatusOr<DType> dtype =
          DTypeFromProto(result->header.output_dtype(), "output_dtype");
      absl::StatusOr<Layout> layout =
          LayoutFromProto(result->header.output_layout(), "output_layout");
      if (!dtype.ok() || !layout.ok()) return false;
      target.dtype = *dtype;
      target.layout = *layout;
      target.num_layers = static_cast<int>(result->header.target_shape().num_layers());
      target.num_kv_heads = static_cast<int>(result->header.target_shape().num_kv_heads());
      target.head_dim = static_cast<int>(result->header.target_shape().head_dim());
      target.num_tokens = result->header.num_tokens();
      target.Allocate();
      geometry = LayerGeometry{target.layout, target.num_kv_heads, target.num_tokens,
                               target.head_dim, static_cast<int64_t>(DTypeSize(target.dtype))};
      return true;
    }
    if (!response.has_chunk()) return true;
    const v1::KVChunk& chunk = response.chunk();
    if (target.num_layers == 0 || chunk.layer() >= static_cast<uint32_t>(target.num_layers) ||
        chunk.token_start() + static_cast<int64_t>(chunk.token_count()) > target.num_tokens ||
        static_cast<int64_t>(chunk.data().size()) != geometry.chunk_bytes(chunk.token_count())) {
      return false;
    }
    std::vector<char>& layer =
        (chunk.kind() == v1::CACHE_KIND_K ? target.k : target.v)[chunk.layer()];
    ScatterChunk(geometry, chunk.token_start(), chunk.token_count(), chunk.data().data(),
                 layer.data());
    return true;
  });
}

}  // namespace kvt
