// absl::Status <-> grpc::Status (canonical codes are numbered alike, messages bounded on the way
// out), and the status of a call its client abandoned.
#pragma once

#include <chrono>

#include "absl/status/status.h"
#include "common/echo.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace kvt {

// The message is cut to kMaxStatusMessageBytes: one over gRPC's metadata limit would reach the
// caller as RESOURCE_EXHAUSTED instead of the real code.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      Echo(status.message(), kMaxStatusMessageBytes));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

// The status of a call that stopped because the client went away or its deadline passed.
inline grpc::Status CancelledOrDeadline(grpc::ServerContext* context) {
  if (context->deadline() <= std::chrono::system_clock::now()) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        "deadline exceeded before the request finished");
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled the stream");
}

}  // namespace kvt
