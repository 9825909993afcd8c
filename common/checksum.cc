#include "common/checksum.h"

#include <openssl/evp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"

namespace kvt {

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  ok_ = ctx_ != nullptr && EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) == 1;
}

Sha256::~Sha256() { EVP_MD_CTX_free(ctx_); }

void Sha256::Update(const void* data, size_t size) {
  if (ok_ && size > 0) ok_ = EVP_DigestUpdate(ctx_, data, size) == 1;
}

absl::StatusOr<std::string> Sha256::HexDigest() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (!ok_ || EVP_DigestFinal_ex(ctx_, digest, &length) != 1 || length != 32) {
    ok_ = false;
    return absl::InternalError("OpenSSL SHA-256 failed");
  }
  ok_ = false;  // finalised: further updates would be meaningless
  static const char kHex[] = "0123456789abcdef";
  std::string hex(64, '0');
  for (unsigned int i = 0; i < length; ++i) {
    hex[2 * i] = kHex[digest[i] >> 4];
    hex[2 * i + 1] = kHex[digest[i] & 15];
  }
  return hex;
}

absl::StatusOr<std::string> Sha256Hex(absl::string_view bytes) {
  Sha256 hasher;
  hasher.Update(bytes);
  return hasher.HexDigest();
}

absl::StatusOr<std::string> Sha256OfFile(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) return contents.status();
  return Sha256Hex(*contents);
}

absl::StatusOr<std::vector<ChecksumEntry>> ParseSha256Sums(absl::string_view text) {
  std::vector<ChecksumEntry> entries;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("SHA256SUMS line ", line_number, ": ", why,
                                                     " (expected '<64 hex digits>  <file name>')"));
    };
    if (line.size() < 67) return bad("too short");
    ChecksumEntry entry;
    entry.hex = absl::AsciiStrToLower(line.substr(0, 64));
    for (char c : entry.hex) {
      if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return bad("digest is not hex");
    }
    if (line[64] != ' ' || (line[65] != ' ' && line[65] != '*')) {
      return bad("digest must be followed by two spaces or ' *'");
    }
    entry.filename = std::string(line.substr(66));
    if (entry.filename.empty() || entry.filename == "." || entry.filename == ".." ||
        entry.filename.find('/') != std::string::npos || entry.filename[0] == '\\') {
      return bad(absl::StrCat("file name '", entry.filename,
                              "' must be a plain name inside the mapper directory"));
    }
    for (const ChecksumEntry& previous : entries) {
      if (previous.filename == entry.filename) {
        return bad(absl::StrCat("file '", entry.filename, "' is listed twice"));
      }
    }
    entries.push_back(std::move(entry));
  }
  return entries;
}

std::string FormatSha256Sums(const std::vector<ChecksumEntry>& entries) {
  std::string text;
  for (const ChecksumEntry& entry : entries) absl::StrAppend(&text, entry.hex, "  ", entry.filename, "\n");
  return text;
}

}  // namespace kvt
