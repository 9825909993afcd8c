// Small file helpers (POSIX where durability needs fsync, std::filesystem elsewhere): whole-file
// reads, durable writes, directory listing and removal, all returning absl::Status errors that
// name the path and the errno text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvt {

// "a" + "b" -> "a/b" (no doubled slash); an absolute `b` wins.
std::string JoinPath(absl::string_view a, absl::string_view b);
// Last component, ignoring trailing slashes: "/x/y/" -> "y".
std::string Basename(absl::string_view path);
// Everything before the last component: "/x/y" -> "/x", "y" -> ".".
std::string Dirname(absl::string_view path);

// Whole file into a string. NOT_FOUND if it does not exist.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// Creates or truncates `path`, writes `contents` and fsyncs it.
absl::Status WriteStringToFile(const std::string& path, absl::string_view contents);

bool PathExists(const std::string& path);
bool IsDirectory(const std::string& path);
absl::StatusOr<uint64_t> FileSize(const std::string& path);

// mkdir -p.
absl::Status MakeDirs(const std::string& path);
// rm -rf; OK if it does not exist.
absl::Status RemoveTree(const std::string& path);
// Names (not paths) of every entry of `dir` but "." and "..", sorted.
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir);
// Names (not paths) of the subdirectories of `dir`, sorted. Follows symlinks to directories.
absl::StatusOr<std::vector<std::string>> ListSubdirectories(const std::string& dir);
// fsync on a directory, so a rename inside it survives a crash.
absl::Status SyncDirectory(const std::string& dir);

// Status for a failed system call: "<what> <path>: <strerror(errno)>", code from errno.
absl::Status ErrnoStatus(int errno_value, absl::string_view what, absl::string_view path);

}  // namespace kvt
