#include "fit/progress.h"

#include <unistd.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvt {
namespace fit {

Progress::Progress(std::string what, int64_t total, std::string unit, FILE* out, int tty,
                   std::chrono::seconds log_interval)
    : what_(std::move(what)),
      unit_(std::move(unit)),
      total_(total),
      out_(out),
      tty_(tty < 0 ? isatty(fileno(out)) != 0 : tty != 0),
      log_interval_(log_interval),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() { Finish(); }

std::string Progress::FormatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
}

void Progress::Advance(int64_t units, int64_t tokens) {
  done_ += units;
  tokens_ += tokens;
  const auto now = std::chrono::steady_clock::now();
  // A terminal is redrawn often (cheap, in place); a log gets a line per interval, not per step.
  const auto interval = tty_ ? std::chrono::milliseconds(200)
                             : std::chrono::duration_cast<std::chrono::milliseconds>(log_interval_);
  if (done_ < total_ && now - last_draw_ < interval) return;
  last_draw_ = now;
  Draw(false);
}

void Progress::Finish() {
  if (finished_) return;
  finished_ = true;
  Draw(true);
}

void Progress::Draw(bool final) {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double fraction = total_ > 0 ? static_cast<double>(done_) / total_ : 1.0;
  const double eta = done_ > 0 ? elapsed * (total_ - done_) / done_ : NAN;
  const double rate = elapsed > 0 ? tokens_ / elapsed : 0;
  std::string counts = absl::StrFormat("%d/%d %s", done_, total_, unit_);
  if (tokens_ > 0) absl::StrAppendFormat(&counts, ", %d tokens (%.0f tok/s)", tokens_, rate);
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(fraction * kWidth);
    std::string bar(filled, '#');
    bar.append(kWidth - filled, '.');
    std::fprintf(out_, "\r\033[Kkvt fit: %s [%s] %3.0f%% %s %s %s", what_.c_str(), bar.c_str(),
                 100 * fraction, counts.c_str(), final ? "in" : "ETA",
                 FormatDuration(final ? elapsed : eta).c_str());
    if (final) std::fputc('\n', out_);
  } else if (final) {
    std::fprintf(out_, "kvt fit: %s done: %s in %s\n", what_.c_str(), counts.c_str(),
                 FormatDuration(elapsed).c_str());
  } else {
    std::fprintf(out_, "kvt fit: %s %.0f%%: %s, ETA %s\n", what_.c_str(), 100 * fraction,
                 counts.c_str(), FormatDuration(eta).c_str());
  }
  std::fflush(out_);
}

}  // namespace fit
}  // namespace kvt
