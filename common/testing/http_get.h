// Test support: a minimal HTTP/1.0 GET client over TCP, so tests can read /metrics endpoints and
// Prometheus' query API on loopback without curl or an HTTP library.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace kvt {
namespace testing {

struct HttpResponse {
  int status = 0;    // e.g. 200
  std::string body;  // after the headers
};

// GET http://host:port/path_and_query. HTTP/1.0, so the server closes the connection after the
// body (no chunked encoding). UNAVAILABLE when it cannot connect, DEADLINE_EXCEEDED on timeout.
absl::StatusOr<HttpResponse> HttpGet(const std::string& host, int port,
                                     const std::string& path_and_query,
                                     absl::Duration timeout = absl::Seconds(5));

// Percent-encodes everything but unreserved characters (RFC 3986), for query parameters.
std::string UrlEncode(absl::string_view text);

}  // namespace testing
}  // namespace kvt
