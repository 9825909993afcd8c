// Bearer-token authentication and roles for kvtd's RPCs: callers present
// "authorization: Bearer <token>"; tokens come from a file with a role each (client or admin);
// admin RPCs (mapper load/unload, memory registration) need the admin role.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"

namespace kvt {

enum class Role { kClient = 0, kAdmin = 1 };

class Authenticator {
 public:
  // Every call is allowed (no token file configured).
  static std::unique_ptr<Authenticator> AllowAll();
  // One "TOKEN ROLE" per line (ROLE: client | admin); blank lines and '#' comments ignored.
  // Tokens must be at least 16 characters of printable ASCII without spaces. Errors name the
  // line, never the token.
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromFile(const std::string& path);
  static absl::StatusOr<std::unique_ptr<Authenticator>> FromText(const std::string& text,
                                                                 const std::string& source);

  bool enabled() const { return enabled_; }
  size_t num_tokens() const { return tokens_.size(); }

  // OK; UNAUTHENTICATED when the call carries no or an unknown token; PERMISSION_DENIED when
  // its role is below `required`.
  grpc::Status Authorize(const grpc::ServerContext& context, Role required) const;
  // The same on a raw "authorization" header value (tests, other transports).
  grpc::Status AuthorizeHeader(const std::string& authorization, Role required) const;

 private:
  struct Token {
    std::array<unsigned char, 32> digest;  // SHA-256: compared in constant time, fixed length
    Role role;
  };
  bool enabled_ = false;
  std::vector<Token> tokens_;
};

}  // namespace kvt
