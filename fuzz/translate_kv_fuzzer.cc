// Fuzz target: TranslateKV request validation, black-box. Each input decodes (FuzzedDataProvider)
// into a sequence of TranslateKVRequest messages -- a header with fuzzed fields, then chunks,
// stray headers and empty messages, optionally followed by a complete valid chunk set -- that is
// streamed to a real TranslatorService (real mapper store with two small synthetic mappers, real
// CPU backend) over a loopback gRPC channel. Invariants:
//   - the status is OK or one of the documented refusals (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
//     NOT_FOUND, UNIMPLEMENTED, FAILED_PRECONDITION): never UNKNOWN/INTERNAL, never a hang (DEADLINE_EXCEEDED);
//   - OK means: a response header first, the trailer last, and target chunks covering every
//     target layer's K and V exactly (byte count), all inside the announced shape;
//   - every refusal carries a message.
#include "fuzz/FuzzedDataProvider.h"  // LLVM 14 copy: gcc builds the replay test too
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <cstdlib>
#include <memory>
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
#include "proto/kvt/v1/service.grpc.pb.h"
#include "server/config.h"
#include "server/translator_service.h"

namespace {

struct FuzzModel {
  const char* mapper_id;
  const char* source;
  const char* target;
  int source_layers, source_heads, source_dim;
};
// Must match the mappers written in Initialize.
const FuzzModel kModels[] = {
    {"fuzz-a", "fuzz/src", "fuzz/dst", 2, 2, 8},
    {"fuzz-b", "fuzz/small", "fuzz/big", 1, 1, 4},
};
constexpr int kMaxTokens = 32;

using kvt_fuzz::Worker;

struct Env {
  Worker reader;
  std::string dir;
  std::unique_ptr<kvt::MapperStore> store;
  std::unique_ptr<kvt::Backend> backend;
  std::unique_ptr<kvt::TranslatorService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<kvt::v1::KvTranslator::Stub> stub;
};
Env* env = nullptr;

kvt::ModelSpec Model(const std::string& name, int layers, int heads, int dim, int rotary) {
  kvt::ModelSpec model;
  model.name = name;
  model.num_layers = layers;
  model.num_kv_heads = heads;
  model.head_dim = dim;
  model.rope.rotary_dim = rotary;
  return model;
}

void Die(const std::string& what) {
  std::fprintf(stderr, "translate_kv_fuzzer setup: %s\n", what.c_str());
  std::abort();
}

void SetUp() {
  kvt::SetMinLogLevel(kvt::LogLevel::kError);
  env = new Env;
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string templ = std::string(tmp ? tmp : "/tmp") + "/kvt-fuzz-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) Die("mkdtemp");
  env->dir = templ;
  kvt::SynthOptions a;
  a.source = Model(kModels[0].source, 2, 2, 8, 8);
  a.target = Model(kModels[0].target, 3, 2, 8, 8);
  a.k = 1;
  a.dtype = kvt::DType::kFP32;
  a.seed = 1;
  kvt::SynthOptions b;
  b.source = Model(kModels[1].source, 1, 1, 4, 4);
  b.target = Model(kModels[1].target, 2, 2, 8, 4);
  b.target.rope.theta = 500000;
  b.k = 0;
  b.dtype = kvt::DType::kBF16;
  b.seed = 2;
  for (const auto& [id, options] : {std::pair<const char*, kvt::SynthOptions*>{"fuzz-a", &a},
                                    {"fuzz-b", &b}}) {
    absl::Status written = kvt::WriteSynthMapper(env->dir + "/" + id, *options);
    if (!written.ok()) Die(written.ToString());
  }
  absl::StatusOr<std::unique_ptr<kvt::MapperStore>> store = kvt::MapperStore::Open(env->dir);
  if (!store.ok()) Die(store.status().ToString());
  env->store = std::move(*store);
  kvt::CpuBackendOptions backend_options;
  backend_options.num_threads = 1;
  env->backend = kvt::NewCpuBackend(backend_options);
  kvt::KvtdConfig config;
  config.limits.max_tokens = kMaxTokens;
  config.limits.response_chunk_bytes = 256;  // several response chunks per layer
  config.limits.max_request_bytes = 1 << 20;
  env->service = std::make_unique<kvt::TranslatorService>(config, env->store.get(),
                                                          env->backend.get());
  // Loopback TCP, not Server::InProcessChannel: Debian gRPC 1.51's in-process transport keeps
  // the call objects of every finished call alive (~11 KB arena each plus its status, ~15 KB of
  // RSS per execution, docs/RELIABILITY.md "Fuzzing"); kvtd never uses that transport.
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(env->service.get());
  env->server = builder.BuildAndStart();
  if (!env->server || port == 0) Die("BuildAndStart on 127.0.0.1:0");
  env->stub = kvt::v1::KvTranslator::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  // Runs before LSan's exit-time check (registered earlier, atexit is LIFO): shutting the server
  // down lets gRPC's sync-server thread manager join and free the worker threads it started under
  // load, which it otherwise still holds at exit (a 176-byte "leak" inside libgrpc++ after 1M runs).
  std::atexit([] {
    env->stub.reset();
    env->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    env->server->Wait();
  });
}

// proto3 strings must be UTF-8 (protobuf refuses anything else before the service sees it).
std::string Ascii(std::string s) {
  for (char& c : s) c = static_cast<char>(0x20 + (static_cast<unsigned char>(c) % 95));
  return s;
}

int ElementSize(int dtype) { return dtype == kvt::v1::DTYPE_FP32 ? 4 : 2; }

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  SetUp();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (env == nullptr) SetUp();
  FuzzedDataProvider fdp(data, size);
  std::vector<kvt::v1::TranslateKVRequest> messages;

  // --- The header (or not). ---
  const int first = fdp.ConsumeIntegralInRange<int>(0, 15);
  const FuzzModel& model = kModels[fdp.ConsumeIntegralInRange<int>(0, 1)];
  int dtype = 3, num_tokens = 0;
  if (first < 13) {
    kvt::v1::TranslateHeader* header = messages.emplace_back().mutable_header();
    switch (fdp.ConsumeIntegralInRange<int>(0, 5)) {
      case 0:
      case 1:
        header->set_mapper_id(model.mapper_id);
        break;
      case 2:
      case 3:
        header->set_source_model(model.source);
        header->set_target_model(model.target);
        break;
      case 4:  // id plus a pair that may disagree with it
        header->set_mapper_id(model.mapper_id);
        header->set_source_model(fdp.ConsumeBool() ? model.source : kModels[1].source);
        header->set_target_model(fdp.ConsumeBool() ? model.target : kModels[0].target);
        break;
      default:
        header->set_mapper_id(Ascii(fdp.ConsumeRandomLengthString(16)));
        header->set_source_model(Ascii(fdp.ConsumeRandomLengthString(16)));
        header->set_target_model(Ascii(fdp.ConsumeRandomLengthString(16)));
    }
    if (fdp.ConsumeBool()) header->set_request_id(Ascii(fdp.ConsumeRandomLengthString(8)));
    dtype = fdp.ConsumeIntegralInRange<int>(0, 4);  // 0 and 4 are invalid
    header->set_dtype(static_cast<kvt::v1::DType>(dtype));
    header->set_layout(static_cast<kvt::v1::Layout>(fdp.ConsumeIntegralInRange<int>(0, 3)));
    header->set_output_dtype(static_cast<kvt::v1::DType>(fdp.ConsumeIntegralInRange<int>(0, 4)));
    header->set_output_layout(
        static_cast<kvt::v1::Layout>(fdp.ConsumeIntegralInRange<int>(0, 3)));
    const uint32_t tokens = fdp.ConsumeIntegralInRange<int>(0, 7) == 0
                                ? fdp.ConsumeIntegral<uint32_t>()
                                : fdp.ConsumeIntegralInRange<uint32_t>(0, 12);
    header->set_num_tokens(tokens);
    num_tokens = tokens <= kMaxTokens ? static_cast<int>(tokens) : 0;
    switch (fdp.ConsumeIntegralInRange<int>(0, 5)) {
      case 0:  // explicit positions, possibly the wrong count
        for (int i = 0, n = fdp.ConsumeIntegralInRange<int>(0, 14); i < n; ++i) {
          header->add_positions(fdp.ConsumeBool() ? fdp.ConsumeIntegral<uint64_t>()
                                                  : fdp.ConsumeIntegralInRange<uint64_t>(0, 4096));
        }
        break;
      case 1:
        header->set_position_offset(fdp.ConsumeIntegral<uint64_t>());
        break;
      case 2:
        header->set_position_offset(fdp.ConsumeIntegralInRange<uint64_t>(0, 100000));
        break;
      default:
        break;
    }
    if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
      header->mutable_input()->mutable_region()->set_region("r");
    }
    if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
      header->mutable_output()->mutable_region()->set_region("r");
    }
    header->mutable_output()->mutable_inline_()->set_chunk_tokens(
        fdp.ConsumeIntegralInRange<uint32_t>(0, 5));
    if (fdp.ConsumeBool()) header->set_reprefill_estimate_ms(fdp.ConsumeFloatingPoint<double>());
    header->set_session_id(Ascii(fdp.ConsumeRandomLengthString(4)));
    header->set_turn(fdp.ConsumeIntegral<uint32_t>());
  } else if (first == 13) {
    messages.emplace_back();  // empty message first
  }  // 14, 15: chunks with no header at all
  const int element_size = ElementSize(dtype);
  const int token_bytes = model.source_heads * model.source_dim * element_size;

  // --- Fuzzed chunks, stray headers and empty messages. ---
  const bool complete = fdp.ConsumeBool();
  const int fuzzed = fdp.ConsumeIntegralInRange<int>(0, complete ? 3 : 24);
  for (int i = 0; i < fuzzed && fdp.remaining_bytes() > 0; ++i) {
    const int what = fdp.ConsumeIntegralInRange<int>(0, 15);
    if (what == 0) {
      messages.emplace_back().mutable_header()->set_mapper_id(model.mapper_id);
      continue;
    }
    if (what == 1) {
      messages.emplace_back();
      continue;
    }
    kvt::v1::KVChunk* chunk = messages.emplace_back().mutable_chunk();
    chunk->set_layer(fdp.ConsumeIntegralInRange<int>(0, 7) == 0
                         ? fdp.ConsumeIntegral<uint32_t>()
                         : fdp.ConsumeIntegralInRange<uint32_t>(0, model.source_layers));
    chunk->set_kind(static_cast<kvt::v1::CacheKind>(fdp.ConsumeIntegralInRange<int>(0, 3)));
    const bool wild = fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
    const uint32_t start = wild ? fdp.ConsumeIntegral<uint32_t>()
                                : fdp.ConsumeIntegralInRange<uint32_t>(0, 12);
    const uint32_t count = wild ? fdp.ConsumeIntegral<uint32_t>()
                                : fdp.ConsumeIntegralInRange<uint32_t>(0, 12);
    chunk->set_token_start(start);
    chunk->set_token_count(count);
    int64_t bytes = (!wild && count <= 12) ? int64_t{count} * token_bytes : 0;
    bytes += fdp.ConsumeIntegralInRange<int>(0, 3) == 0 ? fdp.ConsumeIntegralInRange<int>(-3, 3)
                                                        : 0;
    if (bytes < 0) bytes = 0;
    std::string payload = fdp.ConsumeBytesAsString(static_cast<size_t>(bytes));
    payload.resize(static_cast<size_t>(bytes), '\0');
    chunk->set_data(std::move(payload));
  }
  // --- Optionally, every source chunk the header asks for, in pieces. ---
  if (complete && num_tokens > 0) {
    const int piece = fdp.ConsumeIntegralInRange<int>(1, num_tokens);
    for (int layer = 0; layer < model.source_layers; ++layer) {
      for (int kind = 1; kind <= 2; ++kind) {
        for (int start = 0; start < num_tokens; start += piece) {
          const int count = std::min(piece, num_tokens - start);
          kvt::v1::KVChunk* chunk = messages.emplace_back().mutable_chunk();
          chunk->set_layer(layer);
          chunk->set_kind(static_cast<kvt::v1::CacheKind>(kind));
          chunk->set_token_start(start);
          chunk->set_token_count(count);
          std::string payload = fdp.ConsumeBytesAsString(static_cast<size_t>(count) * token_bytes);
          payload.resize(static_cast<size_t>(count) * token_bytes, '\0');
          chunk->set_data(std::move(payload));
        }
      }
    }
  }

  if (std::getenv("KVT_FUZZ_VERBOSE") != nullptr) {
    for (const kvt::v1::TranslateKVRequest& message : messages) {
      std::string text = message.ShortDebugString();
      if (text.size() > 300) text = text.substr(0, 300) + "...";
      std::fprintf(stderr, "send: %s\n", text.c_str());
    }
  }

  // --- Stream it, read everything back, check the outcome. ---
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = env->stub->TranslateKV(&context);
  // A bidi client must read while it writes: the server answers with its header before the last
  // chunk arrives, and HTTP/2 flow-control windows buffer only so much of the response.
  int responses = 0, headers = 0, trailers = 0;
  bool header_first = false, trailer_last = false;
  int64_t chunk_bytes = 0;
  kvt::v1::TranslateResponseHeader out;
  bool chunks_in_shape = true;
  env->reader.Run([&] {
    kvt::v1::TranslateKVResponse response;
    while (stream->Read(&response)) {
      ++responses;
      trailer_last = false;
      if (response.has_header()) {
        ++headers;
        header_first = responses == 1;
        out = response.header();
      } else if (response.has_chunk()) {
        const kvt::v1::KVChunk& chunk = response.chunk();
        chunk_bytes += chunk.data().size();
        chunks_in_shape &=
            chunk.layer() < out.target_shape().num_layers() && chunk.token_count() > 0 &&
            uint64_t{chunk.token_start()} + chunk.token_count() <= out.num_tokens() &&
            chunk.data().size() == uint64_t{chunk.token_count()} *
                                       out.target_shape().num_kv_heads() *
                                       out.target_shape().head_dim() *
                                       ElementSize(out.output_dtype());
      } else if (response.has_trailer()) {
        ++trailers;
        trailer_last = true;
      }
    }
  });
  for (const kvt::v1::TranslateKVRequest& message : messages) {
    if (!stream->Write(message)) break;
  }
  stream->WritesDone();
  env->reader.Wait();
  const grpc::Status status = stream->Finish();
  switch (status.error_code()) {
    case grpc::StatusCode::OK: {
      FUZZ_CHECK(!messages.empty() && messages[0].has_header());
      FUZZ_CHECK(headers == 1 && header_first);
      FUZZ_CHECK(trailers == 1 && trailer_last);
      FUZZ_CHECK(chunks_in_shape);
      const int64_t expected = int64_t{2} * out.target_shape().num_layers() *
                               out.target_shape().num_kv_heads() * out.target_shape().head_dim() *
                               out.num_tokens() * ElementSize(out.output_dtype());
      FUZZ_CHECK(chunk_bytes == expected);
      FUZZ_CHECK(out.num_tokens() == messages[0].header().num_tokens());
      break;
    }
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::UNIMPLEMENTED:
    case grpc::StatusCode::FAILED_PRECONDITION:  // shared memory disabled, mapper FAILED
      FUZZ_CHECK(!status.error_message().empty());
      FUZZ_CHECK(trailers == 0);
      break;
    default:
      std::fprintf(stderr, "unexpected status %d: %s\n", static_cast<int>(status.error_code()),
                   status.error_message().c_str());
      FUZZ_CHECK(false && "TranslateKV ended with an undocumented status code");
  }
  return 0;
}
