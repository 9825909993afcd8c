// Flags shared by the `kvt` subcommands that talk to a kvtd.
#pragma once

#include <cstdint>
#include <string>

#include <memory>

#include "absl/flags/declare.h"
#include "client/client.h"

ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(int64_t, timeout_ms);

namespace kvt {
namespace cli {

// A client of --server with the --timeout_ms deadline per call.
std::unique_ptr<Client> ConnectFromFlags();

}  // namespace cli
}  // namespace kvt
