#include "common/file_util.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace kvt {

std::string JoinPath(absl::string_view a, absl::string_view b) {
  if (a.empty() || (!b.empty() && b.front() == '/')) return std::string(b);
  if (b.empty()) return std::string(a);
  if (a.back() == '/') return absl::StrCat(a, b);
  return absl::StrCat(a, "/", b);
}

std::string Basename(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos || path.size() == 1) return std::string(path);
  return std::string(path.substr(slash + 1));
}

std::string Dirname(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

absl::Status ErrnoStatus(int errno_value, absl::string_view what, absl::string_view path) {
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(errno_value));
  switch (errno_value) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case EEXIST:
    case ENOTEMPTY:
      return absl::AlreadyExistsError(message);
    case ENOSPC:
    case ENOMEM:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, "cannot read", path);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return contents;
}

absl::Status WriteStringToFile(const std::string& path, absl::string_view contents) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, "cannot create", path);
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, "cannot write", path);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, "cannot fsync", path);
  }
  if (::close(fd) != 0) return ErrnoStatus(errno, "cannot close", path);
  return absl::OkStatus();
}

bool PathExists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

bool IsDirectory(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec);
}

absl::StatusOr<uint64_t> FileSize(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "cannot stat", path);
  return static_cast<uint64_t>(st.st_size);
}

absl::Status MakeDirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return ErrnoStatus(ec.value(), "cannot create directory", path);
  return absl::OkStatus();
}

absl::Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return ErrnoStatus(ec.value(), "cannot remove", path);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), "cannot list directory", dir);
  std::vector<std::string> names;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  if (ec) return ErrnoStatus(ec.value(), "cannot list directory", dir);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<std::vector<std::string>> ListSubdirectories(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir);
  if (!names.ok()) return names.status();
  std::vector<std::string> subdirectories;
  for (std::string& name : *names) {
    if (IsDirectory(JoinPath(dir, name))) subdirectories.push_back(std::move(name));
  }
  return subdirectories;
}

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open directory", dir);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems (tmpfs on old kernels, some FUSE mounts) refuse fsync on directories;
  // durability is then out of our hands and not an error.
  if (rc != 0 && err != EINVAL && err != ENOTSUP) return ErrnoStatus(err, "cannot fsync", dir);
  return absl::OkStatus();
}

}  // namespace kvt
