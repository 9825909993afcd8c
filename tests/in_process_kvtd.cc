#include "tests/in_process_kvtd.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/cpu_backend.h"
#include "server/mapper_store_setup.h"

namespace kvt {

absl::StatusOr<std::unique_ptr<InProcessKvtd>> InProcessKvtd::Start(const std::string& store_dir,
                                                                    KvtdConfig config,
                                                                    InProcessKvtdOptions options) {
  config.server.listen_address = "127.0.0.1:0";
  config.mapper_store.path = store_dir;
  config.shutdown.drain_grace_seconds = options.drain_grace_seconds;
  std::unique_ptr<InProcessKvtd> kvtd(new InProcessKvtd());
  kvtd->backend_ = options.backend ? std::move(options.backend) : NewCpuBackend();
  absl::StatusOr<std::unique_ptr<MapperStore>> store =
      options.store_as_kvtd_main
          ? MapperStore::Open(store_dir, MakeStoreOptions(config, kvtd->backend_.get()))
          : MapperStore::Open(store_dir);
  if (!store.ok()) return store.status();
  kvtd->store_ = std::move(*store);
  if (options.store_as_kvtd_main && config.mapper_store.reload_interval_seconds > 0) {
    kvtd->store_->StartPolling(absl::Seconds(config.mapper_store.reload_interval_seconds));
  }
  absl::StatusOr<std::unique_ptr<KvtdServer>> server =
      KvtdServer::Start(config, kvtd->store_.get(), kvtd->backend_.get());
  if (!server.ok()) return server.status();
  kvtd->server_ = std::move(*server);
  kvtd->address_ = absl::StrCat("127.0.0.1:", kvtd->server_->port());
  kvtd->client_ = kvtd->NewClient(options.client);
  return kvtd;
}

std::unique_ptr<Client> InProcessKvtd::NewClient(const ClientOptions& options) const {
  return Client::Create(address_, options);
}

std::unique_ptr<InProcessKvtd> StartKvtdForTest(const std::string& store_dir, KvtdConfig config,
                                                InProcessKvtdOptions options) {
  absl::StatusOr<std::unique_ptr<InProcessKvtd>> kvtd =
      InProcessKvtd::Start(store_dir, std::move(config), std::move(options));
  if (!kvtd.ok()) {
    ADD_FAILURE() << "kvtd over " << store_dir << " did not start: " << kvtd.status();
    return nullptr;
  }
  return std::move(*kvtd);
}

std::string SynthStoreForTest(const std::string& name, const SynthOptions& options) {
  static std::mutex mutex;
  static std::map<std::string, bool>* written = new std::map<std::string, bool>();
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(root ? root : "/tmp", "/", name);
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, first] = written->emplace(name, false);
  if (first) it->second = WriteSynthMapper(dir + "/m", options).ok();
  EXPECT_TRUE(it->second) << "writing the synthetic mapper of " << dir;
  return dir;
}

}  // namespace kvt
