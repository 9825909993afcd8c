#include "server/translator_service.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "grpcpp/support/method_handler.h"
#include "server/grpc_status.h"
#include "server/mapper_store_setup.h"
#include "server/request_checks.h"
#include "kernels/cuda/ipc.h"
#include "transport/chunk_wire.h"
#include "transport/kv_chunks.h"
#include "transport/paged.h"
#include "transport/proto_convert.h"
#include "transport/scatter_worker.h"

namespace kvt {
namespace {

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

// Everything a TranslateKV stream needs once its header has been accepted.
struct TranslatePlan {
  std::string request_id;
  MapperHandle handle;  // pins the mapper (and its device copy) until the stream ends
  std::shared_ptr<const LoadedMapper> mapper;
  DType input_dtype;
  Layout input_layout;
  DType output_dtype;
  Layout output_layout;
  int64_t num_tokens = 0;
  Positions positions;
  int64_t response_chunk_tokens = 0;  // 0 = by bytes
  int64_t source_bytes = 0;
  int64_t target_bytes = 0;
};

// Most received chunk bytes waiting for a request's ScatterWorker.
constexpr int64_t kAsyncScatterQueueBytes = 64ll << 20;

// A whole-layer byte buffer, uninitialised (GBs of zeroing would be wasted work), from the
// service's pool: fresh memory costs a page fault and kernel zeroing per page on first touch.
struct LayerBuffer {
  struct Bytes {
    std::shared_ptr<BufferPool::Buffer> buffer;
    char* get() const { return buffer->data(); }
  } bytes;
  LayerBuffer(BufferPool* pool, int64_t size) : bytes{pool->Get(size)} {}
};

v1::MapperState StateToProto(MapperState state) {
  switch (state) {
    case MapperState::kDiscovered:
      return v1::MAPPER_STATE_DISCOVERED;
    case MapperState::kLoading:
      return v1::MAPPER_STATE_LOADING;
    case MapperState::kHostResident:
      return v1::MAPPER_STATE_HOST_RESIDENT;
    case MapperState::kDeviceResident:
      return v1::MAPPER_STATE_DEVICE_RESIDENT;
    case MapperState::kFailed:
      return v1::MAPPER_STATE_FAILED;
  }
  return v1::MAPPER_STATE_UNSPECIFIED;
}

void FillShape(const ModelSpec& model, v1::CacheShape* shape) {
  shape->set_num_layers(model.num_layers);
  shape->set_num_kv_heads(model.num_kv_heads);
  shape->set_head_dim(model.head_dim);
}

void FillMapperInfo(const MapperInfo& info, v1::MapperInfo* out) {
  out->set_mapper_id(info.id);
  out->set_source_model(info.source_model);
  out->set_target_model(info.target_model);
  out->set_kind(info.kind);
  out->set_k(info.k);
  out->set_state(StateToProto(info.state));
  out->set_state_reason(info.state_reason);
  out->set_weight_bytes(info.weight_bytes);
  if (info.state != MapperState::kFailed) out->set_weight_dtype(DTypeToProto(info.weight_dtype));
  FillShape(info.source, out->mutable_source_shape());
  FillShape(info.target, out->mutable_target_shape());
  for (const std::string& device : info.devices) out->add_devices(device);
  out->set_last_used_unix_ms(info.last_used_unix_ms);
  out->set_hits(info.hits);
  out->set_page_ins(info.page_ins);
  out->set_synthetic(info.synthetic);
  out->set_path(info.path);
  for (const Placement& placement : info.placements) {
    v1::Residency* residency = out->add_residency();
    residency->set_device(placement.device);
    residency->set_bytes(placement.bytes);
    residency->set_pins(static_cast<uint32_t>(placement.pins));
    residency->set_ready(placement.ready);
  }
  out->set_loads(info.loads);
  out->set_evictions(info.evictions);
  out->set_generation(info.generation);
}

}  // namespace

TranslatorService::TranslatorService(const KvtdConfig& config, MapperStore* store,
                                     Backend* backend, Metrics* metrics,
                                     const Authenticator* auth, PrefixCache* prefix_cache)
    : config_(config),
      store_(store),
      backend_(backend),
      metrics_(metrics),
      auth_(auth),
      admission_(config.limits.max_inflight_requests, config.limits.max_inflight_bytes),
      compute_(1),
      // Idle layer buffers kept for the next request: a quarter of what admitted requests may
      // hold, so an idle kvtd keeps at most that much.
      buffers_(BufferPool::Create(config.limits.max_inflight_bytes / 4)),
      prefix_cache_(prefix_cache) {
  // Method 0 of kvt.v1.KvTranslator is TranslateKV (service.proto lists it first).
  MarkMethodStreamed(
      0, new grpc::internal::BidiStreamingHandler<TranslatorService, TranslateRequestMessage,
                                                  TranslateResponseMessage>(
             [](TranslatorService* service, grpc::ServerContext* context,
                TranslateKVStreamType* stream) {
               return service->TranslateKVStream(context, stream);
             },
             this));
  // The backend computes on a device of the store; a store opened without one (tests, tools)
  // gets this backend as its device.
  const std::vector<std::string> devices = store_->DeviceNames();
  if (std::find(devices.begin(), devices.end(), backend_->device()) == devices.end()) {
    added_device_ =
        store_->AddDevice({backend_, DeviceBudgetBytes(config_, *backend_)}).ok();
  }
}

grpc::Status TranslatorService::SharedMemoryEnabled() const {
  if (config_.shared_memory.allow_client_regions) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "client shared memory is disabled on this server "
                      "(shared_memory.allow_client_regions: false)");
}

grpc::Status TranslatorService::Authorize(const grpc::ServerContext* context, Role role) const {
  if (auth_ == nullptr) return grpc::Status::OK;
  return auth_->Authorize(*context, role);
}

TranslatorService::~TranslatorService() {
  // The store may outlive this service and its backend: take back the device lent to it.
  if (added_device_) {
    absl::Status removed = store_->RemoveDevice(
        backend_->device(), absl::Now() + absl::Seconds(config_.shutdown.deadline_seconds));
    if (!removed.ok()) {
      KVT_LOG(kWarning, "mapper store device not removed").With("error", removed.message());
    }
  }
}

AcquireOptions TranslatorService::MapperWait(const grpc::ServerContext* context) const {
  AcquireOptions options;
  options.deadline =
      std::min(absl::FromChrono(context->deadline()),
               absl::Now() + absl::Seconds(config_.mapper_store.acquire_timeout_seconds));
  return options;
}

absl::StatusOr<TranslatorService::Derived> TranslatorService::Prepared(MapperHandle* handle,
                                                                       absl::Time deadline) {
  AcquireOptions options;
  options.deadline = deadline;
  options.device = "any";
  if (absl::Status pinned = store_->PinOnDevice(handle, options); !pinned.ok()) return pinned;
  Derived derived;
  derived.prepared = handle->prepared();
  derived.backend = handle->backend();
  derived.shift = shift_stats_.Get(handle->shared_mapper());
  return derived;
}

absl::StatusOr<PrefixLease> TranslatorService::TakePrefixLease(
    const v1::TranslateHeader& header) {
  if (prefix_cache_ == nullptr) {
    return absl::FailedPreconditionError(
        "header.input.cached: the prefix cache is disabled on this server "
        "(prefix_cache.enabled); send the source cache inline");
  }
  absl::StatusOr<PrefixLease> lease =
      prefix_cache_->Take(header.input().cached().lease_id());
  if (!lease.ok()) {
    return absl::Status(lease.status().code(),
                        absl::StrCat("header.input.cached.lease_id: ", lease.status().message()));
  }
  const PrefixEntry& entry = *lease->match().entry;
  if (header.num_tokens() != static_cast<uint64_t>(lease->match().tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.num_tokens=", header.num_tokens(), " but the leased prefix holds ",
        lease->match().tokens, " tokens (LookupPrefixResponse.matched_tokens)"));
  }
  if (header.position_offset() != 0 || header.positions_size() > 0) {
    return absl::InvalidArgumentError(
        "header.position_offset / header.positions: a stored prefix starts at position 0");
  }
  if (header.dtype() != DTypeToProto(entry.shape().dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.dtype=", v1::DType_Name(header.dtype()), " but the stored prefix is ",
        v1::DType_Name(DTypeToProto(entry.shape().dtype)), " (LookupPrefixResponse.dtype)"));
  }
  if (header.layout() != v1::LAYOUT_NHD) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.layout=", v1::Layout_Name(header.layout()),
        " but a stored prefix is LAYOUT_NHD (LookupPrefixResponse.layout)"));
  }
  return lease;
}

absl::Status TranslatorService::CheckLeaseFitsMapper(const PrefixLease& lease,
                                                     const MapperView& view) {
  const PrefixEntry& entry = *lease.match().entry;
  if (entry.model() != view.source.name) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.input.cached: the leased prefix is of model '", entry.model(),
        "' but mapper reads '", view.source.name,
        "'; use LookupPrefixResponse.mapper_id"));
  }
  const EntryShape& shape = entry.shape();
  if (shape.num_layers != view.source.num_layers || shape.num_kv_heads != view.source.num_kv_heads ||
      shape.head_dim != view.source.head_dim) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.input.cached: the stored prefix has ", shape.num_layers, " layers x ",
        shape.num_kv_heads, " heads x ", shape.head_dim, " but the mapper's source '",
        view.source.name, "' has ", view.source.num_layers, " x ", view.source.num_kv_heads,
        " x ", view.source.head_dim));
  }
  return absl::OkStatus();
}

std::string TranslatorService::RequestId(const std::string& from_header) {
  return from_header.empty() ? absl::StrCat("kvt-", next_request_id_.fetch_add(1)) : from_header;
}

grpc::Status TranslatorService::TranslateKVStream(grpc::ServerContext* context,
                                                 TranslateKVStreamType* stream) {
  TranslateRecord record;
  grpc::Status status = Authorize(context, Role::kClient);
  if (status.ok()) status = TranslateKVImpl(context, stream, &record);
  record.code = static_cast<absl::StatusCode>(status.error_code());
  if (metrics_ != nullptr) metrics_->RecordTranslate(record);
  return status;
}

grpc::Status TranslatorService::TranslateKVImpl(grpc::ServerContext* context,
                                               TranslateKVStreamType* stream,
                                               TranslateRecord* record) {
  const absl::Time start = absl::Now();
  TranslateRequestMessage message;
  if (!stream->Read(&message)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "stream ended before its header: send a TranslateHeader first");
  }
  if (!message.error.ok()) return ToGrpcStatus(message.error);
  const v1::TranslateKVRequest& request = message.proto;
  if (!request.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "first message must be a header (TranslateKVRequest.header)");
  }
  // Kept for the whole stream: explicit positions are read from it in place.
  const v1::TranslateHeader header = request.header();
  TranslatePlan plan;
  plan.request_id = RequestId(header.request_id());
  auto fail = [&](const absl::Status& status) {
    KVT_LOG(kWarning, "translate failed")
        .With("request_id", plan.request_id)
        .With("code", absl::StatusCodeToString(status.code()))
        .With("error", status.message());
    return ToGrpcStatus(status);
  };
  if (draining()) {
    return fail(absl::UnavailableError(
        "server is draining (shutting down); retry on another replica"));
  }

  // --- Header validation: every error names the field. ---
  absl::StatusOr<InputHeader> input = CheckInputHeader(header, config_.limits.max_tokens);
  if (!input.ok()) return fail(input.status());
  plan.input_dtype = input->dtype;
  plan.input_layout = input->layout;
  plan.num_tokens = input->num_tokens;
  plan.positions = input->positions;
  plan.output_dtype = plan.input_dtype;
  plan.output_layout = plan.input_layout;
  if (header.output_dtype() != v1::DTYPE_UNSPECIFIED) {
    absl::StatusOr<DType> dtype = DTypeFromProto(header.output_dtype(), "header.output_dtype");
    if (!dtype.ok()) return fail(dtype.status());
    plan.output_dtype = *dtype;
  }
  if (header.output_layout() != v1::LAYOUT_UNSPECIFIED) {
    absl::StatusOr<Layout> layout =
        LayoutFromProto(header.output_layout(), "header.output_layout");
    if (!layout.ok()) return fail(layout.status());
    plan.output_layout = *layout;
  }
  const bool input_in_region = header.input().has_region();
  const bool output_in_region = header.output().has_region();
  // A leased stored prefix is read in place, like a packed region: no chunks, no staging.
  const bool input_cached = header.input().has_cached();
  const bool input_in_place = input_in_region || input_cached;
  if (header.output().has_cached()) {
    return fail(absl::InvalidArgumentError(
        "header.output.cached: a stored prefix is an input only; set header.output.inline or "
        "header.output.region"));
  }
  PrefixLease prefix_lease;
  if (input_cached) {
    absl::StatusOr<PrefixLease> taken = TakePrefixLease(header);
    if (!taken.ok()) return fail(taken.status());
    prefix_lease = std::move(*taken);
  }
  // A paged region side is staged through whole-layer buffers: the backends read and write
  // contiguous layers.
  const bool input_paged = input_in_region && header.input().region().has_paged();
  const bool output_paged = output_in_region && header.output().region().has_paged();
  if ((input_in_region || output_in_region) && !config_.shared_memory.allow_client_regions) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        input_in_region ? "header.input.region" : "header.output.region",
        ": client shared memory is disabled on this server "
        "(shared_memory.allow_client_regions); send KV inline")));
  }
  plan.response_chunk_tokens = header.output().inline_().chunk_tokens();

  // --- Mapper. ---
  const AcquireOptions mapper_wait = MapperWait(context);
  absl::StatusOr<MapperHandle> mapper = AcquireMapper(store_, header, mapper_wait);
  if (!mapper.ok()) return fail(mapper.status());
  plan.handle = std::move(*mapper);
  plan.mapper = plan.handle.shared_mapper();
  const MapperView& view = plan.mapper->view();
  record->pair = PairLabels::Of(view);
  const ModelSpec& src_model = view.source;
  const ModelSpec& tgt_model = view.target;
  if (input_cached) {
    if (absl::Status matches = CheckLeaseFitsMapper(prefix_lease, view); !matches.ok()) {
      return fail(matches);
    }
  }

  const LayerGeometry source_geometry{plan.input_layout, src_model.num_kv_heads, plan.num_tokens,
                                      src_model.head_dim,
                                      static_cast<int64_t>(DTypeSize(plan.input_dtype))};
  const LayerGeometry target_geometry{plan.output_layout, tgt_model.num_kv_heads,
                                      plan.num_tokens, tgt_model.head_dim,
                                      static_cast<int64_t>(DTypeSize(plan.output_dtype))};
  plan.source_bytes = 2 * src_model.num_layers * source_geometry.layer_bytes();
  plan.target_bytes = 2 * tgt_model.num_layers * target_geometry.layer_bytes();
  if (plan.source_bytes + plan.target_bytes > config_.limits.max_request_bytes) {
    return fail(absl::ResourceExhaustedError(absl::StrCat(
        "header.num_tokens=", plan.num_tokens, " makes ", plan.source_bytes, " source + ",
        plan.target_bytes, " target cache bytes, over limits.max_request_bytes=",
        config_.limits.max_request_bytes, "; split the cache into several requests")));
  }

  // --- Shared-memory regions: leased for the whole request (an unregister waits for it). ---
  SystemMemoryRegistry::Lease input_region, output_region;
  PagedLayout input_pages, output_pages;
  // A paged side: its block table checked and `*pages` set; the bytes its region must hold.
  auto paged_bytes = [&](const v1::RegionRef& ref, const std::string& field, const ModelSpec& model,
                         const LayerGeometry& geometry, bool output,
                         PagedLayout* pages) -> absl::StatusOr<int64_t> {
    const v1::PagedBlocks& paged = ref.paged();
    *pages = PagedLayout{geometry.layout,     paged.num_blocks(), paged.block_size(),
                         geometry.num_heads, geometry.head_dim,  geometry.element_size};
    if (absl::Status table = CheckBlockTable(*pages, paged.block_table().data(),
                                             paged.block_table_size(), plan.num_tokens, output,
                                             field + ".paged");
        !table.ok()) {
      return table;
    }
    return model.num_layers * pages->layer_bytes();
  };
  auto lease = [&](const v1::RegionRef& ref, const char* field, int64_t expected,
                   SystemMemoryRegistry::Lease* out) -> absl::Status {
    if (ref.has_paged()) {
      const bool output = out == &output_region;
      absl::StatusOr<int64_t> bytes =
          output ? paged_bytes(ref, field, tgt_model, target_geometry, true, &output_pages)
                 : paged_bytes(ref, field, src_model, source_geometry, false, &input_pages);
      if (!bytes.ok()) return bytes.status();
      if (ref.byte_size() != static_cast<uint64_t>(*bytes)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".byte_size=", ref.byte_size(), " but the paged cache is ", *bytes,
            " bytes (per layer a (2, num_blocks, block_size, num_kv_heads, head_dim) tensor)"));
      }
    } else if (ref.byte_size() != static_cast<uint64_t>(expected)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".byte_size=", ref.byte_size(), " but the cache is ", expected,
          " bytes (layer-major, K then V per layer, in the request's layout and dtype)"));
    }
    // Names are unique across both registries (the Register RPCs refuse duplicates).
    const bool cuda = cuda_memory_.Contains(ref.region());
    if (cuda && ref.has_paged()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".paged: region '", ref.region(),
          "' is CUDA memory; the paged layout is read and written in system-memory regions only"));
    }
    absl::StatusOr<SystemMemoryRegistry::Lease> leased =
        cuda ? cuda_memory_.Acquire(ref.region(), ref.offset(), ref.byte_size(), field)
             : system_memory_.Acquire(ref.region(), ref.offset(), ref.byte_size(), field);
    if (!leased.ok()) return leased.status();
    *out = std::move(*leased);
    return absl::OkStatus();
  };
  if (input_in_region) {
    if (absl::Status s = lease(header.input().region(), "header.input.region", plan.source_bytes,
                               &input_region);
        !s.ok()) {
      return fail(s);
    }
  }
  if (output_in_region) {
    if (absl::Status s = lease(header.output().region(), "header.output.region",
                               plan.target_bytes, &output_region);
        !s.ok()) {
      return fail(s);
    }
  }

  // A CUDA region is staged through host memory, one copy each way: the engine here reads and
  // writes host memory.
  const bool input_cuda = input_region.device_id() >= 0;
  const bool output_cuda = output_region.device_id() >= 0;

  // --- Admission: the bytes this request makes kvtd hold: the inline source cache and two
  // target layers (double buffering) of inline output, host copies of CUDA regions. Other
  // region bytes live in the client. ---
  absl::StatusOr<AdmissionController::Ticket> ticket =
      admission_.TryAdmit((input_in_place && !input_paged ? 0 : plan.source_bytes) +
                          (output_in_region && !output_paged ? 0
                                                             : 4 * target_geometry.layer_bytes()) +
                          (input_cuda ? plan.source_bytes : 0) +
                          (output_cuda ? plan.target_bytes : 0));
  if (!ticket.ok()) return fail(ticket.status());
  absl::StatusOr<Derived> prepared = Prepared(&plan.handle, mapper_wait.deadline);
  if (!prepared.ok()) return fail(prepared.status());
  const absl::Time admitted = absl::Now();
  const char* input_base = input_region.data();
  char* output_base = output_region.data();
  std::unique_ptr<LayerBuffer> input_host, output_host;
  if (input_cuda) {
    input_host = std::make_unique<LayerBuffer>(buffers_.get(), plan.source_bytes);
    if (absl::Status copied = cuda::CopyToHost(input_region.device_id(), input_region.data(),
                                               input_host->bytes.get(), plan.source_bytes);
        !copied.ok()) {
      return fail(copied);
    }
    input_base = input_host->bytes.get();
  }
  if (output_cuda) {
    output_host = std::make_unique<LayerBuffer>(buffers_.get(), plan.target_bytes);
    output_base = output_host->bytes.get();
  }

  KVT_LOG(kInfo, "translate start")
      .With("request_id", plan.request_id)
      .With("mapper", plan.mapper->id())
      .With("tokens", plan.num_tokens)
      .With("session_id", header.session_id())
      .With("turn", header.turn());

  {
    TranslateResponseMessage response;
    v1::TranslateResponseHeader* out = response.proto.mutable_header();
    out->set_request_id(plan.request_id);
    out->set_mapper_id(plan.mapper->id());
    out->set_source_model(src_model.name);
    out->set_target_model(tgt_model.name);
    out->mutable_target_shape()->set_num_layers(tgt_model.num_layers);
    out->mutable_target_shape()->set_num_kv_heads(tgt_model.num_kv_heads);
    out->mutable_target_shape()->set_head_dim(tgt_model.head_dim);
    out->set_output_dtype(DTypeToProto(plan.output_dtype));
    out->set_output_layout(LayoutToProto(plan.output_layout));
    out->set_num_tokens(plan.num_tokens);
    out->set_backend(prepared->backend->name());
    out->set_device(prepared->backend->device());
    if (!stream->Write(response)) return CancelledOrDeadline(context);
  }

  // --- Stage in: inline chunks into whole-layer buffers, or the cache already sits in the
  // input region (read in place, no copy). ---
  std::vector<LayerBuffer> source_k, source_v;
  if (!input_in_place || input_paged) {
    source_k.reserve(src_model.num_layers);
    source_v.reserve(src_model.num_layers);
    for (int l = 0; l < src_model.num_layers; ++l) {
      source_k.emplace_back(buffers_.get(), source_geometry.layer_bytes());
      source_v.emplace_back(buffers_.get(), source_geometry.layer_bytes());
    }
  }
  if (input_paged) {
    const uint32_t* table = header.input().region().paged().block_table().data();
    for (int l = 0; l < src_model.num_layers; ++l) {
      const char* layer = input_base + l * input_pages.layer_bytes();
      GatherPaged(input_pages, table, 0, layer, source_geometry, source_k[l].bytes.get());
      GatherPaged(input_pages, table, 1, layer, source_geometry, source_v[l].bytes.get());
    }
  }
  CacheView source;
  source.dtype = plan.input_dtype;
  source.layout = plan.input_layout;
  source.num_kv_heads = src_model.num_kv_heads;
  source.head_dim = src_model.head_dim;
  source.num_tokens = plan.num_tokens;
  const int64_t source_layer_bytes = source_geometry.layer_bytes();
  const int64_t target_layer_bytes = target_geometry.layer_bytes();
  const CacheView cached_view =
      input_cached ? prefix_lease.View() : CacheView{};
  for (int l = 0; l < src_model.num_layers; ++l) {
    if (input_cached) {
      source.k.push_back(cached_view.k[l]);
      source.v.push_back(cached_view.v[l]);
    } else if (input_in_region && !input_paged) {  // layer-major, K then V
      source.k.push_back(input_base + (2 * l) * source_layer_bytes);
      source.v.push_back(input_base + (2 * l + 1) * source_layer_bytes);
    } else {
      source.k.push_back(source_k[l].bytes.get());
      source.v.push_back(source_v[l].bytes.get());
    }
  }

  // Layer pipelining: with inline input of at least transport.pipeline_min_tokens tokens, an
  // output thread computes target layer l as soon as the source layers of its sigma lists have
  // arrived and streams it back while this thread still reads the rest. Below the threshold the
  // extra thread and handoffs cost more than the overlap gains, so everything arrives first.
  const bool pipelined =
      !input_in_place && plan.num_tokens >= config_.transport.pipeline_min_tokens;
  struct Arrivals {
    std::mutex mutex;
    std::condition_variable changed;
    std::vector<char> complete ABSL_GUARDED_BY(mutex);  // [layer * 2 + kind]
    bool abort ABSL_GUARDED_BY(mutex) = false;
  } arrivals;
  arrivals.complete.assign(2 * src_model.num_layers, input_in_place ? 1 : 0);
  const std::vector<LayerMapView>& layer_maps = view.layers;
  // Under arrivals.mutex: every source layer that target `layer` reads has arrived.
  auto sources_arrived = [&](int layer) {
    for (int s : layer_maps[layer].sigma_k) {
      if (!arrivals.complete[2 * s]) return false;
    }
    for (int s : layer_maps[layer].sigma_v) {
      if (!arrivals.complete[2 * s + 1]) return false;
    }
    return true;
  };
  // Target layers go in the order their sources complete (lowest index first among the
  // ready ones), not strictly 0, 1, ...: a mapper's sigma lists need not grow with depth.
  std::vector<char> submitted(tgt_model.num_layers, 0);  // output thread only
  auto first_ready = [&]() {  // under arrivals.mutex; -1: none yet
    for (int layer = 0; layer < tgt_model.num_layers; ++layer) {
      if (!submitted[layer] && sources_arrived(layer)) return layer;
    }
    return -1;
  };
  auto ready_now = [&]() {
    std::lock_guard<std::mutex> lock(arrivals.mutex);
    return first_ready();
  };
  auto wait_ready = [&]() {  // -1: the request is being abandoned
    std::unique_lock<std::mutex> lock(arrivals.mutex);
    int layer = -1;
    arrivals.changed.wait(lock, [&] { return arrivals.abort || (layer = first_ready()) >= 0; });
    return arrivals.abort ? -1 : layer;
  };

  // --- Compute the next layer on the compute executor while this one streams out. ---
  struct Slot {
    std::shared_ptr<LayerBuffer> k, v;  // shared with the gRPC slices sending them
    MutableCacheView view;
    double compute_ms = 0;
  };
  Slot slots[2];
  for (Slot& slot : slots) {
    if (!output_in_region || output_paged) {
      slot.k = std::make_shared<LayerBuffer>(buffers_.get(), target_layer_bytes);
      slot.v = std::make_shared<LayerBuffer>(buffers_.get(), target_layer_bytes);
    }
    slot.view.dtype = plan.output_dtype;
    slot.view.layout = plan.output_layout;
    slot.view.num_kv_heads = tgt_model.num_kv_heads;
    slot.view.head_dim = tgt_model.head_dim;
    slot.view.num_tokens = plan.num_tokens;
    slot.view.k.assign(tgt_model.num_layers, nullptr);
    slot.view.v.assign(tgt_model.num_layers, nullptr);
  }
  TranslateOptions options;
  options.token_chunk = config_.backend.token_chunk;
  const PreparedMapper* prepared_mapper = prepared->prepared;
  Backend* const compute_backend = prepared->backend;
  const absl::Time compute_deadline = absl::FromChrono(context->deadline());
  auto submit = [&](int layer, int slot_index) {
    submitted[layer] = 1;
    Slot& slot = slots[slot_index];
    std::fill(slot.view.k.begin(), slot.view.k.end(), nullptr);
    std::fill(slot.view.v.begin(), slot.view.v.end(), nullptr);
    if (output_in_region && !output_paged) {  // computed straight into the client's memory
      slot.view.k[layer] = output_base + (2 * layer) * target_layer_bytes;
      slot.view.v[layer] = output_base + (2 * layer + 1) * target_layer_bytes;
    } else {
      // gRPC may still be sending the layer this slot held two layers ago: then that buffer
      // stays with its slices and the slot takes a fresh one. (A count of 1 is exact: only
      // this thread adds references.)
      for (std::shared_ptr<LayerBuffer>* buffer : {&slot.k, &slot.v}) {
        if (buffer->use_count() > 1) {
          *buffer = std::make_shared<LayerBuffer>(buffers_.get(), target_layer_bytes);
        }
      }
      slot.view.k[layer] = slot.k->bytes.get();
      slot.view.v[layer] = slot.v->bytes.get();
    }
    return compute_.Submit([&slot, &source, &plan, &options, prepared_mapper, compute_backend,
                            compute_deadline, layer] {
      const absl::Time begin = absl::Now();
      // A cold page-in streams per layer: this layer's weights may still be arriving.
      absl::Status status = plan.handle.WaitLayerReady(layer, compute_deadline);
      if (status.ok()) {
        status = compute_backend->TranslateLayer(*prepared_mapper, layer, source,
                                                 plan.positions, options, &slot.view);
      }
      slot.compute_ms = Ms(absl::Now() - begin);
      return status;
    });
  };

  int64_t tokens_per_chunk = TokensPerChunk(target_geometry, config_.limits.response_chunk_bytes);
  if (plan.response_chunk_tokens > 0) {
    tokens_per_chunk = std::min(tokens_per_chunk, plan.response_chunk_tokens);
  }
  double compute_ms = 0, stage_out_ms = 0;
  int64_t output_bytes = 0;
  absl::Time first_output = absl::InfiniteFuture();
  std::optional<double> input_shift;
  // Computes and delivers every target layer; in pipelined mode on the output thread.
  auto produce = [&]() -> grpc::Status {
    std::optional<std::future<absl::Status>> pending;
    // Whatever happens below, no compute task may outlive the buffers it writes.
    struct WaitPending {
      std::optional<std::future<absl::Status>>* pending;
      ~WaitPending() {
        if (pending->has_value() && (*pending)->valid()) (*pending)->wait();
      }
    } wait_pending{&pending};
    int layer = wait_ready();
    if (layer < 0) return grpc::Status::CANCELLED;
    int slot_index = 0;
    pending = submit(layer, slot_index);
    // A pass over (a sample of) the source features: cheap next to the GEMMs, and it runs here
    // while layer 0 computes. Pipelined, the reading thread takes it once every layer is in.
    if (!pipelined && prepared->shift != nullptr) {
      input_shift = prepared->shift->Score(source, plan.positions);
    }
    TranslateResponseMessage response;
    for (int done = 0; done < tgt_model.num_layers; ++done) {
      absl::Status computed = pending->get();
      pending.reset();
      if (!computed.ok()) return fail(computed);
      Slot& slot = slots[slot_index];
      compute_ms += slot.compute_ms;
      if (context->IsCancelled()) return CancelledOrDeadline(context);
      const bool has_next = done + 1 < tgt_model.num_layers;
      // The next layer's sources may still be on the wire: then this one goes out first.
      int next = has_next ? ready_now() : -1;
      if (next >= 0) pending = submit(next, 1 - slot_index);

      if (first_output == absl::InfiniteFuture()) first_output = absl::Now();
      if (output_paged) {
        const uint32_t* table = header.output().region().paged().block_table().data();
        char* paged_layer = output_base + layer * output_pages.layer_bytes();
        ScatterPaged(output_pages, table, 0, slot.k->bytes.get(), target_geometry, paged_layer);
        ScatterPaged(output_pages, table, 1, slot.v->bytes.get(), target_geometry, paged_layer);
        output_bytes += 2 * target_layer_bytes;
      } else if (output_in_region) {
        if (output_cuda) {
          const int64_t at = 2 * layer * target_layer_bytes;
          if (absl::Status copied =
                  cuda::CopyToDevice(output_region.device_id(), output_base + at,
                                     output_region.data() + at, 2 * target_layer_bytes);
              !copied.ok()) {
            return fail(copied);
          }
        }
        output_bytes += 2 * target_layer_bytes;
      } else {
        const absl::Time send_begin = absl::Now();
        for (int kind = 0; kind < 2; ++kind) {
          // Zero-copy: the chunk's slices point into the layer buffer, which they keep alive
          // until gRPC has sent them (submit() never reuses a buffer gRPC still holds).
          const std::shared_ptr<LayerBuffer>& buffer = kind == 0 ? slot.k : slot.v;
          for (int64_t first = 0; first < plan.num_tokens; first += tokens_per_chunk) {
            const int64_t count = std::min(tokens_per_chunk, plan.num_tokens - first);
            v1::KVChunk* chunk = response.proto.mutable_chunk();
            chunk->set_layer(layer);
            chunk->set_kind(kind == 0 ? v1::CACHE_KIND_K : v1::CACHE_KIND_V);
            chunk->set_token_start(static_cast<uint32_t>(first));
            chunk->set_token_count(static_cast<uint32_t>(count));
            response.data =
                ChunkBytesOfLayer(target_geometry, first, count, buffer->bytes.get(), buffer);
            output_bytes += static_cast<int64_t>(response.data.size());
            if (!stream->Write(response)) return CancelledOrDeadline(context);
          }
        }
        response.data = ChunkBytes();
        stage_out_ms += Ms(absl::Now() - send_begin);
      }
      if (has_next && next < 0) {
        next = wait_ready();
        if (next < 0) return grpc::Status::CANCELLED;
        pending = submit(next, 1 - slot_index);
      }
      layer = next;
      slot_index = 1 - slot_index;
    }
    return grpc::Status::OK;
  };
  grpc::Status output_status;
  std::atomic<bool> output_done{false}, output_failed{false};
  std::optional<std::thread> output_thread;
  if (pipelined) {
    output_thread.emplace([&] {
      output_status = produce();
      if (!output_status.ok()) output_failed.store(true);
      output_done.store(true);
    });
  }
  // Stops the output thread (if any) and waits for it. A client that writes everything before
  // it reads may still be writing; reading (and dropping) its messages lets a blocked Write of
  // the output thread finish.
  auto stop_output = [&] {
    if (!output_thread.has_value()) return;
    {
      std::lock_guard<std::mutex> lock(arrivals.mutex);
      arrivals.abort = true;
    }
    arrivals.changed.notify_all();
    TranslateRequestMessage discard;
    while (!output_done.load() && stream->Read(&discard)) {
    }
    output_thread->join();
    output_thread.reset();
  };
  struct StopOutput {
    std::function<void()> stop;
    ~StopOutput() { stop(); }
  } stop_output_on_exit{stop_output};

  // Large inline uploads copy chunks out of gRPC's slices on a thread of their own, so this
  // one goes straight back to the socket (transport.async_scatter_min_bytes). Declared after
  // the layer buffers, so destroyed (drained) before them.
  std::optional<ScatterWorker> scatter_worker;
  const int64_t async_scatter_min_bytes = config_.transport.async_scatter_min_bytes;
  if (!input_in_place && async_scatter_min_bytes > 0 &&
      plan.source_bytes >= async_scatter_min_bytes) {
    scatter_worker.emplace(kAsyncScatterQueueBytes);
  }
  CoverageTracker coverage(input_in_place ? 0 : src_model.num_layers, plan.num_tokens);
  const ChunkExpectation chunk_expectation{"chunk", absl::StrCat("source model ", src_model.name),
                                           src_model.num_layers, source_geometry,
                                           plan.input_dtype, /*keys_only=*/false};
  auto read_chunks = [&]() -> absl::Status {
    while (!output_failed.load() && stream->Read(&message)) {
      if (!message.error.ok()) return message.error;
      if (request.has_header()) {
        return absl::InvalidArgumentError(
            "second header in the stream: a TranslateKV stream carries exactly one header");
      }
      if (!request.has_chunk()) {
        return absl::InvalidArgumentError("empty TranslateKVRequest: set header or chunk");
      }
      if (input_in_place) {
        return absl::InvalidArgumentError(absl::StrCat(
            input_cached ? "header.input.cached is set: the source cache is the stored prefix"
                         : "header.input.region is set: the source cache is read from the region",
            ", so the stream must carry no chunks"));
      }
      const v1::KVChunk& chunk = request.chunk();
      absl::StatusOr<int> checked =
          CheckChunk(chunk, static_cast<int64_t>(message.data.size()), chunk_expectation);
      if (!checked.ok()) return checked.status();
      const int kind = *checked;
      if (absl::Status added =
              coverage.Add(chunk.layer(), kind, chunk.token_start(), chunk.token_count());
          !added.ok()) {
        return added;
      }
      // The one copy a received byte makes: from gRPC's slices into the layer buffer. A
      // source layer counts as arrived for the pipeline once its last copy is done.
      std::function<void()> arrived;
      if (pipelined && coverage.KindComplete(chunk.layer(), kind)) {
        arrived = [&arrivals, index = 2 * chunk.layer() + kind] {
          {
            std::lock_guard<std::mutex> lock(arrivals.mutex);
            arrivals.complete[index] = 1;
          }
          arrivals.changed.notify_all();
        };
      }
      char* layer = (kind == 0 ? source_k : source_v)[chunk.layer()].bytes.get();
      if (scatter_worker.has_value()) {
        scatter_worker->Submit(source_geometry, chunk.token_start(), chunk.token_count(),
                               std::move(message.data), layer, std::move(arrived));
      } else {
        ScatterChunkBytes(source_geometry, chunk.token_start(), chunk.token_count(),
                          message.data, layer);
        if (arrived) arrived();
      }
    }
    return absl::OkStatus();
  };
  absl::Status read = read_chunks();
  // Every copy lands before anything reads the source or the buffers go (also on errors).
  if (scatter_worker.has_value()) scatter_worker->Drain();
  if (!read.ok()) {
    stop_output();
    return fail(read);
  }
  if (output_failed.load()) {
    stop_output();
    return output_status;
  }
  if (context->IsCancelled()) return CancelledOrDeadline(context);
  if (!coverage.Complete()) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "stream ended before every source chunk arrived: ", coverage.FirstGap())));
  }
  const absl::Time staged_in = absl::Now();

  if (pipelined) {
    // Every source layer is in; the output thread may still be computing.
    if (prepared->shift != nullptr) input_shift = prepared->shift->Score(source, plan.positions);
    output_thread->join();
    output_thread.reset();
  } else {
    std::fill(arrivals.complete.begin(), arrivals.complete.end(), 1);
    output_status = produce();
  }
  if (!output_status.ok()) return output_status;

  const absl::Time end = absl::Now();
  TranslateResponseMessage trailer_message;
  v1::TranslateTrailer* trailer = trailer_message.proto.mutable_trailer();
  trailer->set_request_id(plan.request_id);
  v1::StageTimings* timings = trailer->mutable_timings();
  timings->set_queue_ms(Ms(admitted - start));
  timings->set_stage_in_ms(Ms(staged_in - admitted));
  timings->set_compute_ms(compute_ms);
  timings->set_stage_out_ms(stage_out_ms);
  timings->set_total_ms(Ms(end - start));
  if (first_output != absl::InfiniteFuture()) {
    timings->set_first_output_ms(Ms(first_output - start));
  }
  trailer->set_pipelined(pipelined);
  trailer->set_num_tokens(plan.num_tokens);
  trailer->set_input_bytes(plan.source_bytes);
  trailer->set_output_bytes(output_bytes);
  // The caller's re-prefill estimate, else the target model's cost model from the config.
  double reprefill_ms = header.reprefill_estimate_ms();
  if (reprefill_ms <= 0) {
    auto cost = config_.metrics.prefill_cost.find(tgt_model.name);
    if (cost != config_.metrics.prefill_cost.end()) reprefill_ms = cost->second.Ms(plan.num_tokens);
  }
  if (reprefill_ms > 0 && timings->total_ms() > 0) {
    trailer->set_speedup_estimate(reprefill_ms / timings->total_ms());
    record->speedup = trailer->speedup_estimate();
  }
  if (input_shift.has_value()) trailer->set_input_shift_score(*input_shift);
  record->input_shift = input_shift;
  record->queue_s = timings->queue_ms() / 1000;
  record->stage_in_s = timings->stage_in_ms() / 1000;
  record->compute_s = compute_ms / 1000;
  record->stage_out_s = stage_out_ms / 1000;
  record->total_s = timings->total_ms() / 1000;
  record->tokens = plan.num_tokens;
  if (!stream->Write(trailer_message)) return CancelledOrDeadline(context);

  KVT_LOG(kInfo, "translate done")
      .With("request_id", plan.request_id)
      .With("mapper", plan.mapper->id())
      .With("tokens", plan.num_tokens)
      .With("queue_ms", timings->queue_ms())
      .With("stage_in_ms", timings->stage_in_ms())
      .With("compute_ms", compute_ms)
      .With("stage_out_ms", stage_out_ms)
      .With("total_ms", timings->total_ms());
  return grpc::Status::OK;
}

grpc::Status TranslatorService::ListMappers(grpc::ServerContext* context,
                                            const v1::ListMappersRequest*,
                                            v1::ListMappersResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kClient); !allowed.ok()) return allowed;
  for (const MapperInfo& info : store_->List()) FillMapperInfo(info, response->add_mappers());
  return grpc::Status::OK;
}

grpc::Status TranslatorService::GetMapper(grpc::ServerContext* context,
                                          const v1::GetMapperRequest* request,
                                          v1::MapperInfo* response) {
  if (grpc::Status allowed = Authorize(context, Role::kClient); !allowed.ok()) return allowed;
  if (request->mapper_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "mapper_id is required");
  }
  absl::StatusOr<MapperInfo> info = store_->Info(request->mapper_id());
  if (!info.ok()) return ToGrpcStatus(info.status());
  FillMapperInfo(*info, response);
  return grpc::Status::OK;
}

grpc::Status TranslatorService::LoadMapper(grpc::ServerContext* context,
                                           const v1::LoadMapperRequest* request,
                                           v1::LoadMapperResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (request->mapper_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "mapper_id is required");
  }
  absl::StatusOr<MapperInfo> info = store_->Load(request->mapper_id(), request->device(),
                                                 absl::FromChrono(context->deadline()));
  if (!info.ok()) return ToGrpcStatus(info.status());
  KVT_LOG(kInfo, "mapper loaded")
      .With("mapper", info->id)
      .With("device", request->device().empty() ? "host" : request->device())
      .With("state", MapperStateName(info->state));
  FillMapperInfo(*info, response->mutable_mapper());
  return grpc::Status::OK;
}

grpc::Status TranslatorService::UnloadMapper(grpc::ServerContext* context,
                                             const v1::UnloadMapperRequest* request,
                                             v1::UnloadMapperResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (request->mapper_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "mapper_id is required");
  }
  // Waits for the requests holding the copy, within the caller's deadline.
  const absl::Time deadline =
      std::min(absl::FromChrono(context->deadline()),
               absl::Now() + absl::Seconds(config_.shutdown.deadline_seconds));
  absl::StatusOr<MapperInfo> info =
      store_->Unload(request->mapper_id(), request->device(), deadline);
  if (!info.ok()) return ToGrpcStatus(info.status());
  KVT_LOG(kInfo, "mapper unloaded")
      .With("mapper", info->id)
      .With("device", request->device().empty() ? "host" : request->device());
  FillMapperInfo(*info, response->mutable_mapper());
  return grpc::Status::OK;
}

grpc::Status TranslatorService::RegisterSystemMemory(grpc::ServerContext* context,
                                                     const v1::RegisterSystemMemoryRequest* request,
                                                     v1::RegisterSystemMemoryResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (grpc::Status enabled = SharedMemoryEnabled(); !enabled.ok()) return enabled;
  if (cuda_memory_.Contains(request->name())) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat("name: a CUDA memory region named '", request->name(),
                                     "' is registered (names are shared by both kinds)"));
  }
  absl::Status status = system_memory_.Register(request->name(), request->key(),
                                                request->offset(), request->byte_size());
  if (status.ok()) {
    KVT_LOG(kInfo, "system memory registered")
        .With("name", request->name())
        .With("key", request->key())
        .With("bytes", request->byte_size());
  }
  return ToGrpcStatus(status);
}
grpc::Status TranslatorService::UnregisterSystemMemory(grpc::ServerContext* context,
                                                       const v1::UnregisterSystemMemoryRequest* request,
                                                       v1::UnregisterSystemMemoryResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (grpc::Status enabled = SharedMemoryEnabled(); !enabled.ok()) return enabled;
  // Waits for the requests using the region, within the caller's deadline.
  const absl::Time deadline = std::min(absl::FromChrono(context->deadline()),
                                       absl::Now() + absl::Seconds(config_.shutdown.deadline_seconds));
  return ToGrpcStatus(system_memory_.Unregister(request->name(), deadline));
}
grpc::Status TranslatorService::SystemMemoryStatus(grpc::ServerContext* context,
                                                   const v1::SystemMemoryStatusRequest* request,
                                                   v1::SystemMemoryStatusResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (grpc::Status enabled = SharedMemoryEnabled(); !enabled.ok()) return enabled;
  absl::StatusOr<std::vector<SystemMemoryRegistry::RegionInfo>> regions =
      system_memory_.Status(request->name());
  if (!regions.ok()) return ToGrpcStatus(regions.status());
  for (const SystemMemoryRegistry::RegionInfo& info : *regions) {
    v1::SystemMemoryStatusResponse::Region* region = response->add_regions();
    region->set_name(info.name);
    region->set_key(info.key);
    region->set_offset(info.offset);
    region->set_byte_size(info.byte_size);
    region->set_in_use(info.in_use);
  }
  return grpc::Status::OK;
}
grpc::Status TranslatorService::RegisterCudaMemory(grpc::ServerContext* context,
                                                   const v1::RegisterCudaMemoryRequest* request,
                                                   v1::RegisterCudaMemoryResponse*) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (grpc::Status enabled = SharedMemoryEnabled(); !enabled.ok()) return enabled;
  if (system_memory_.Contains(request->name())) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat("name: a system memory region named '", request->name(),
                                     "' is registered (names are shared by both kinds)"));
  }
  absl::Status status = cuda_memory_.Register(request->name(), request->raw_handle(),
                                              request->device_id(), request->byte_size());
  if (status.ok()) {
    KVT_LOG(kInfo, "CUDA memory registered")
        .With("name", request->name())
        .With("device_id", request->device_id())
        .With("bytes", request->byte_size());
  }
  return ToGrpcStatus(status);
}
grpc::Status TranslatorService::UnregisterCudaMemory(grpc::ServerContext* context,
                                                     const v1::UnregisterCudaMemoryRequest* request,
                                                     v1::UnregisterCudaMemoryResponse*) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (grpc::Status enabled = SharedMemoryEnabled(); !enabled.ok()) return enabled;
  // Waits for the requests using the region, within the caller's deadline.
  const absl::Time deadline = std::min(absl::FromChrono(context->deadline()),
                                       absl::Now() + absl::Seconds(config_.shutdown.deadline_seconds));
  return ToGrpcStatus(cuda_memory_.Unregister(request->name(), deadline));
}
grpc::Status TranslatorService::CudaMemoryStatus(grpc::ServerContext* context,
                                                 const v1::CudaMemoryStatusRequest* request,
                                                 v1::CudaMemoryStatusResponse* response) {
  if (grpc::Status allowed = Authorize(context, Role::kAdmin); !allowed.ok()) return allowed;
  if (grpc::Status enabled = SharedMemoryEnabled(); !enabled.ok()) return enabled;
  absl::StatusOr<std::vector<CudaMemoryRegistry::RegionInfo>> regions =
      cuda_memory_.Status(request->name());
  if (!regions.ok()) return ToGrpcStatus(regions.status());
  for (const CudaMemoryRegistry::RegionInfo& info : *regions) {
    v1::CudaMemoryStatusResponse::Region* region = response->add_regions();
    region->set_name(info.name);
    region->set_device_id(info.device_id);
    region->set_byte_size(info.byte_size);
    region->set_in_use(info.in_use);
  }
  return grpc::Status::OK;
}

}  // namespace kvt
