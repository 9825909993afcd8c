// SHA-256 digests (OpenSSL EVP) and the sha256sum-format SHA256SUMS file that guards the files of
// a mapper directory against partial copies and bit rot.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX, kept out of this header.

namespace kvt {

// Incremental SHA-256, so multi-GB weights are hashed while they stream through memory once.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const void* data, size_t size);
  void Update(absl::string_view bytes) { Update(bytes.data(), bytes.size()); }
  // Lower-case hex of the digest. Call once; INTERNAL if OpenSSL failed at any step.
  absl::StatusOr<std::string> HexDigest();

 private:
  evp_md_ctx_st* ctx_ = nullptr;
  bool ok_ = false;
};

absl::StatusOr<std::string> Sha256Hex(absl::string_view bytes);
absl::StatusOr<std::string> Sha256OfFile(const std::string& path);

// One line of SHA256SUMS: "<64 hex>  <filename>" (text mode) or "<64 hex> *<filename>" (binary
// mode), as `sha256sum` writes and `sha256sum -c` reads them.
struct ChecksumEntry {
  std::string hex;       // lower case
  std::string filename;  // a plain name inside the mapper directory
};

// Parses SHA256SUMS text. Blank lines are skipped; anything else malformed is an error naming the
// line. File names must be plain names (no '/', not "." or ".."): a checksum file must not make
// the loader read outside its directory.
absl::StatusOr<std::vector<ChecksumEntry>> ParseSha256Sums(absl::string_view text);
// Text-mode lines, one per entry, in the given order.
std::string FormatSha256Sums(const std::vector<ChecksumEntry>& entries);

}  // namespace kvt
