#include "server/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvt {
namespace {

std::array<unsigned char, 32> Sha256(const std::string& text) {
  std::array<unsigned char, 32> digest{};
  unsigned int length = 0;
  EVP_Digest(text.data(), text.size(), digest.data(), &length, EVP_sha256(), nullptr);
  return digest;
}

bool ValidToken(const std::string& token) {
  if (token.size() < 16) return false;
  for (char c : token) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

}  // namespace

std::unique_ptr<Authenticator> Authenticator::AllowAll() {
  return std::unique_ptr<Authenticator>(new Authenticator());
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("security.auth_token_file: cannot open '", path, "'"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return FromText(text.str(), path);
}

absl::StatusOr<std::unique_ptr<Authenticator>> Authenticator::FromText(const std::string& text,
                                                                       const std::string& source) {
  std::unique_ptr<Authenticator> auth(new Authenticator());
  auth->enabled_ = true;
  int line_number = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_number;
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ":", line_number, ": expected 'TOKEN ROLE' (role client or admin)"));
    }
    Token token;
    if (fields[1] == "client") {
      token.role = Role::kClient;
    } else if (fields[1] == "admin") {
      token.role = Role::kAdmin;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": role '",
                                                     fields[1], "' must be client or admin"));
    }
    if (!ValidToken(fields[0])) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ":", line_number,
          ": token must be at least 16 printable ASCII characters without spaces"));
    }
    token.digest = Sha256(fields[0]);
    auth->tokens_.push_back(token);
  }
  if (auth->tokens_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": no tokens (an empty token file would lock every caller out)"));
  }
  return auth;
}

grpc::Status Authenticator::Authorize(const grpc::ServerContext& context, Role required) const {
  if (!enabled_) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing 'authorization: Bearer <token>' metadata");
  }
  return AuthorizeHeader(std::string(it->second.data(), it->second.size()), required);
}

grpc::Status Authenticator::AuthorizeHeader(const std::string& authorization,
                                            Role required) const {
  if (!enabled_) return grpc::Status::OK;
  absl::string_view value = authorization;
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "authorization metadata must be 'Bearer <token>'");
  }
  const std::array<unsigned char, 32> presented = Sha256(std::string(value));
  // Every stored token is compared, in constant time, whatever matched first: the time taken
  // says nothing about which token (or how much of one) was right.
  int matched_role = -1;
  for (const Token& token : tokens_) {
    const bool equal = CRYPTO_memcmp(presented.data(), token.digest.data(), 32) == 0;
    matched_role = equal ? std::max(matched_role, static_cast<int>(token.role)) : matched_role;
  }
  if (matched_role < 0) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown bearer token");
  }
  if (matched_role < static_cast<int>(required)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "this RPC needs a token with the admin role");
  }
  return grpc::Status::OK;
}

}  // namespace kvt
