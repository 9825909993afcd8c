// An in-process kvtd for the end-to-end tests: a mapper store opened over a directory, a
// backend, KvtdServer on an OS-chosen loopback port and a client of it, torn down server first.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "kernels/backend.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "server/config.h"
#include "server/kvtd_server.h"

namespace kvt {

struct InProcessKvtdOptions {
  // Null: NewCpuBackend().
  std::unique_ptr<Backend> backend;
  // Open the store the way kvtd_main does: MakeStoreOptions(config, backend), and polling when
  // mapper_store.reload_interval_seconds > 0. Otherwise MapperStore::Open's defaults.
  bool store_as_kvtd_main = false;
  // shutdown.drain_grace_seconds: by default a test does not wait for its server to stop.
  double drain_grace_seconds = 0;
  // For client().
  ClientOptions client;
};

class InProcessKvtd {
 public:
  // Serves `config` over `store_dir` (its mapper_store.path) on 127.0.0.1:0. The store's or the
  // server's error when either does not start.
  static absl::StatusOr<std::unique_ptr<InProcessKvtd>> Start(
      const std::string& store_dir, KvtdConfig config = KvtdConfig(),
      InProcessKvtdOptions options = InProcessKvtdOptions());

  InProcessKvtd(const InProcessKvtd&) = delete;
  InProcessKvtd& operator=(const InProcessKvtd&) = delete;

  KvtdServer& server() { return *server_; }
  MapperStore& store() { return *store_; }
  Backend& backend() { return *backend_; }
  const std::string& address() const { return address_; }
  // A client with InProcessKvtdOptions::client.
  Client& client() { return *client_; }
  std::unique_ptr<Client> NewClient(const ClientOptions& options = ClientOptions()) const;

 private:
  InProcessKvtd() = default;

  // In this order, so the server goes before the store it serves and the store before the
  // backend it prepared mappers on.
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<MapperStore> store_;
  std::unique_ptr<KvtdServer> server_;
  std::string address_;
  std::unique_ptr<Client> client_;
};

// InProcessKvtd::Start for a test body: a kvtd that does not start is a test failure (and null).
std::unique_ptr<InProcessKvtd> StartKvtdForTest(
    const std::string& store_dir, KvtdConfig config = KvtdConfig(),
    InProcessKvtdOptions options = InProcessKvtdOptions());

// A store directory under $TEST_TMPDIR/`name` holding one synthetic mapper "m" written from
// `options`, written once per process (later calls with the same name return the same
// directory); a failed write is a test failure.
std::string SynthStoreForTest(const std::string& name, const SynthOptions& options);

}  // namespace kvt
