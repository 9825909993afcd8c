// `kvt health`, `kvt server-info` and `kvt mappers`: read-only calls to a running kvtd.
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "cli/commands.h"
#include "cli/flags.h"
#include "client/client.h"
#include "kernels/types.h"
#include "transport/proto_convert.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvtd address: host:port or unix:/path.");
ABSL_FLAG(int64_t, timeout_ms, 300000, "Deadline of each call, milliseconds.");

namespace kvt {
namespace cli {

std::unique_ptr<Client> ConnectFromFlags() {
  ClientOptions options;
  options.timeout = std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  return Client::Create(absl::GetFlag(FLAGS_server), options);
}

namespace {

void PrintMapper(const v1::MapperInfo& m) {
  std::printf("%-28s %s -> %s  kind=%s k=%u state=%s%s%s  %.1f MiB %s%s\n",
              m.mapper_id().c_str(), m.source_model().c_str(), m.target_model().c_str(),
              m.kind().c_str(), m.k(),
              v1::MapperState_Name(m.state()).substr(strlen("MAPPER_STATE_")).c_str(),
              m.state_reason().empty() ? "" : ": ", m.state_reason().c_str(),
              m.weight_bytes() / 1048576.0,
              m.weight_dtype() == v1::DTYPE_UNSPECIFIED
                  ? ""
                  : v1::DType_Name(m.weight_dtype()).substr(strlen("DTYPE_")).c_str(),
              m.synthetic() ? " (synthetic)" : "");
}

}  // namespace

int RunHealth(const std::vector<std::string>& args) {
  const std::string service = args.empty() ? "" : args[0];
  absl::StatusOr<std::string> status = ConnectFromFlags()->Health(service);
  if (!status.ok()) {
    std::fprintf(stderr, "kvt health: %s: %s\n", absl::GetFlag(FLAGS_server).c_str(),
                 status.status().ToString().c_str());
    return 2;
  }
  std::printf("%s %s\n", absl::GetFlag(FLAGS_server).c_str(), status->c_str());
  return *status == "SERVING" ? 0 : 2;
}

int RunServerInfo(const std::vector<std::string>& args) {
  absl::StatusOr<v1::ServerMetadataResponse> metadata = ConnectFromFlags()->ServerMetadata();
  const std::string server = absl::GetFlag(FLAGS_server);
  if (absl::IsUnimplemented(metadata.status())) {
    std::printf("%s: a kvtd older than ServerMetadata (no extensions)\n", server.c_str());
    return 0;
  }
  if (!metadata.ok()) {
    std::fprintf(stderr, "kvt server-info: %s: %s\n", server.c_str(),
                 metadata.status().ToString().c_str());
    return 2;
  }
  std::printf("%s: %s %s\n", server.c_str(), metadata->name().c_str(),
              metadata->version().c_str());
  for (const std::string& extension : metadata->extensions()) {
    std::printf("  %s\n", extension.c_str());
  }
  return 0;
}

int RunMappers(const std::vector<std::string>& args) {
  std::unique_ptr<Client> client = ConnectFromFlags();
  if (!args.empty() && args[0] == "restore") {
    if (args.size() != 2) {
      std::fprintf(stderr, "kvt mappers restore: expected exactly one MAPPER_ID\n");
      return 2;
    }
    absl::StatusOr<v1::RestoreMapperResponse> restored = client->RestoreMapper(args[1]);
    if (!restored.ok()) {
      std::fprintf(stderr, "kvt mappers restore: %s\n", restored.status().ToString().c_str());
      return 2;
    }
    std::printf("%s %s\n", args[1].c_str(),
                restored->restored() ? "restored to service" : "was not out of service");
    std::printf("%s", restored->verification().DebugString().c_str());
    return 0;
  }
  if (!args.empty()) {
    absl::StatusOr<v1::MapperInfo> info = client->GetMapper(args[0]);
    if (!info.ok()) {
      std::fprintf(stderr, "kvt mappers: %s\n", info.status().ToString().c_str());
      return 2;
    }
    std::printf("%s", info->DebugString().c_str());
    return 0;
  }
  absl::StatusOr<v1::ListMappersResponse> list = client->ListMappers();
  if (!list.ok()) {
    std::fprintf(stderr, "kvt mappers: %s\n", list.status().ToString().c_str());
    return 2;
  }
  if (list->mappers().empty()) std::printf("(no mappers)\n");
  for (const v1::MapperInfo& mapper : list->mappers()) PrintMapper(mapper);
  return 0;
}

}  // namespace cli
}  // namespace kvt
