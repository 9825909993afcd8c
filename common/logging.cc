#include "common/logging.h"

#include <atomic>
#include <cstdio>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace kvt {
namespace {

std::atomic<int> g_min_level{static_cast<int>(LogLevel::kInfo)};

// kvt::Mutex (common/mutex.h): one line at a time on stderr, whichever thread logs.
Mutex& OutputMutex() {
  static Mutex* mutex = new Mutex();
  return *mutex;
}

}  // namespace

absl::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
  }
  return "info";
}

bool ParseLogLevel(absl::string_view name, LogLevel* level) {
  for (LogLevel candidate :
       {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError}) {
    if (name == LogLevelName(candidate)) {
      *level = candidate;
      return true;
    }
  }
  return false;
}

void SetMinLogLevel(LogLevel level) { g_min_level.store(static_cast<int>(level)); }

bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_min_level.load(); }

LogLine::LogLine(LogLevel level, absl::string_view message)
    : enabled_(LogEnabled(level)), fields_(nlohmann::json::object()) {
  if (!enabled_) return;
  fields_["ts"] = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  fields_["level"] = std::string(LogLevelName(level));
  fields_["msg"] = std::string(message);
}

LogLine::~LogLine() {
  if (!enabled_) return;
  // Invalid UTF-8 in a field (a client's request id, say) must not throw from a destructor.
  const std::string text =
      fields_.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  MutexLock lock(&OutputMutex());
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
}

}  // namespace kvt
