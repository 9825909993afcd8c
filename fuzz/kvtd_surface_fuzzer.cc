// Fuzz target: kvtd's surface beyond TranslateKV's inline path, black-box against a real
// KvtdServer (TCP loopback, real store of two synthetic mappers from one source into two
// targets, the second behind a quality gate that refuses it, prefix cache on, client shared
// memory on). Each input decodes into up to 8 operations on one server:
//   - the region lifecycle: register (fuzzed offset / size), unregister (short deadline),
//     truncate the shm object under its registration or restore it;
//   - Publish inline (values may be NaN / Inf) or from a region, packed or paged;
//   - LookupPrefix (policies incl. out-of-range ones, mapper ids) and TranslateKV on the lease,
//     with the looked-up mapper, the other one, or a made-up lease;
//   - TranslateKV with region input / output, packed or paged in the standard or an engine
//     block order, fuzzed geometry (near 2^32 blocks / block sizes), tables and token ranges;
//   - ValidateKV headers (num_query_heads up to 2^32) with or without chunks.
// Invariants: every status is OK or a documented refusal with a message of bounded size
// (never UNKNOWN / INTERNAL, never a hang), and the process survives (no sanitizer report).
#include "fuzz/FuzzedDataProvider.h"  // LLVM 14 copy: gcc builds the replay test too
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/logging.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_worker.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu_backend.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "proto/kvt/v1/prefix_cache.grpc.pb.h"
#include "proto/kvt/v1/service.grpc.pb.h"
#include "server/config.h"
#include "server/kvtd_server.h"

namespace {

namespace v1 = kvt::v1;

constexpr int kMaxTokens = 32;
constexpr int kLayers = 2, kHeads = 2, kDim = 8;  // fz/src, fp32 or bf16
constexpr size_t kObjectBytes = 64 << 10;
constexpr int kObjects = 2;
const char* const kMappers[] = {"fa", "fb"};
const char* const kTargets[] = {"fz/dst", "fz/other"};

using kvt_fuzz::Worker;

struct Env {
  Worker reader;
  std::string dir;
  std::string keys[kObjects];
  int fds[kObjects] = {-1, -1};
  std::unique_ptr<kvt::MapperStore> store;
  std::unique_ptr<kvt::Backend> backend;
  std::unique_ptr<kvt::KvtdServer> server;
  std::unique_ptr<v1::KvTranslator::Stub> translator;
  std::unique_ptr<v1::KvPrefixCache::Stub> prefix;
};
Env* env = nullptr;

void Die(const std::string& what) {
  std::fprintf(stderr, "kvtd_surface_fuzzer setup: %s\n", what.c_str());
  std::abort();
}

kvt::ModelSpec Model(const std::string& name, int layers, int heads, int dim) {
  kvt::ModelSpec model;
  model.name = name;
  model.num_layers = layers;
  model.num_kv_heads = heads;
  model.head_dim = dim;
  model.rope.rotary_dim = dim;
  return model;
}

void SetUp() {
  kvt::SetMinLogLevel(kvt::LogLevel::kError);
  env = new Env;
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string templ = std::string(tmp ? tmp : "/tmp") + "/kvt-surface-fuzz-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) Die("mkdtemp");
  env->dir = templ;
  for (int i = 0; i < 2; ++i) {
    kvt::SynthOptions options;
    options.source = Model("fz/src", kLayers, kHeads, kDim);
    options.target = i == 0 ? Model(kTargets[0], 2, 2, 8) : Model(kTargets[1], 1, 1, 8);
    options.k = 1;
    options.dtype = kvt::DType::kFP32;
    options.seed = 1 + i;
    absl::Status written = kvt::WriteSynthMapper(env->dir + "/" + kMappers[i], options);
    if (!written.ok()) Die(written.ToString());
  }
  for (int i = 0; i < kObjects; ++i) {
    env->keys[i] = "/kvt-surface-fuzz-" + std::to_string(getpid()) + "-" + std::to_string(i);
    shm_unlink(env->keys[i].c_str());
    env->fds[i] = shm_open(env->keys[i].c_str(), O_CREAT | O_RDWR, 0600);
    if (env->fds[i] < 0 || ftruncate(env->fds[i], kObjectBytes) != 0) Die("shm object");
  }
  absl::StatusOr<std::unique_ptr<kvt::MapperStore>> store = kvt::MapperStore::Open(env->dir);
  if (!store.ok()) Die(store.status().ToString());
  env->store = std::move(*store);
  kvt::CpuBackendOptions backend_options;
  backend_options.num_threads = 1;
  env->backend = kvt::NewCpuBackend(backend_options);
  kvt::KvtdConfig config;
  config.server.listen_address = "127.0.0.1:0";
  config.mapper_store.path = env->dir;
  config.shutdown.drain_grace_seconds = 0;
  config.limits.max_tokens = kMaxTokens;
  config.limits.max_request_bytes = 1 << 20;
  config.limits.response_chunk_bytes = 512;
  config.shared_memory.allow_client_regions = true;
  config.prefix_cache.enabled = true;
  config.prefix_cache.block_tokens = 4;
  config.prefix_cache.max_bytes = 1 << 20;
  config.prefix_cache.pair_min_quality["fz/src->fz/other"] = 0.9;  // synth records none
  // Synth mappers record no benefit either: off, so fz/src->fz/dst lookups still lease.
  config.prefix_cache.min_benefit_recovered = 0;
  absl::StatusOr<std::unique_ptr<kvt::KvtdServer>> server =
      kvt::KvtdServer::Start(config, env->store.get(), env->backend.get());
  if (!server.ok()) Die(server.status().ToString());
  env->server = std::move(*server);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(env->server->port()),
                                     grpc::InsecureChannelCredentials());
  env->translator = v1::KvTranslator::NewStub(channel);
  env->prefix = v1::KvPrefixCache::NewStub(channel);
  // Before LSan's exit check (atexit is LIFO): the server's threads are joined and freed.
  std::atexit([] {
    env->translator.reset();
    env->prefix.reset();
    env->server->Shutdown();
    env->server.reset();
    for (int i = 0; i < kObjects; ++i) shm_unlink(env->keys[i].c_str());
  });
}

std::string Ascii(std::string s) {
  for (char& c : s) c = static_cast<char>(0x20 + (static_cast<unsigned char>(c) % 95));
  return s;
}

// A documented outcome: OK, or a refusal with a bounded, non-empty message.
void CheckStatus(const grpc::Status& status, bool deadline_ok, const char* rpc) {
  switch (status.error_code()) {
    case grpc::StatusCode::OK:
      return;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      if (!deadline_ok) break;
      [[fallthrough]];
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::UNIMPLEMENTED:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
      FUZZ_CHECK(!status.error_message().empty());
      FUZZ_CHECK(status.error_message().size() <= 4096 + 32);
      return;
    default:
      break;
  }
  std::fprintf(stderr, "%s: unexpected status %d: %s\n", rpc,
               static_cast<int>(status.error_code()), status.error_message().c_str());
  FUZZ_CHECK(false && "an RPC ended with an undocumented status code");
}

std::chrono::system_clock::time_point Deadline(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

uint32_t Wide(FuzzedDataProvider& fdp, uint32_t small) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return fdp.ConsumeIntegral<uint32_t>();
    case 1: return 0xFFFFFFFFu - fdp.ConsumeIntegralInRange<uint32_t>(0, 3);
    case 2: return (1u << 31) + fdp.ConsumeIntegralInRange<uint32_t>(0, 3);
    default: return fdp.ConsumeIntegralInRange<uint32_t>(0, small);
  }
}
uint64_t Wide64(FuzzedDataProvider& fdp, uint64_t small) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return fdp.ConsumeIntegral<uint64_t>();
    case 1: return (uint64_t{1} << 62) + fdp.ConsumeIntegralInRange<uint64_t>(0, 3);
    default: return fdp.ConsumeIntegralInRange<uint64_t>(0, small);
  }
}

// A region reference: packed, or paged in the standard or an engine order, with a fuzzed
// geometry and table; token ranges on outputs.
void FillRegion(FuzzedDataProvider& fdp, v1::RegionRef* ref, uint64_t packed_bytes, bool output) {
  ref->set_region(fdp.ConsumeIntegralInRange<int>(0, 9) == 0 ? Ascii(fdp.ConsumeRandomLengthString(8))
                                                             : "r" + std::to_string(fdp.ConsumeIntegralInRange<int>(0, 1)));
  ref->set_offset(fdp.ConsumeIntegralInRange<int>(0, 5) == 0 ? Wide64(fdp, kObjectBytes) : 0);
  if (!fdp.ConsumeBool()) {
    ref->set_byte_size(fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? Wide64(fdp, kObjectBytes)
                                                                  : packed_bytes);
    return;
  }
  v1::PagedBlocks* paged = ref->mutable_paged();
  const uint32_t blocks = Wide(fdp, 16), block_size = Wide(fdp, 8);
  paged->set_num_blocks(blocks);
  paged->set_block_size(block_size);
  for (int i = 0, n = fdp.ConsumeIntegralInRange<int>(0, 12); i < n; ++i) {
    paged->add_block_table(fdp.ConsumeIntegralInRange<int>(0, 7) == 0
                               ? fdp.ConsumeIntegral<uint32_t>()
                               : fdp.ConsumeIntegralInRange<uint32_t>(0, 16));
  }
  if (output && fdp.ConsumeBool()) {
    paged->set_first_token(Wide(fdp, kMaxTokens));
    paged->set_end_token(Wide(fdp, kMaxTokens));
  } else if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
    paged->set_first_token(1);  // refused on an input
  }
  // The standard order's exact size, computed the way a client would (wrapping at 2^64).
  const uint64_t standard = uint64_t{2} * kLayers * blocks * block_size * kHeads * kDim * 4;
  if (fdp.ConsumeBool()) {
    ref->set_byte_size(fdp.ConsumeBool() ? standard : Wide64(fdp, kObjectBytes));
    return;
  }
  v1::EngineBlockOrder* order = paged->mutable_engine_order();
  const int layers = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int l = 0; l < layers; ++l) order->add_layer_offsets(Wide64(fdp, 32 << 10));
  order->set_block_stride(Wide64(fdp, 1024));
  for (v1::BlockStrides* s : {order->mutable_k(), order->mutable_v()}) {
    s->set_offset(Wide64(fdp, 512));
    s->set_slot_stride(Wide64(fdp, 64));
    s->set_head_stride(Wide64(fdp, 64));
    s->set_dim_stride(Wide64(fdp, 4));
  }
  ref->set_byte_size(Wide64(fdp, kObjectBytes));
}

// Chunk payload of `count` tokens: fuzz bytes (NaN / Inf included by chance) or zeros.
std::string Payload(FuzzedDataProvider& fdp, size_t bytes) {
  std::string payload = fdp.ConsumeBool() ? fdp.ConsumeBytesAsString(bytes) : std::string();
  payload.resize(bytes, '\0');
  return payload;
}

// Streams `messages` to a bidi TranslateKV and reads everything back.
grpc::Status Translate(const std::vector<v1::TranslateKVRequest>& messages) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(30000));
  auto stream = env->translator->TranslateKV(&context);
  env->reader.Run([&] {
    v1::TranslateKVResponse response;
    while (stream->Read(&response)) {
    }
  });
  for (const v1::TranslateKVRequest& message : messages) {
    if (!stream->Write(message)) break;
  }
  stream->WritesDone();
  env->reader.Wait();
  return stream->Finish();
}

void AddSourceChunks(FuzzedDataProvider& fdp, int tokens, int element,
                     std::vector<v1::TranslateKVRequest>* messages) {
  for (int l = 0; l < kLayers; ++l) {
    for (int kind = 1; kind <= 2; ++kind) {
      v1::KVChunk* chunk = messages->emplace_back().mutable_chunk();
      chunk->set_layer(l);
      chunk->set_kind(static_cast<v1::CacheKind>(kind));
      chunk->set_token_start(0);
      chunk->set_token_count(tokens);
      chunk->set_data(Payload(fdp, static_cast<size_t>(tokens) * kHeads * kDim * element));
    }
  }
}

void RegionOp(FuzzedDataProvider& fdp) {
  const int object = fdp.ConsumeIntegralInRange<int>(0, kObjects - 1);
  const std::string name = "r" + std::to_string(object);
  switch (fdp.ConsumeIntegralInRange<int>(0, 4)) {
    case 0:
    case 1: {
      grpc::ClientContext context;
      context.set_deadline(Deadline(5000));
      v1::RegisterSystemMemoryRequest request;
      request.set_name(fdp.ConsumeIntegralInRange<int>(0, 9) == 0 ? Ascii(fdp.ConsumeRandomLengthString(8)) : name);
      request.set_key(fdp.ConsumeIntegralInRange<int>(0, 9) == 0 ? "/kvt-surface-none" : env->keys[object]);
      request.set_offset(fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? Wide64(fdp, kObjectBytes) : 0);
      request.set_byte_size(fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? Wide64(fdp, kObjectBytes)
                                                                       : kObjectBytes);
      v1::RegisterSystemMemoryResponse response;
      CheckStatus(env->translator->RegisterSystemMemory(&context, request, &response), false,
                  "RegisterSystemMemory");
      break;
    }
    case 2: {
      grpc::ClientContext context;
      context.set_deadline(Deadline(fdp.ConsumeIntegralInRange<int>(1, 50)));
      v1::UnregisterSystemMemoryRequest request;
      request.set_name(fdp.ConsumeBool() ? name : "");
      v1::UnregisterSystemMemoryResponse response;
      CheckStatus(env->translator->UnregisterSystemMemory(&context, request, &response), true,
                  "UnregisterSystemMemory");
      break;
    }
    case 3:  // a client shrinking its object under the registration
      FUZZ_CHECK(ftruncate(env->fds[object],
                           fdp.ConsumeIntegralInRange<off_t>(0, kObjectBytes)) == 0);
      break;
    default:  // and writing its cache into it (bytes, never a mapping: it may be short)
      FUZZ_CHECK(ftruncate(env->fds[object], kObjectBytes) == 0);
      const std::string bytes = fdp.ConsumeBytesAsString(fdp.ConsumeIntegralInRange<size_t>(0, 4096));
      FUZZ_CHECK(pwrite(env->fds[object], bytes.data(), bytes.size(),
                        fdp.ConsumeIntegralInRange<off_t>(0, kObjectBytes - 4096)) ==
                 static_cast<ssize_t>(bytes.size()));
  }
}

std::vector<uint32_t> TokenIds(FuzzedDataProvider& fdp) {
  std::vector<uint32_t> ids(fdp.ConsumeIntegralInRange<int>(0, kMaxTokens + 2));
  const uint32_t base = fdp.ConsumeIntegralInRange<uint32_t>(0, 2);  // few distinct prompts
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = base * 1000 + static_cast<uint32_t>(i);
  return ids;
}

void PublishOp(FuzzedDataProvider& fdp) {
  v1::PublishRequest first;
  v1::PublishHeader* header = first.mutable_header();
  header->set_model(fdp.ConsumeIntegralInRange<int>(0, 7) == 0 ? Ascii(fdp.ConsumeRandomLengthString(16)) : "fz/src");
  const std::vector<uint32_t> ids = TokenIds(fdp);
  for (uint32_t id : ids) header->add_token_ids(id);
  const int dtype = fdp.ConsumeIntegralInRange<int>(0, 4);
  header->set_dtype(static_cast<v1::DType>(dtype));
  header->set_layout(static_cast<v1::Layout>(fdp.ConsumeIntegralInRange<int>(0, 3)));
  header->mutable_shape()->set_num_layers(fdp.ConsumeIntegralInRange<int>(0, 9) == 0 ? Wide(fdp, 4) : kLayers);
  header->mutable_shape()->set_num_kv_heads(kHeads);
  header->mutable_shape()->set_head_dim(kDim);
  header->set_ttl_seconds(fdp.ConsumeIntegralInRange<uint32_t>(0, 100));
  const int element = dtype == v1::DTYPE_FP32 ? 4 : 2;
  const int tokens = static_cast<int>(ids.size());
  const bool region = fdp.ConsumeIntegralInRange<int>(0, 2) == 0;
  if (region) {
    FillRegion(fdp, header->mutable_input()->mutable_region(),
               uint64_t{2} * kLayers * tokens * kHeads * kDim * element, false);
  }
  grpc::ClientContext context;
  context.set_deadline(Deadline(30000));
  v1::PublishResponse response;
  auto stream = env->prefix->Publish(&context, &response);
  stream->Write(first);
  if (!region && tokens > 0) {
    std::vector<v1::TranslateKVRequest> chunks;
    AddSourceChunks(fdp, tokens, element, &chunks);
    const size_t keep = fdp.ConsumeIntegralInRange<size_t>(0, chunks.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (i == keep && fdp.ConsumeBool()) continue;  // a gap
      v1::PublishRequest message;
      *message.mutable_chunk() = chunks[i].chunk();
      if (!stream->Write(message)) break;
    }
  }
  stream->WritesDone();
  CheckStatus(stream->Finish(), false, "Publish");
}

void LookupOp(FuzzedDataProvider& fdp) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(10000));
  v1::LookupPrefixRequest request;
  const int target = fdp.ConsumeIntegralInRange<int>(0, 2);
  request.set_target_model(target < 2 ? kTargets[target] : Ascii(fdp.ConsumeRandomLengthString(8)));
  for (uint32_t id : TokenIds(fdp)) request.add_token_ids(id);
  const int policy = fdp.ConsumeIntegralInRange<int>(0, 5);
  request.set_policy(static_cast<v1::ReusePolicy>(policy == 5 ? 99 : policy));
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    request.set_mapper_id(kMappers[fdp.ConsumeIntegralInRange<int>(0, 1)]);
  }
  request.set_min_tokens(fdp.ConsumeIntegralInRange<uint32_t>(0, 40));
  request.set_max_tokens(fdp.ConsumeIntegralInRange<uint32_t>(0, 40));
  v1::LookupPrefixResponse response;
  const grpc::Status status = env->prefix->LookupPrefix(&context, request, &response);
  CheckStatus(status, false, "LookupPrefix");
  if (policy == 5) FUZZ_CHECK(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  if (!status.ok() || !fdp.ConsumeBool()) return;
  // Spend the lease: as issued, on the other mapper, with a wrong header, or a made-up one.
  std::vector<v1::TranslateKVRequest> messages;
  v1::TranslateHeader* header = messages.emplace_back().mutable_header();
  const int use = fdp.ConsumeIntegralInRange<int>(0, 3);
  header->set_mapper_id(use == 1 ? kMappers[response.mapper_id() == "fa" ? 1 : 0]
                                 : response.mapper_id().empty() ? "fa" : response.mapper_id());
  header->set_dtype(use == 2 ? static_cast<v1::DType>(fdp.ConsumeIntegralInRange<int>(0, 4))
                             : response.dtype());
  header->set_layout(response.layout());
  header->set_num_tokens(use == 2 ? Wide(fdp, kMaxTokens) : response.matched_tokens());
  header->mutable_input()->mutable_cached()->set_lease_id(
      use == 3 ? Ascii(fdp.ConsumeRandomLengthString(40)) : response.lease_id());
  const grpc::Status translated = Translate(messages);
  CheckStatus(translated, false, "TranslateKV(cached)");
  if (use == 1 && response.hit()) FUZZ_CHECK(!translated.ok());  // bound to its mapper
}

void RegionTranslateOp(FuzzedDataProvider& fdp) {
  std::vector<v1::TranslateKVRequest> messages;
  v1::TranslateHeader* header = messages.emplace_back().mutable_header();
  const int mapper = fdp.ConsumeIntegralInRange<int>(0, 1);
  header->set_mapper_id(kMappers[mapper]);
  const int dtype = fdp.ConsumeIntegralInRange<int>(0, 4);
  header->set_dtype(static_cast<v1::DType>(dtype));
  header->set_layout(static_cast<v1::Layout>(fdp.ConsumeIntegralInRange<int>(0, 3)));
  const uint32_t tokens = Wide(fdp, kMaxTokens);
  header->set_num_tokens(tokens);
  const int element = dtype == v1::DTYPE_FP32 ? 4 : 2;
  const uint64_t t = tokens <= kMaxTokens ? tokens : 0;
  const bool input_region = fdp.ConsumeBool();
  if (input_region) {
    FillRegion(fdp, header->mutable_input()->mutable_region(),
               2 * kLayers * t * kHeads * kDim * element, false);
  }
  const int tgt_layers = mapper == 0 ? 2 : 1, tgt_heads = mapper == 0 ? 2 : 1;
  if (!input_region || fdp.ConsumeBool()) {
    FillRegion(fdp, header->mutable_output()->mutable_region(),
               2 * tgt_layers * t * tgt_heads * 8 * element, true);
    header->set_region_layer_notices(fdp.ConsumeBool());
  }
  if (!input_region && t > 0) AddSourceChunks(fdp, static_cast<int>(t), element, &messages);
  CheckStatus(Translate(messages), false, "TranslateKV(region)");
}

void ValidateOp(FuzzedDataProvider& fdp) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(30000));
  v1::ValidateKVResponse response;
  auto stream = env->translator->ValidateKV(&context, &response);
  v1::ValidateKVRequest first;
  v1::ValidateHeader* header = first.mutable_header();
  header->set_mapper_id(kMappers[fdp.ConsumeIntegralInRange<int>(0, 1)]);
  const int dtype = fdp.ConsumeIntegralInRange<int>(0, 4);
  header->set_dtype(static_cast<v1::DType>(dtype));
  header->set_layout(static_cast<v1::Layout>(fdp.ConsumeIntegralInRange<int>(0, 3)));
  const uint32_t tokens = Wide(fdp, 8);
  header->set_num_tokens(tokens);
  header->set_num_query_heads(Wide(fdp, 8));
  stream->Write(first);
  for (int i = 0, n = fdp.ConsumeIntegralInRange<int>(0, 10); i < n; ++i) {
    v1::ValidateKVRequest message;
    v1::ValidateChunk* chunk = message.mutable_chunk();
    chunk->set_role(static_cast<v1::ValidateRole>(fdp.ConsumeIntegralInRange<int>(0, 4)));
    v1::KVChunk* kv = chunk->mutable_chunk();
    kv->set_layer(fdp.ConsumeIntegralInRange<uint32_t>(0, 3));
    kv->set_kind(static_cast<v1::CacheKind>(fdp.ConsumeIntegralInRange<int>(0, 3)));
    kv->set_token_start(0);
    const uint32_t count = tokens <= 8 ? tokens : fdp.ConsumeIntegral<uint32_t>();
    kv->set_token_count(count);
    kv->set_data(Payload(fdp, count <= 8 ? size_t{count} * 2 * 8 * 4 : 16));
    if (!stream->Write(message)) break;
  }
  stream->WritesDone();
  CheckStatus(stream->Finish(), false, "ValidateKV");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  SetUp();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (env == nullptr) SetUp();
  FuzzedDataProvider fdp(data, size);
  for (int op = 0, n = fdp.ConsumeIntegralInRange<int>(1, 8); op < n && fdp.remaining_bytes() > 0;
       ++op) {
    switch (fdp.ConsumeIntegralInRange<int>(0, 5)) {
      case 0: RegionOp(fdp); break;
      case 1: PublishOp(fdp); break;
      case 2: LookupOp(fdp); break;
      case 3: RegionTranslateOp(fdp); break;
      case 4: ValidateOp(fdp); break;
      default: RegionTranslateOp(fdp);
    }
  }
  return 0;
}
