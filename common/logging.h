// Structured logging: one JSON object per line on stderr (ts, level, msg, and key/values such as
// request_id), so logs stay machine-readable in Kubernetes. Abseil 20220623 (Debian 12) has no
// absl/log, hence this small logger.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace kvt {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

absl::string_view LogLevelName(LogLevel level);
// Accepts debug, info, warning, error.
bool ParseLogLevel(absl::string_view name, LogLevel* level);

// Lines below this level are dropped. Default: info.
void SetMinLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

// One log line, written when it goes out of scope. Build with KVT_LOG(kInfo, "message").
class LogLine {
 public:
  LogLine(LogLevel level, absl::string_view message);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;

  template <typename T>
  LogLine& With(absl::string_view key, const T& value) {
    if (enabled_) fields_[std::string(key)] = value;
    return *this;
  }
  LogLine& With(absl::string_view key, absl::string_view value) {
    if (enabled_) fields_[std::string(key)] = std::string(value);
    return *this;
  }

 private:
  bool enabled_;
  nlohmann::json fields_;
};

}  // namespace kvt

#define KVT_LOG(level, message) ::kvt::LogLine(::kvt::LogLevel::level, message)
