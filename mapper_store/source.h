// The mapper store's source: which mapper directories a root holds, a fingerprint that tells
// whether one changed since it was last read, and the thread that polls for changes (hot reload).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"

namespace kvt {

// Size, mtime and inode of every regular file in a mapper directory: any rewrite (even one
// that keeps sizes, or an atomic rename of a new directory) changes it.
struct Fingerprint {
  std::vector<std::tuple<std::string, uint64_t, int64_t, uint64_t>> files;  // sorted by name

  bool operator==(const Fingerprint& other) const { return files == other.files; }
  bool operator!=(const Fingerprint& other) const { return !(*this == other); }
  // Size of file `name`; 0 if it is not there.
  uint64_t FileSize(const std::string& name) const;
  uint64_t TotalSize() const;
};

// Where a mapper directory is recognised (it holds a manifest.yaml); the one place to teach
// other layouts.
bool IsMapperDirectory(const std::string& dir);

// The fingerprint of the regular files directly in `dir`.
absl::StatusOr<Fingerprint> FingerprintDirectory(const std::string& dir);

// Every mapper directory directly under `root`, by name, with its fingerprint. Names starting
// with '.' are skipped (WriteMapperDir's temporaries), and so are directories that vanish while
// they are read (the next scan sees the removal). NOT_FOUND if `root` is not a directory.
absl::StatusOr<std::map<std::string, Fingerprint>> ScanMapperDirectories(
    const std::string& root);

// The host bytes a load of weights file `weights_file` in `dir` will hold (what
// LoadedMapper::weight_bytes() will be): the data section of its safetensors header, or the
// file's size in `fingerprint` when the header does not parse (the loader then reports why).
uint64_t ExpectedWeightBytes(const std::string& dir, const std::string& weights_file,
                             const Fingerprint& fingerprint);

// Calls `poll` every interval on a background thread, from the first Start() until Stop() or
// destruction.
class Poller {
 public:
  explicit Poller(std::function<absl::Status()> poll) : poll_(std::move(poll)) {}
  ~Poller() { Stop(); }
  Poller(const Poller&) = delete;
  Poller& operator=(const Poller&) = delete;

  // Starts polling; a second call changes the interval.
  void Start(absl::Duration interval) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops and joins the thread (waiting for a poll in progress); idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  // The error of the last poll (OK when it succeeded or none ran).
  absl::Status last_status() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  const std::function<absl::Status()> poll_;
  // kvt::Mutex, as everywhere in the store: see store_state.h.
  mutable Mutex mu_;
  CondVar cv_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration interval_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  absl::Status last_status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // started by the first Start, under mu_
};

}  // namespace kvt
