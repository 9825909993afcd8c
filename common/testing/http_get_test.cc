#include "common/testing/http_get.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "gtest/gtest.h"

namespace kvt {
namespace testing {
namespace {

TEST(HttpGetTest, ReadsStatusAndBodyFromAServerThatClosesAfterTheBody) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t length = sizeof(address);
  getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  std::string request;
  std::thread server([&] {
    const int fd = accept(listener, nullptr, nullptr);
    char buffer[4096];
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    request.assign(buffer, n > 0 ? n : 0);
    const std::string reply = "HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\n\r\nnope\n";
    send(fd, reply.data(), reply.size(), 0);
    close(fd);
  });
  absl::StatusOr<HttpResponse> response =
      HttpGet("127.0.0.1", ntohs(address.sin_port), "/api?q=" + UrlEncode("a b{x=\"1\"}"));
  server.join();
  close(listener);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->status, 404);
  EXPECT_EQ(response->body, "nope\n");
  EXPECT_EQ(request.rfind("GET /api?q=a%20b%7Bx%3D%221%22%7D HTTP/1.0\r\n", 0), 0u) << request;
}

TEST(HttpGetTest, ConnectionRefusedIsUnavailable) {
  // Port 1 on loopback: nothing listens there in a test sandbox.
  EXPECT_EQ(HttpGet("127.0.0.1", 1, "/").status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace testing
}  // namespace kvt
