// TLS, mTLS and bearer-token auth end to end: certificates made by the openssl command in the
// test, a real kvtd (in process) and real channels.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "mapper_store/store.h"
#include "mapper_store/synth.h"
#include "server/kvtd_server.h"
#include "tests/in_process_kvtd.h"

namespace kvt {
namespace {

using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A CA, a server certificate for 127.0.0.1/localhost, a client certificate from the same CA,
// and a client certificate from an unrelated CA.
class Pki {
 public:
  explicit Pki(const std::string& dir) : dir_(dir) {
    const std::string script = absl::StrCat(
        "set -e; cd '", dir, "'\n",
        "ossl() { openssl \"$@\" 2>/dev/null; }\n",
        "ca() { ossl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=$1 -keyout $1.key "
        "-out $1.pem; }\n",
        "leaf() { ossl req -newkey rsa:2048 -nodes -subj /CN=$1 -keyout $1.key -out $1.csr; "
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > $1.ext; "
        "ossl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial -days 2 "
        "-extfile $1.ext -out $1.pem; }\n",
        "ca ca; ca rogue-ca; leaf server ca; leaf client ca; leaf rogue-client rogue-ca\n");
    EXPECT_EQ(std::system(absl::StrCat("bash -c \"$(cat <<'KVT_EOF'\n", script,
                                       "KVT_EOF\n)\"")
                              .c_str()),
              0);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string pem(const std::string& name) const { return ReadFile(path(name)); }

 private:
  std::string dir_;
};

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = new std::string(absl::StrCat(tmp ? tmp : "/tmp", "/security"));
    std::filesystem::remove_all(*dir_);
    std::filesystem::create_directories(*dir_ + "/pki");
    std::filesystem::create_directories(*dir_ + "/store");
    pki_ = new Pki(*dir_ + "/pki");
    absl::StatusOr<SynthOptions> preset = SynthPreset("demo-tiny");
    ASSERT_TRUE(preset.ok());
    ASSERT_TRUE(WriteSynthMapper(*dir_ + "/store/demo-tiny", *preset).ok());
    std::ofstream tokens(*dir_ + "/tokens");
    tokens << "# role per token\nrouter-token-0123456789 client\nadmin-token-abcdefghijk admin\n";
  }

  void StartServer(bool mtls, bool tokens) {
    KvtdConfig config;
    config.server.listen_address = "127.0.0.1:0";
    config.mapper_store.path = *dir_ + "/store";
    config.security.tls_cert_file = pki_->path("server.pem");
    config.security.tls_key_file = pki_->path("server.key");
    if (mtls) config.security.tls_client_ca_file = pki_->path("ca.pem");
    if (tokens) config.security.auth_token_file = *dir_ + "/tokens";
    ASSERT_TRUE(ValidateKvtdConfig(config).ok());
    kvtd_ = StartKvtdForTest(config.mapper_store.path, config);
    ASSERT_NE(kvtd_, nullptr);
  }

  std::unique_ptr<Client> Connect(const std::string& client_cert, const std::string& token,
                                  bool tls = true) {
    ClientOptions options;
    options.timeout = std::chrono::seconds(5);
    if (tls) {
      options.tls_root_ca_pem = pki_->pem("ca.pem");
      if (!client_cert.empty()) {
        options.tls_client_cert_pem = pki_->pem(client_cert + ".pem");
        options.tls_client_key_pem = pki_->pem(client_cert + ".key");
      }
    }
    options.bearer_token = token;
    return kvtd_->NewClient(options);
  }

  static std::string* dir_;
  static Pki* pki_;
  std::unique_ptr<InProcessKvtd> kvtd_;
};
std::string* SecurityTest::dir_ = nullptr;
Pki* SecurityTest::pki_ = nullptr;

TEST_F(SecurityTest, TlsServesTlsClientsAndRefusesPlaintext) {
  StartServer(/*mtls=*/false, /*tokens=*/false);
  absl::StatusOr<v1::ListMappersResponse> list = Connect("", "")->ListMappers();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->mappers_size(), 1);
  EXPECT_FALSE(Connect("", "", /*tls=*/false)->ListMappers().ok());
}

TEST_F(SecurityTest, MtlsNeedsAClientCertificateFromTheTrustedCa) {
  StartServer(/*mtls=*/true, /*tokens=*/false);
  absl::StatusOr<std::string> health = Connect("client", "")->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  EXPECT_FALSE(Connect("", "")->ListMappers().ok());              // no client certificate
  EXPECT_FALSE(Connect("rogue-client", "")->ListMappers().ok());  // signed by another CA
  EXPECT_FALSE(Connect("", "", /*tls=*/false)->ListMappers().ok());
}

TEST_F(SecurityTest, BearerTokensAndAdminRole) {
  StartServer(/*mtls=*/true, /*tokens=*/true);
  // Health stays open for Kubernetes probes.
  EXPECT_TRUE(Connect("client", "")->Health().ok());

  absl::StatusOr<v1::ListMappersResponse> none = Connect("client", "")->ListMappers();
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnauthenticated);
  absl::StatusOr<v1::ListMappersResponse> wrong =
      Connect("client", "router-token-0123456780")->ListMappers();
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(Connect("client", "router-token-0123456789")->ListMappers().ok());

  HostCache source;
  source.dtype = DType::kBF16;
  source.num_layers = 4;
  source.num_kv_heads = 2;
  source.head_dim = 32;
  source.num_tokens = 16;
  source.Allocate();
  v1::TranslateHeader header;
  header.set_mapper_id("demo-tiny");
  EXPECT_EQ(Connect("client", "")->Translate(header, source).status().code(),
            absl::StatusCode::kUnauthenticated);
  absl::StatusOr<TranslateResult> translated =
      Connect("client", "router-token-0123456789")->Translate(header, source);
  EXPECT_TRUE(translated.ok()) << translated.status();

  // Admin RPCs: a client token is not enough.
  auto admin_call = [this](const std::string& token) {
    std::unique_ptr<Client> client = Connect("client", token);
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer " + token);
    v1::RegisterSystemMemoryResponse response;
    return client->stub()->RegisterSystemMemory(&context, v1::RegisterSystemMemoryRequest(),
                                                &response);
  };
  EXPECT_EQ(admin_call("router-token-0123456789").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(admin_call("admin-token-abcdefghijk").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

// Every kvt.v1 RPC checks its caller: without a token UNAUTHENTICATED, and each admin RPC
// refuses a client token with PERMISSION_DENIED but lets an admin token through to its own
// validation (empty requests then fail with some other code, never an auth one).
TEST_F(SecurityTest, EveryRpcChecksTheCallersRole) {
  StartServer(/*mtls=*/false, /*tokens=*/true);
  const std::string kClientToken = "router-token-0123456789";
  const std::string kAdminToken = "admin-token-abcdefghijk";
  std::unique_ptr<Client> client = Connect("", "");
  v1::KvTranslator::Stub* stub = client->stub();
  // One call of an RPC with an empty request; the token is sent only when not empty.
  using Call = std::function<grpc::Status(grpc::ClientContext*)>;
  auto unary = [stub](auto method, auto request, auto response) -> Call {
    return [=](grpc::ClientContext* context) mutable {
      return (stub->*method)(context, request, &response);
    };
  };
  const std::vector<std::pair<std::string, Call>> admin_rpcs = {
      {"LoadMapper", unary(&v1::KvTranslator::Stub::LoadMapper, v1::LoadMapperRequest(),
                           v1::LoadMapperResponse())},
      {"UnloadMapper", unary(&v1::KvTranslator::Stub::UnloadMapper, v1::UnloadMapperRequest(),
                             v1::UnloadMapperResponse())},
      {"RegisterSystemMemory",
       unary(&v1::KvTranslator::Stub::RegisterSystemMemory, v1::RegisterSystemMemoryRequest(),
             v1::RegisterSystemMemoryResponse())},
      {"UnregisterSystemMemory",
       unary(&v1::KvTranslator::Stub::UnregisterSystemMemory,
             v1::UnregisterSystemMemoryRequest(), v1::UnregisterSystemMemoryResponse())},
      {"SystemMemoryStatus",
       unary(&v1::KvTranslator::Stub::SystemMemoryStatus, v1::SystemMemoryStatusRequest(),
             v1::SystemMemoryStatusResponse())},
      {"RegisterCudaMemory",
       unary(&v1::KvTranslator::Stub::RegisterCudaMemory, v1::RegisterCudaMemoryRequest(),
             v1::RegisterCudaMemoryResponse())},
      {"UnregisterCudaMemory",
       unary(&v1::KvTranslator::Stub::UnregisterCudaMemory, v1::UnregisterCudaMemoryRequest(),
             v1::UnregisterCudaMemoryResponse())},
      {"CudaMemoryStatus",
       unary(&v1::KvTranslator::Stub::CudaMemoryStatus, v1::CudaMemoryStatusRequest(),
             v1::CudaMemoryStatusResponse())},
  };
  const std::vector<std::pair<std::string, Call>> client_rpcs = {
      {"ListMappers", unary(&v1::KvTranslator::Stub::ListMappers, v1::ListMappersRequest(),
                            v1::ListMappersResponse())},
      {"GetMapper",
       unary(&v1::KvTranslator::Stub::GetMapper, v1::GetMapperRequest(), v1::MapperInfo())},
      {"ServerMetadata",
       unary(&v1::KvTranslator::Stub::ServerMetadata, v1::ServerMetadataRequest(),
             v1::ServerMetadataResponse())},
      {"TranslateKV",
       [stub](grpc::ClientContext* context) {
         auto stream = stub->TranslateKV(context);
         stream->WritesDone();
         v1::TranslateKVResponse response;
         while (stream->Read(&response)) {
         }
         return stream->Finish();
       }},
      {"ValidateKV",
       [stub](grpc::ClientContext* context) {
         v1::ValidateKVResponse response;
         auto stream = stub->ValidateKV(context, &response);
         stream->WritesDone();
         return stream->Finish();
       }},
  };
  auto call = [](const Call& rpc, const std::string& token) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    return rpc(&context);
  };
  for (const auto& [name, rpc] : admin_rpcs) {
    EXPECT_EQ(call(rpc, "").error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
    grpc::Status as_client = call(rpc, kClientToken);
    EXPECT_EQ(as_client.error_code(), grpc::StatusCode::PERMISSION_DENIED) << name;
    EXPECT_THAT(as_client.error_message(), HasSubstr("admin role")) << name;
    grpc::Status as_admin = call(rpc, kAdminToken);
    EXPECT_NE(as_admin.error_code(), grpc::StatusCode::PERMISSION_DENIED) << name;
    EXPECT_NE(as_admin.error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
  }
  for (const auto& [name, rpc] : client_rpcs) {
    grpc::Status anonymous = call(rpc, "");
    EXPECT_EQ(anonymous.error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
    // A wrong token never comes back in the error (nothing to replay or to learn from).
    grpc::Status wrong = call(rpc, "not-a-token-0000000000");
    EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
    EXPECT_THAT(wrong.error_message(), ::testing::Not(HasSubstr("not-a-token"))) << name;
    for (const std::string& token : {kClientToken, kAdminToken}) {
      grpc::Status allowed = call(rpc, token);
      EXPECT_NE(allowed.error_code(), grpc::StatusCode::PERMISSION_DENIED) << name;
      EXPECT_NE(allowed.error_code(), grpc::StatusCode::UNAUTHENTICATED) << name;
    }
  }
}

TEST_F(SecurityTest, MissingOrBadSecurityFilesStopTheServer) {
  KvtdConfig config;
  config.security.tls_cert_file = *dir_ + "/nope.pem";
  config.security.tls_key_file = pki_->path("server.key");
  const std::string store = *dir_ + "/store";
  absl::StatusOr<std::unique_ptr<InProcessKvtd>> server = InProcessKvtd::Start(store, config);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("security.tls_cert_file"));
  config.security.tls_cert_file = *dir_ + "/tokens";  // exists, not PEM
  server = InProcessKvtd::Start(store, config);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("not a PEM file"));
  config.security.tls_cert_file.clear();
  config.security.tls_key_file.clear();
  config.security.auth_token_file = *dir_ + "/missing-tokens";
  server = InProcessKvtd::Start(store, config);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("security.auth_token_file"));
  KvtdConfig half;
  half.security.tls_cert_file = "x.pem";
  EXPECT_FALSE(ValidateKvtdConfig(half).ok());
}

}  // namespace
}  // namespace kvt
