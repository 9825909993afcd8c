#include "server/translate/layer_pipeline.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

namespace kvt {
namespace {

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

}  // namespace

LayerArrivals::LayerArrivals(const std::vector<LayerMapView>* layer_maps, int source_layers,
                             bool all_arrived)
    : layer_maps_(layer_maps) {
  MutexLock lock(&mutex_);
  complete_.assign(2 * source_layers, all_arrived ? 1 : 0);
  taken_.assign(layer_maps->size(), 0);
}

void LayerArrivals::Arrived(int layer, int kind) {
  {
    MutexLock lock(&mutex_);
    complete_[2 * layer + kind] = 1;
  }
  changed_.SignalAll();
}

void LayerArrivals::AllArrived() {
  {
    MutexLock lock(&mutex_);
    std::fill(complete_.begin(), complete_.end(), 1);
  }
  changed_.SignalAll();
}

void LayerArrivals::Abort() {
  {
    MutexLock lock(&mutex_);
    abort_ = true;
  }
  changed_.SignalAll();
}

bool LayerArrivals::SourcesArrived(int layer) const {
  for (int s : (*layer_maps_)[layer].sigma_k) {
    if (!complete_[2 * s]) return false;
  }
  for (int s : (*layer_maps_)[layer].sigma_v) {
    if (!complete_[2 * s + 1]) return false;
  }
  return true;
}

int LayerArrivals::FirstReady() const {
  for (int layer = 0; layer < static_cast<int>(taken_.size()); ++layer) {
    if (!taken_[layer] && SourcesArrived(layer)) return layer;
  }
  return -1;
}

int LayerArrivals::TakeReadyNow() {
  MutexLock lock(&mutex_);
  const int layer = FirstReady();
  if (layer >= 0) taken_[layer] = 1;
  return layer;
}

int LayerArrivals::WaitAndTake() {
  MutexLock lock(&mutex_);
  int layer = -1;
  while (!abort_ && (layer = FirstReady()) < 0) changed_.Wait(&mutex_);
  if (abort_) return -1;
  taken_[layer] = 1;
  return layer;
}

LayerProducer::LayerProducer(const ProducerInputs& inputs, LayerArrivals* arrivals,
                             LayerSink* sink, StreamHooks hooks)
    : inputs_(inputs), arrivals_(arrivals), sink_(sink), hooks_(std::move(hooks)) {
  const TranslatePlan& plan = *inputs_.plan;
  const ModelSpec& tgt_model = plan.target_model();
  const int64_t layer_bytes = plan.target_geometry.layer_bytes();
  for (Slot& slot : slots_) {
    if (!sink_->in_place()) {
      slot.k = std::make_shared<LayerBuffer>(inputs_.buffers, layer_bytes);
      slot.v = std::make_shared<LayerBuffer>(inputs_.buffers, layer_bytes);
    }
    slot.view.dtype = plan.output_dtype;
    slot.view.layout = plan.output_layout;
    slot.view.num_kv_heads = tgt_model.num_kv_heads;
    slot.view.head_dim = tgt_model.head_dim;
    slot.view.num_tokens = plan.num_tokens;
    slot.view.k.assign(tgt_model.num_layers, nullptr);
    slot.view.v.assign(tgt_model.num_layers, nullptr);
  }
}

std::future<absl::Status> LayerProducer::Submit(int layer, int slot_index) {
  Slot& slot = slots_[slot_index];
  std::fill(slot.view.k.begin(), slot.view.k.end(), nullptr);
  std::fill(slot.view.v.begin(), slot.view.v.end(), nullptr);
  if (sink_->in_place()) {  // computed straight into the client's memory
    slot.view.k[layer] = sink_->InPlace(layer, 0);
    slot.view.v[layer] = sink_->InPlace(layer, 1);
  } else {
    // gRPC may still be sending the layer this slot held two layers ago: then that buffer
    // stays with its slices and the slot takes a fresh one. (A count of 1 is exact: only
    // this thread adds references.)
    const int64_t layer_bytes = inputs_.plan->target_geometry.layer_bytes();
    for (std::shared_ptr<LayerBuffer>* buffer : {&slot.k, &slot.v}) {
      if (buffer->use_count() > 1) {
        *buffer = std::make_shared<LayerBuffer>(inputs_.buffers, layer_bytes);
      }
    }
    slot.view.k[layer] = slot.k->bytes.get();
    slot.view.v[layer] = slot.v->bytes.get();
  }
  return inputs_.compute->Submit([this, &slot, layer] {
    const absl::Time begin = absl::Now();
    // A cold page-in streams per layer: this layer's weights may still be arriving.
    absl::Status status = inputs_.plan->handle.WaitLayerReady(layer, inputs_.deadline);
    if (status.ok()) {
      status = inputs_.mapper.backend->TranslateLayer(*inputs_.mapper.prepared, layer,
                                                      *inputs_.source, inputs_.plan->positions,
                                                      inputs_.options, &slot.view);
    }
    slot.compute_ms = Ms(absl::Now() - begin);
    return status;
  });
}

grpc::Status LayerProducer::Run(const std::function<void()>& while_first_computes) {
  std::optional<std::future<absl::Status>> pending;
  // Whatever happens below, no compute task may outlive the buffers it writes.
  struct WaitPending {
    std::optional<std::future<absl::Status>>* pending;
    ~WaitPending() {
      if (pending->has_value() && (*pending)->valid()) (*pending)->wait();
    }
  } wait_pending{&pending};
  const int num_layers = inputs_.plan->target_model().num_layers;
  int layer = arrivals_->WaitAndTake();
  if (layer < 0) return grpc::Status::CANCELLED;
  int slot_index = 0;
  pending = Submit(layer, slot_index);
  if (while_first_computes) while_first_computes();
  for (int done = 0; done < num_layers; ++done) {
    absl::Status computed = pending->get();
    pending.reset();
    if (!computed.ok()) return hooks_.fail(computed);
    Slot& slot = slots_[slot_index];
    compute_ms_ += slot.compute_ms;
    if (hooks_.cancelled()) return hooks_.closed();
    const bool has_next = done + 1 < num_layers;
    // The next layer's sources may still be on the wire: then this one goes out first.
    int next = has_next ? arrivals_->TakeReadyNow() : -1;
    if (next >= 0) pending = Submit(next, 1 - slot_index);

    if (first_output_ == absl::InfiniteFuture()) first_output_ = absl::Now();
    if (grpc::Status delivered = sink_->Deliver(layer, slot.k, slot.v); !delivered.ok()) {
      return delivered;
    }
    if (has_next && next < 0) {
      next = arrivals_->WaitAndTake();
      if (next < 0) return grpc::Status::CANCELLED;
      pending = Submit(next, 1 - slot_index);
    }
    layer = next;
    slot_index = 1 - slot_index;
  }
  return grpc::Status::OK;
}

OutputThread::OutputThread(LayerProducer* producer, LayerArrivals* arrivals,
                           RequestReader discard)
    : arrivals_(arrivals), discard_(std::move(discard)) {
  thread_.emplace([this, producer] {
    status_ = producer->Run(nullptr);
    if (!status_.ok()) failed_.store(true);
    done_.store(true);
  });
}

grpc::Status OutputThread::Join() {
  if (thread_.has_value()) {
    thread_->join();
    thread_.reset();
  }
  return status_;
}

grpc::Status OutputThread::Stop() {
  if (!thread_.has_value()) return status_;
  arrivals_->Abort();
  TranslateRequestMessage discard;
  while (!done_.load() && discard_(&discard)) {
  }
  thread_->join();
  thread_.reset();
  return status_;
}

}  // namespace kvt
