// Progress of a long `kvt fit` pass: a redrawn bar with ETA on a terminal, plain log lines (at
// most one per `log_interval`) when stderr is a file or a pipe.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvt {
namespace fit {

class Progress {
 public:
  // `total` units ("sequences", "layers") of work called `what` ("probe", "fit"). `tty` < 0:
  // ask isatty.
  Progress(std::string what, int64_t total, std::string unit = "sequences", FILE* out = stderr,
           int tty = -1,
           std::chrono::seconds log_interval = std::chrono::seconds(10));
  ~Progress();
  // `units` more done; `tokens` (if any) is shown as throughput.
  void Advance(int64_t units, int64_t tokens);
  // Final line (also written by the destructor if not called).
  void Finish();

  // "1m23s", "45s", "2h05m".
  static std::string FormatDuration(double seconds);

 private:
  void Draw(bool final);

  std::string what_, unit_;
  int64_t total_, done_ = 0, tokens_ = 0;
  FILE* out_;
  bool tty_;
  bool finished_ = false;
  std::chrono::seconds log_interval_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace fit
}  // namespace kvt
