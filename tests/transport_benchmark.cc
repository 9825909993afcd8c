// Transport benchmark on loopback: how much moving a cache costs next to translating it.
// One run measures side by side, for each token count T of a Qwen3-14B-shaped cache (8 KV heads
// x 128, bf16; layer count reduced so 2 cores finish) translated by the qwen3-14b-to-32b
// synthetic preset:
//   memcpy        plain memcpy of the source cache bytes (the floor any transport compares to)
//   raw tcp       the same bytes through a bare loopback TCP socket (write / read in
//                 --chunk_bytes pieces into warm memory): what any socket transport, gRPC
//                 included, can reach on this kernel
//   compute       Backend::Translate in process, no server (the floor a request compares to)
//   inline        TranslateKV with inline chunks, everything received before compute
//   pipelined     the same with layer pipelining (target layers stream back during the upload)
//   shm           input and output in registered POSIX shm regions (client copies the cache in)
// and prints a markdown table: latencies (best of --reps), the inline stream's receive and send
// bandwidth (from the trailer's stage times), and the ratios the goals are stated in.
//
//   bazel build -c opt //tests:transport_benchmark
//   bazel-bin/tests/transport_benchmark --tokens=1024,8192,32768 --layers=8 --k=1 --reps=3
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "common/allocator.h"
#include "common/logging.h"
#include "kernels/cpu_backend.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "server/config.h"
#include "server/kvtd_server.h"
#include "tests/shm_object.h"

ABSL_FLAG(std::string, tokens, "1024,8192,32768", "token counts T, comma-separated");
ABSL_FLAG(int, layers, 8, "layers of both models (the real pair has 40 -> 64)");
ABSL_FLAG(int, k, 1, "source layers per target layer (the preset's is 8)");
ABSL_FLAG(bool, shared_sigma, true, "one sigma list for K and V, as the paper fits them");
ABSL_FLAG(int, reps, 3, "repetitions; the best (least disturbed) one is reported");
ABSL_FLAG(int64_t, chunk_bytes, 4 << 20, "inline chunk size, both directions");
ABSL_FLAG(bool, tune_allocator, true,
          "apply kvtd's malloc settings (common/allocator.h); false: glibc's defaults");
ABSL_FLAG(bool, recycle_target, true,
          "the client writes each result into the previous one's buffers "
          "(TranslateStreamOptions::recycled_target); false: fresh buffers per call");
ABSL_FLAG(int64_t, async_scatter_min_bytes, kvt::KvtdConfig().transport.async_scatter_min_bytes,
          "kvtd's transport.async_scatter_min_bytes (0: off, kvtd's default; 1: every upload "
          "scatters on a ScatterWorker)");
ABSL_FLAG(std::string, work_dir, "/tmp/kvt_transport_benchmark", "where the mapper is written");

namespace kvt {
namespace {

using Clock = std::chrono::steady_clock;
double MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

using test::ShmObject;

// Sends `layers` (K then V, layer by layer) over a fresh loopback TCP connection from a second
// thread and reads them into `into`; returns the ms from the first write to the last byte read,
// or a negative number when the socket calls fail.
double RawTcpLoopbackMs(const HostCache& cache, char* into, int64_t chunk_bytes) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) != 0 ||
      listen(listener, 1) != 0) {
    if (listener >= 0) close(listener);
    return -1;
  }
  const int sender_socket = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(sender_socket, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(sender_socket);
    close(listener);
    return -1;
  }
  const int receiver_socket = accept(listener, nullptr, nullptr);
  close(listener);
  const Clock::time_point start = Clock::now();
  bool send_failed = false;
  std::thread sender([&] {
    for (int l = 0; l < cache.num_layers && !send_failed; ++l) {
      for (const std::vector<char>* layer : {&cache.k[l], &cache.v[l]}) {
        for (size_t sent = 0; sent < layer->size();) {
          const ssize_t n = write(sender_socket, layer->data() + sent,
                                  std::min<size_t>(chunk_bytes, layer->size() - sent));
          if (n <= 0) {
            send_failed = true;
            break;
          }
          sent += static_cast<size_t>(n);
        }
      }
    }
    shutdown(sender_socket, SHUT_WR);
  });
  const int64_t total = 2 * cache.num_layers * cache.layer_bytes();
  int64_t received = 0;
  while (received < total) {
    const ssize_t n = read(receiver_socket, into + received,
                           static_cast<size_t>(std::min<int64_t>(chunk_bytes, total - received)));
    if (n <= 0) break;
    received += n;
  }
  const double ms = MsSince(start);
  shutdown(receiver_socket, SHUT_RDWR);  // a sender blocked in write after a failed read ends
  sender.join();
  close(sender_socket);
  close(receiver_socket);
  return received == total && !send_failed ? ms : -1;
}

struct Row {
  int64_t tokens = 0;
  double source_mb = 0;
  double memcpy_ms = 1e30, raw_tcp_ms = 1e30, compute_ms = 1e30, inline_ms = 1e30,
         pipelined_ms = 1e30, shm_ms = 1e30;
  double shm_copy_in_ms = 1e30;       // client memcpy of the cache into the region
  double inline_in_ms = 1e30;         // trailer stage_in of the inline run (receive + scatter)
  double inline_out_ms = 1e30;        // trailer stage_out (gather + send)
  double inline_compute_ms = 1e30;    // trailer compute
  double pipelined_first_ms = 1e30;   // first target layer complete at the client
  // A prefill producing one source layer every compute_ms / layers: the client pushes each
  // layer when it is "produced". Time from the first push to the last result byte.
  double prefill_ms = 0;
  double paced_inline_ms = 1e30, paced_pipelined_ms = 1e30;
};

int Run() {
  const int layers = absl::GetFlag(FLAGS_layers);
  absl::StatusOr<SynthOptions> synth = SynthPreset("qwen3-14b-to-32b");
  if (!synth.ok()) return 1;
  synth->source.num_layers = layers;
  synth->target.num_layers = layers;
  synth->k = absl::GetFlag(FLAGS_k);
  synth->shared_sigma = absl::GetFlag(FLAGS_shared_sigma);
  const std::string dir = absl::GetFlag(FLAGS_work_dir);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  if (absl::Status written = WriteSynthMapper(dir + "/bench", *synth); !written.ok()) {
    std::fprintf(stderr, "%s\n", std::string(written.message()).c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<MapperStore>> store = MapperStore::Open(dir);
  if (!store.ok()) return 1;
  std::unique_ptr<Backend> backend = NewCpuBackend();

  auto start_server = [&](int64_t pipeline_min_tokens) {
    KvtdConfig config;
    config.server.listen_address = "127.0.0.1:0";
    config.server.max_message_bytes = 64ll << 20;
    config.mapper_store.path = dir;
    config.shutdown.drain_grace_seconds = 0;
    config.shared_memory.allow_client_regions = true;
    config.transport.pipeline_min_tokens = pipeline_min_tokens;
    config.transport.async_scatter_min_bytes = absl::GetFlag(FLAGS_async_scatter_min_bytes);
    config.limits.response_chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
    absl::StatusOr<std::unique_ptr<KvtdServer>> server =
        KvtdServer::Start(config, store->get(), backend.get());
    if (!server.ok()) std::abort();
    return std::move(*server);
  };
  std::unique_ptr<KvtdServer> plain = start_server(1ll << 40);
  std::unique_ptr<KvtdServer> piped = start_server(0);
  ClientOptions client_options;
  client_options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  std::unique_ptr<Client> plain_client =
      Client::Create(absl::StrCat("127.0.0.1:", plain->port()), client_options);
  std::unique_ptr<Client> piped_client =
      Client::Create(absl::StrCat("127.0.0.1:", piped->port()), client_options);

  std::shared_ptr<const LoadedMapper> mapper = *(*store)->Get("bench");
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = backend->Prepare(mapper->view());
  if (!prepared.ok()) return 1;

  std::vector<Row> rows;
  for (absl::string_view t : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',')) {
    Row row;
    if (!absl::SimpleAtoi(t, &row.tokens)) return 2;
    HostCache source = HostCache::Zeros(DType::kBF16, Layout::kNHD, layers,
                                        synth->source.num_kv_heads, synth->source.head_dim,
                                        row.tokens);
    std::mt19937 rng(1);
    for (int l = 0; l < layers; ++l) {
      for (std::vector<char>* buffer : {&source.k[l], &source.v[l]}) {
        uint16_t* x = reinterpret_cast<uint16_t*>(buffer->data());
        for (size_t i = 0; i < buffer->size() / 2; ++i) x[i] = 0x3f00 | (rng() & 0xff);  // ~[0.5, 1)
      }
    }
    const int64_t layer_bytes = source.layer_bytes();
    const int64_t source_bytes = 2 * layers * layer_bytes;
    const int64_t target_bytes = source_bytes;  // same shape per layer, same layer count
    row.source_mb = source_bytes / 1e6;
    std::vector<char> copy(static_cast<size_t>(source_bytes));
    std::memset(copy.data(), 1, copy.size());
    HostCache target = source;  // output buffers for the in-process compute

    // Per client: the last result's target, recycled into the next call's when asked to.
    HostCache plain_recycled, piped_recycled;
    auto recycling = [](HostCache* recycled) {
      TranslateStreamOptions options;
      if (absl::GetFlag(FLAGS_recycle_target)) options.recycled_target = std::move(*recycled);
      return options;
    };
    v1::TranslateHeader header;
    header.set_mapper_id("bench");
    header.set_position_offset(100);
    ShmObject in_object(source_bytes), out_object(target_bytes);
    if (!plain_client->RegisterSystemMemory("in", in_object.key(), 0, source_bytes).ok() ||
        !plain_client->RegisterSystemMemory("out", out_object.key(), 0, target_bytes).ok()) {
      return 3;
    }
    v1::TranslateHeader shm_header = header;
    shm_header.set_dtype(v1::DTYPE_BF16);
    shm_header.set_layout(v1::LAYOUT_NHD);
    shm_header.set_num_tokens(static_cast<uint32_t>(row.tokens));
    shm_header.mutable_input()->mutable_region()->set_region("in");
    shm_header.mutable_input()->mutable_region()->set_byte_size(source_bytes);
    shm_header.mutable_output()->mutable_region()->set_region("out");
    shm_header.mutable_output()->mutable_region()->set_byte_size(target_bytes);

    for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
      Clock::time_point start = Clock::now();
      for (int l = 0; l < layers; ++l) {
        std::memcpy(copy.data() + 2 * l * layer_bytes, source.k[l].data(), layer_bytes);
        std::memcpy(copy.data() + (2 * l + 1) * layer_bytes, source.v[l].data(), layer_bytes);
      }
      row.memcpy_ms = std::min(row.memcpy_ms, MsSince(start));

      const double raw_tcp =
          RawTcpLoopbackMs(source, copy.data(), absl::GetFlag(FLAGS_chunk_bytes));
      if (raw_tcp < 0) {
        std::fprintf(stderr, "raw tcp loopback failed\n");
        return 12;
      }
      row.raw_tcp_ms = std::min(row.raw_tcp_ms, raw_tcp);

      CacheView in = source.view();
      MutableCacheView out;
      out.dtype = target.dtype;
      out.layout = target.layout;
      out.num_kv_heads = target.num_kv_heads;
      out.head_dim = target.head_dim;
      out.num_tokens = target.num_tokens;
      for (int l = 0; l < layers; ++l) {
        out.k.push_back(target.k[l].data());
        out.v.push_back(target.v[l].data());
      }
      TranslateOptions options;
      options.token_chunk = KvtdConfig().backend.token_chunk;
      start = Clock::now();
      if (!backend->Translate(**prepared, in, Positions{100}, options, &out).ok()) return 4;
      row.compute_ms = std::min(row.compute_ms, MsSince(start));

      start = Clock::now();
      absl::StatusOr<TranslateResult> inline_result =
          plain_client->Translate(header, source, recycling(&plain_recycled));
      if (!inline_result.ok()) {
        std::fprintf(stderr, "inline: %s\n", inline_result.status().ToString().c_str());
        return 5;
      }
      row.inline_ms = std::min(row.inline_ms, MsSince(start));
      const v1::StageTimings& timings = inline_result->trailer.timings();
      row.inline_in_ms = std::min(row.inline_in_ms, timings.stage_in_ms());
      row.inline_out_ms = std::min(row.inline_out_ms, timings.stage_out_ms());
      row.inline_compute_ms = std::min(row.inline_compute_ms, timings.compute_ms());
      plain_recycled = std::move(inline_result->target);

      start = Clock::now();
      absl::StatusOr<TranslateResult> piped_result =
          piped_client->Translate(header, source, recycling(&piped_recycled));
      if (!piped_result.ok() || !piped_result->trailer.pipelined()) return 6;
      row.pipelined_ms = std::min(row.pipelined_ms, MsSince(start));
      row.pipelined_first_ms = std::min(row.pipelined_first_ms, piped_result->first_layer_ms);
      piped_recycled = std::move(piped_result->target);

      // The client's one copy (its cache into the region) counts; the result is read in place.
      start = Clock::now();
      for (int l = 0; l < layers; ++l) {
        std::memcpy(in_object.data() + 2 * l * layer_bytes, source.k[l].data(), layer_bytes);
        std::memcpy(in_object.data() + (2 * l + 1) * layer_bytes, source.v[l].data(),
                    layer_bytes);
      }
      const double copy_in = MsSince(start);
      absl::StatusOr<TranslateResult> shm_result = plain_client->TranslateRegions(shm_header);
      if (!shm_result.ok()) {
        std::fprintf(stderr, "shm: %s\n", shm_result.status().ToString().c_str());
        return 7;
      }
      const double shm = MsSince(start);
      if (shm < row.shm_ms) {
        row.shm_ms = shm;
        row.shm_copy_in_ms = copy_in;
      }
    }
    // Paced by a simulated prefill (sleeping, so the cores are free as they would be with the
    // source model on a GPU): what pipelining is for.
    row.prefill_ms = row.compute_ms;
    const auto per_layer = std::chrono::duration<double, std::milli>(row.prefill_ms / layers);
    for (int rep = 0; rep < absl::GetFlag(FLAGS_reps); ++rep) {
      for (Client* client : {plain_client.get(), piped_client.get()}) {
        HostCache* recycled = client == plain_client.get() ? &plain_recycled : &piped_recycled;
        const Clock::time_point start = Clock::now();
        absl::StatusOr<std::unique_ptr<TranslateStream>> stream =
            client->StartTranslate(header, source, recycling(recycled));
        if (!stream.ok()) return 9;
        for (int l = 0; l < layers; ++l) {
          std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                    per_layer * (l + 1)));
          if (!(*stream)->PushLayer(l, source.k[l].data(), source.v[l].data()).ok()) return 10;
        }
        absl::StatusOr<TranslateResult> result = (*stream)->Finish();
        if (!result.ok()) return 11;
        *recycled = std::move(result->target);
        double& best = client == plain_client.get() ? row.paced_inline_ms : row.paced_pipelined_ms;
        best = std::min(best, MsSince(start));
      }
    }
    if (!plain_client->UnregisterSystemMemory("").ok()) return 8;
    rows.push_back(row);
    std::fprintf(stderr, "T=%lld done\n", static_cast<long long>(row.tokens));
  }

  std::printf(
      "Layers %d -> %d, k=%d (sigma drawn at random by the synth preset), 8 KV heads x 128 (Qwen3-14B -> Qwen3-32B shapes), bf16, NHD, "
      "chunk %lld bytes, best of %d.\n\n",
      layers, layers, absl::GetFlag(FLAGS_k),
      static_cast<long long>(absl::GetFlag(FLAGS_chunk_bytes)), absl::GetFlag(FLAGS_reps));
  std::printf(
      "| T | source MB | memcpy ms | compute ms | inline ms | pipelined ms (first layer) | shm ms "
      "(copy-in) | shm / compute | inline / compute | pipelined / inline |\n"
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    std::printf("| %lld | %.0f | %.1f | %.0f | %.0f | %.0f (%.0f) | %.0f (%.1f) | %.3f | %.2f | %.2f |\n",
                static_cast<long long>(r.tokens), r.source_mb, r.memcpy_ms, r.compute_ms,
                r.inline_ms, r.pipelined_ms, r.pipelined_first_ms, r.shm_ms, r.shm_copy_in_ms,
                r.shm_ms / r.compute_ms, r.inline_ms / r.compute_ms,
                r.pipelined_ms / r.inline_ms);
  }
  std::printf(
      "\n| T | memcpy GB/s | raw TCP loopback GB/s | inline receive GB/s (stage_in) | inline send "
      "GB/s (stage_out) | raw TCP / memcpy | inline receive / memcpy | inline receive / raw TCP | "
      "shm copy-in GB/s | inline stage_in + compute + stage_out ms | pipelined ms |\n"
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    const double memcpy_gbs = r.source_mb / 1e3 / (r.memcpy_ms / 1e3);
    const double tcp_gbs = r.source_mb / 1e3 / (r.raw_tcp_ms / 1e3);
    const double in_gbs = r.source_mb / 1e3 / (r.inline_in_ms / 1e3);
    const double out_gbs = r.source_mb / 1e3 / (r.inline_out_ms / 1e3);
    std::printf("| %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.0f |\n",
                static_cast<long long>(r.tokens), memcpy_gbs, tcp_gbs, in_gbs, out_gbs,
                tcp_gbs / memcpy_gbs, in_gbs / memcpy_gbs, in_gbs / tcp_gbs,
                r.source_mb / 1e3 / (r.shm_copy_in_ms / 1e3),
                r.inline_in_ms + r.inline_compute_ms + r.inline_out_ms, r.pipelined_ms);
  }
  std::printf(
      "\n| T | prefill ms (paced pushes) | inline ms after prefill start | pipelined ms after "
      "prefill start | pipelined / inline | inline - prefill | pipelined - prefill |\n"
      "|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    std::printf("| %lld | %.0f | %.0f | %.0f | %.2f | %.0f | %.0f |\n",
                static_cast<long long>(r.tokens), r.prefill_ms, r.paced_inline_ms,
                r.paced_pipelined_ms, r.paced_pipelined_ms / r.paced_inline_ms,
                r.paced_inline_ms - r.prefill_ms, r.paced_pipelined_ms - r.prefill_ms);
  }
  return 0;
}

}  // namespace
}  // namespace kvt

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // As kvtd does, before any thread starts.
  if (absl::GetFlag(FLAGS_tune_allocator)) kvt::TuneAllocatorForCacheTraffic();
  kvt::SetMinLogLevel(kvt::LogLevel::kWarning);  // one line per request would drown the table
  return kvt::Run();
}
