#include "server/auth.h"

#include "gtest/gtest.h"

namespace kvt {
namespace {

constexpr char kTokens[] =
    "# kvtd tokens\n"
    "router-token-0123456789 client\n"
    "\n"
    "  admin-token-abcdefghijk   admin  \n";

TEST(AuthTest, RolesAndErrors) {
  absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::FromText(kTokens, "t");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE((*auth)->enabled());
  EXPECT_EQ((*auth)->num_tokens(), 2u);
  const Authenticator& a = **auth;
  EXPECT_TRUE(a.AuthorizeHeader("Bearer router-token-0123456789", Role::kClient).ok());
  EXPECT_EQ(a.AuthorizeHeader("Bearer router-token-0123456789", Role::kAdmin).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(a.AuthorizeHeader("Bearer admin-token-abcdefghijk", Role::kAdmin).ok());
  EXPECT_TRUE(a.AuthorizeHeader("Bearer admin-token-abcdefghijk", Role::kClient).ok());
  EXPECT_EQ(a.AuthorizeHeader("Bearer router-token-012345678", Role::kClient).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);  // a prefix is not the token
  EXPECT_EQ(a.AuthorizeHeader("router-token-0123456789", Role::kClient).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(a.AuthorizeHeader("", Role::kClient).error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST(AuthTest, AllowAllAllowsEverything) {
  std::unique_ptr<Authenticator> auth = Authenticator::AllowAll();
  EXPECT_FALSE(auth->enabled());
  EXPECT_TRUE(auth->AuthorizeHeader("", Role::kAdmin).ok());
}

TEST(AuthTest, BadFilesNameTheLineButNeverTheToken) {
  auto bad_role = Authenticator::FromText("secret-secret-secret root\n", "tokens.txt");
  ASSERT_FALSE(bad_role.ok());
  EXPECT_NE(bad_role.status().message().find("tokens.txt:1"), std::string::npos);
  EXPECT_EQ(bad_role.status().message().find("secret-secret"), std::string::npos);
  auto short_token = Authenticator::FromText("\nshort client\n", "tokens.txt");
  ASSERT_FALSE(short_token.ok());
  EXPECT_NE(short_token.status().message().find("tokens.txt:2"), std::string::npos);
  EXPECT_EQ(short_token.status().message().find("short"), std::string::npos);
  EXPECT_FALSE(Authenticator::FromText("# nothing\n", "tokens.txt").ok());
  EXPECT_EQ(Authenticator::FromFile("/nonexistent/tokens").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvt
