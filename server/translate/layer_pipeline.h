// Step 4 of a TranslateKV: the layer pipeline. LayerArrivals knows which source layers are in
// and which target layer may compute next; LayerProducer computes target layers on the
// ComputeExecutor, double-buffered (layer l+1 computes while layer l is delivered), and hands
// each finished layer to a LayerSink; OutputThread runs the producer beside chunk intake
// (pipelined mode) and abandons it cleanly on errors or cancellation.
#pragma once

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "grpcpp/support/status.h"
#include "kernels/backend.h"
#include "kernels/mapper_view.h"
#include "server/compute_executor.h"
#include "server/translate/request_plan.h"
#include "server/translate/staging.h"
#include "transport/buffer_pool.h"

namespace kvt {

// Which source (layer, K|V) have arrived, and which target layers may compute: a target layer
// is ready once every source layer of its sigma lists is in. Thread-safe.
class LayerArrivals {
 public:
  // `layer_maps`: the mapper's target layers (must outlive this); `all_arrived`: the source is
  // complete from the start (read in place).
  LayerArrivals(const std::vector<LayerMapView>* layer_maps, int source_layers,
                bool all_arrived);

  void Arrived(int layer, int kind) ABSL_LOCKS_EXCLUDED(mutex_);
  void AllArrived() ABSL_LOCKS_EXCLUDED(mutex_);
  // Wakes a waiting producer and makes every later wait return -1.
  void Abort() ABSL_LOCKS_EXCLUDED(mutex_);

  // Target layers go in the order their sources complete (lowest index first among the ready
  // ones), not strictly 0, 1, ...: a mapper's sigma lists need not grow with depth. Each
  // returns a ready layer not taken before, and takes it.
  int TakeReadyNow() ABSL_LOCKS_EXCLUDED(mutex_);  // -1: none ready yet
  int WaitAndTake() ABSL_LOCKS_EXCLUDED(mutex_);   // blocks; -1: aborted

 private:
  bool SourcesArrived(int layer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  int FirstReady() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const std::vector<LayerMapView>* const layer_maps_;
  Mutex mutex_;
  CondVar changed_;
  std::vector<char> complete_ ABSL_GUARDED_BY(mutex_);  // [layer * 2 + kind]
  std::vector<char> taken_ ABSL_GUARDED_BY(mutex_);     // per target layer
  bool abort_ ABSL_GUARDED_BY(mutex_) = false;
};

// How the pipeline reports back to its stream.
struct StreamHooks {
  // A failure to log and end the stream with ("translate failed").
  std::function<grpc::Status(const absl::Status&)> fail;
  // The client has gone away or its deadline has passed ...
  std::function<bool()> cancelled;
  // ... and the status to end the stream with then (CANCELLED or DEADLINE_EXCEEDED).
  std::function<grpc::Status()> closed;
};

// Where finished target layers go (server/translate/response_writer.h has the real ones).
class LayerSink {
 public:
  virtual ~LayerSink() = default;
  // True: the producer computes target layers straight into InPlace() and allocates no layer
  // buffers; Deliver then gets null buffers.
  virtual bool in_place() const { return false; }
  virtual char* InPlace(int layer, int kind) { return nullptr; }
  // Target `layer` is computed, in `k` and `v` (shared with whoever keeps them, e.g. gRPC
  // slices, until they are released) or in place.
  virtual grpc::Status Deliver(int layer, const std::shared_ptr<LayerBuffer>& k,
                               const std::shared_ptr<LayerBuffer>& v) = 0;

  int64_t output_bytes() const { return output_bytes_; }
  double stage_out_ms() const { return stage_out_ms_; }  // time spent writing to the stream

 protected:
  int64_t output_bytes_ = 0;
  double stage_out_ms_ = 0;
};

// What the producer computes with; all of it outlives the producer.
struct ProducerInputs {
  const TranslatePlan* plan = nullptr;
  const CacheView* source = nullptr;
  ComputeMapper mapper;
  TranslateOptions options;
  absl::Time deadline = absl::InfiniteFuture();  // for a cold mapper's layers to arrive
  ComputeExecutor* compute = nullptr;
  BufferPool* buffers = nullptr;
};

// Computes and delivers every target layer: two slots in turn, the next layer computing on the
// executor while the sink takes this one. No compute task outlives Run().
class LayerProducer {
 public:
  LayerProducer(const ProducerInputs& inputs, LayerArrivals* arrivals, LayerSink* sink,
                StreamHooks hooks);

  // `while_first_computes` (optional) runs on this thread once the first layer is submitted.
  grpc::Status Run(const std::function<void()>& while_first_computes);

  double compute_ms() const { return compute_ms_; }
  // When the first target layer was handed to the sink; InfiniteFuture if none was.
  absl::Time first_output() const { return first_output_; }

 private:
  struct Slot {
    std::shared_ptr<LayerBuffer> k, v;  // shared with the gRPC slices sending them
    MutableCacheView view;
    double compute_ms = 0;
  };
  std::future<absl::Status> Submit(int layer, int slot_index);

  const ProducerInputs inputs_;
  LayerArrivals* const arrivals_;
  LayerSink* const sink_;
  const StreamHooks hooks_;
  Slot slots_[2];
  double compute_ms_ = 0;
  absl::Time first_output_ = absl::InfiniteFuture();
};

// Pipelined mode: the producer on a thread of its own while the caller reads chunks.
class OutputThread {
 public:
  // `discard` reads (and drops) one request message; Stop() uses it.
  OutputThread(LayerProducer* producer, LayerArrivals* arrivals, RequestReader discard);
  ~OutputThread() { Stop(); }
  OutputThread(const OutputThread&) = delete;
  OutputThread& operator=(const OutputThread&) = delete;

  // The producer has ended with an error: stop reading.
  bool failed() const { return failed_.load(); }
  // Every source layer is in: waits for the producer to finish; its status.
  grpc::Status Join();
  // Abandons the producer (its waits return) and waits for it. A client that writes everything
  // before it reads may still be writing; reading (and dropping) its messages lets a blocked
  // Write of the producer finish. The producer's status.
  grpc::Status Stop();

 private:
  LayerArrivals* const arrivals_;
  const RequestReader discard_;
  grpc::Status status_;
  std::atomic<bool> done_{false}, failed_{false};
  std::optional<std::thread> thread_;
};

}  // namespace kvt
