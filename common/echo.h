// Bounded echoes of client-supplied values in error messages, so that a status always fits
// gRPC's metadata limit and reaches the caller with its real code.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace kvt {

// A request value (model name, lease id, mapper id, region name) as messages quote it.
inline constexpr size_t kMaxEchoBytes = 128;
// A whole status message as it leaves kvtd: far below gRPC's 16 KiB of metadata.
inline constexpr size_t kMaxStatusMessageBytes = 4096;

// `value` itself when it has at most `max_bytes` bytes; else its first bytes (cut on a UTF-8
// character boundary) and "...(N bytes)".
std::string Echo(absl::string_view value, size_t max_bytes = kMaxEchoBytes);

}  // namespace kvt
