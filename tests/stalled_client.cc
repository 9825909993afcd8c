// Test helper: a client process that opens a TranslateKV stream on argv[1] for mapper argv[2],
// gets admitted (reads the response header), prints "admitted" and then stalls forever, so a
// test can kill it and drop the connection mid-stream.
#include <unistd.h>

#include <cstdio>

#include "client/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: stalled_client HOST:PORT MAPPER_ID\n");
    return 1;
  }
  std::unique_ptr<kvt::Client> client = kvt::Client::Create(argv[1]);
  grpc::ClientContext context;
  auto stream = client->stub()->TranslateKV(&context);
  kvt::v1::TranslateKVRequest request;
  kvt::v1::TranslateHeader* header = request.mutable_header();
  header->set_mapper_id(argv[2]);
  header->set_dtype(kvt::v1::DTYPE_BF16);
  header->set_layout(kvt::v1::LAYOUT_HND);
  header->set_num_tokens(64);
  kvt::v1::TranslateKVResponse response;
  if (!stream->Write(request) || !stream->Read(&response)) return 2;
  std::printf("admitted\n");
  std::fflush(stdout);
  while (true) pause();
}
