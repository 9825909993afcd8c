#include "server/translate/chunk_intake.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvt {

ChunkIntake::ChunkIntake(const TranslatePlan& plan, std::function<char*(int, int)> layer,
                         std::function<void(int, int)> arrived,
                         int64_t async_scatter_min_bytes)
    : plan_(plan),
      layer_(std::move(layer)),
      arrived_(std::move(arrived)),
      coverage_(plan.input_in_place() ? 0 : plan.source_model().num_layers, plan.num_tokens),
      expectation_{"chunk", absl::StrCat("source model ", plan.source_model().name),
                   plan.source_model().num_layers, plan.source_geometry, plan.input_dtype,
                   /*keys_only=*/false} {
  // Large inline uploads copy chunks out of gRPC's slices on a thread of their own, so the
  // reading thread goes straight back to the socket (transport.async_scatter_min_bytes).
  if (!plan.input_in_place() && async_scatter_min_bytes > 0 &&
      plan.source_bytes >= async_scatter_min_bytes) {
    scatter_worker_.emplace(kAsyncScatterQueueBytes);
  }
}

absl::Status ChunkIntake::ReadAll(const RequestReader& read, const std::function<bool()>& stop) {
  TranslateRequestMessage message;
  absl::Status status;
  while (!stop() && read(&message)) {
    status = Take(&message);
    if (!status.ok()) break;
  }
  // Every copy lands before anything reads the source or the buffers go (also on errors).
  if (scatter_worker_.has_value()) scatter_worker_->Drain();
  return status;
}

absl::Status ChunkIntake::Take(TranslateRequestMessage* message) {
  if (!message->error.ok()) return message->error;
  const v1::TranslateKVRequest& request = message->proto;
  if (request.has_header()) {
    return absl::InvalidArgumentError(
        "second header in the stream: a TranslateKV stream carries exactly one header");
  }
  if (!request.has_chunk()) {
    return absl::InvalidArgumentError("empty TranslateKVRequest: set header or chunk");
  }
  if (plan_.input_in_place()) {
    return absl::InvalidArgumentError(absl::StrCat(
        plan_.input_cached
            ? "header.input.cached is set: the source cache is the stored prefix"
            : "header.input.region is set: the source cache is read from the region",
        ", so the stream must carry no chunks"));
  }
  const v1::KVChunk& chunk = request.chunk();
  absl::StatusOr<int> checked =
      CheckChunk(chunk, static_cast<int64_t>(message->data.size()), expectation_);
  if (!checked.ok()) return checked.status();
  const int kind = *checked;
  if (absl::Status added =
          coverage_.Add(chunk.layer(), kind, chunk.token_start(), chunk.token_count());
      !added.ok()) {
    return added;
  }
  // The one copy a received byte makes: from gRPC's slices into the layer buffer. A source
  // layer counts as arrived once its last copy is done.
  std::function<void()> arrived;
  if (arrived_ && coverage_.KindComplete(chunk.layer(), kind)) {
    arrived = [this, layer = static_cast<int>(chunk.layer()), kind] { arrived_(layer, kind); };
  }
  char* layer = layer_(chunk.layer(), kind);
  if (scatter_worker_.has_value()) {
    scatter_worker_->Submit(plan_.source_geometry, chunk.token_start(), chunk.token_count(),
                            std::move(message->data), layer, std::move(arrived));
  } else {
    ScatterChunkBytes(plan_.source_geometry, chunk.token_start(), chunk.token_count(),
                      message->data, layer);
    if (arrived) arrived();
  }
  return absl::OkStatus();
}

absl::Status ChunkIntake::CheckComplete() const {
  if (coverage_.Complete()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "stream ended before every source chunk arrived: ", coverage_.FirstGap()));
}

}  // namespace kvt
