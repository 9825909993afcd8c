#include "mapper_store/source.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "mapper_store/format/manifest.h"
#include "safetensors/safetensors.h"

namespace kvt {

uint64_t Fingerprint::FileSize(const std::string& name) const {
  for (const auto& file : files) {
    if (std::get<0>(file) == name) return std::get<1>(file);
  }
  return 0;
}

uint64_t Fingerprint::TotalSize() const {
  uint64_t total = 0;
  for (const auto& file : files) total += std::get<1>(file);
  return total;
}

bool IsMapperDirectory(const std::string& dir) {
  return PathExists(JoinPath(dir, kManifestFileName));
}

absl::StatusOr<Fingerprint> FingerprintDirectory(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir);
  if (!names.ok()) return names.status();
  Fingerprint fingerprint;
  for (const std::string& name : *names) {
    // stat rather than std::filesystem: the fingerprint needs the inode and nanosecond mtime.
    struct stat st;
    if (::stat(JoinPath(dir, name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    fingerprint.files.emplace_back(
        name, static_cast<uint64_t>(st.st_size),
        static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
        static_cast<uint64_t>(st.st_ino));
  }
  return fingerprint;
}

absl::StatusOr<std::map<std::string, Fingerprint>> ScanMapperDirectories(
    const std::string& root) {
  if (!IsDirectory(root)) {
    return absl::NotFoundError(
        absl::StrCat("mapper store directory ", root, " does not exist or is not a directory"));
  }
  absl::StatusOr<std::vector<std::string>> names = ListSubdirectories(root);
  if (!names.ok()) return names.status();
  std::map<std::string, Fingerprint> present;
  for (const std::string& name : *names) {
    if (name.empty() || name[0] == '.') continue;
    const std::string dir = JoinPath(root, name);
    if (!IsMapperDirectory(dir)) continue;
    absl::StatusOr<Fingerprint> fingerprint = FingerprintDirectory(dir);
    // Listed with no files when it raced with a removal: the next scan sees it gone.
    present[name] = fingerprint.ok() ? *std::move(fingerprint) : Fingerprint();
  }
  return present;
}

uint64_t ExpectedWeightBytes(const std::string& dir, const std::string& weights_file,
                             const Fingerprint& fingerprint) {
  absl::StatusOr<SafetensorsHeader> header = ReadSafetensorsHeader(JoinPath(dir, weights_file));
  return header.ok() ? header->data_size : fingerprint.FileSize(weights_file);
}

void Poller::Start(absl::Duration interval) {
  MutexLock lock(&mu_);
  interval_ = interval;
  if (!thread_.joinable() && !stopping_) thread_ = std::thread([this] { Loop(); });
  cv_.SignalAll();
}

void Poller::Stop() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  if (thread_.joinable()) thread_.join();
}

absl::Status Poller::last_status() const {
  MutexLock lock(&mu_);
  return last_status_;
}

void Poller::Loop() {
  UniqueLock lock(&mu_);
  while (!stopping_) {
    if (cv_.AwaitWithTimeout(&mu_, std::max(interval_, absl::Milliseconds(1)),
                             [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; })) {
      break;
    }
    lock.Unlock();
    absl::Status status = poll_();
    lock.Lock();
    last_status_ = status;
  }
}

}  // namespace kvt
