// Step 1 of a TranslateKV: the stream's header becomes a TranslatePlan (every field checked,
// errors naming it; input and output kinds; the leased stored prefix; the mapper; geometry;
// limits.max_request_bytes). Also the stream prologue ValidateKV shares with it: request ids,
// the drain check, the failure log line, the mapper wait and pinning the mapper for compute.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "kernels/backend.h"
#include "kernels/types.h"
#include "mapper_store/store.h"
#include "prefix_cache/prefix_cache.h"
#include "proto/kvt/v1/translate.pb.h"
#include "quality/input_shift.h"
#include "quality/input_shift_cache.h"
#include "server/config.h"
#include "server/metrics.h"
#include "transport/chunk_wire.h"
#include "transport/kv_chunks.h"

namespace kvt {

// The two halves of a TranslateKV stream as every step sees them: functions, so each step runs
// (and is tested) without gRPC. A reader returns false once the stream has ended or failed; a
// writer returns false once the client has gone away.
using RequestReader = std::function<bool(TranslateRequestMessage*)>;
using ResponseWriter = std::function<bool(const TranslateResponseMessage&)>;

// --- The stream prologue (TranslateKV and ValidateKV). ---

// The header's request_id, or "kvt-N" (N counting from 1) when it is empty.
class RequestIds {
 public:
  std::string Next(const std::string& from_header);

 private:
  std::atomic<uint64_t> next_{1};
};

// How a streaming RPC ends on an error: a warning line `what` ("translate failed") with the
// request id, code and message, and the status as gRPC's.
class FailureLog {
 public:
  FailureLog(const char* what, std::string request_id)
      : what_(what), request_id_(std::move(request_id)) {}
  grpc::Status operator()(const absl::Status& status) const;
  const std::string& request_id() const { return request_id_; }

 private:
  const char* what_;
  std::string request_id_;
};

// UNAVAILABLE while the server drains (shutting down).
absl::Status CheckNotDraining(bool draining);

// How long a request may wait for a mapper load or for room in a budget: the client's deadline,
// at most mapper_store.acquire_timeout_seconds from now.
AcquireOptions MapperWait(const KvtdConfig& config, absl::Time client_deadline);

// What a request computes with: the mapper's copy on a compute device, pinned in the request's
// handle (paged in first if needed), and the mapper's input-shift statistics.
struct ComputeMapper {
  const PreparedMapper* prepared = nullptr;      // valid while the handle is held
  Backend* backend = nullptr;                    // the device's backend
  std::shared_ptr<const InputShiftStats> shift;  // null: the mapper carries no statistics
};
absl::StatusOr<ComputeMapper> PinForCompute(MapperStore* store, InputShiftCache* shift_stats,
                                            MapperHandle* handle, absl::Time deadline);

// --- TranslateKV's plan. ---

// Everything a TranslateKV stream needs once its header has been accepted. `positions` may
// point into the header: keep the header alive while the plan is used.
struct TranslatePlan {
  AcquireOptions mapper_wait;  // also bounds pinning the mapper on its device
  MapperHandle handle;         // pins the mapper (and its device copy) until the stream ends
  std::shared_ptr<const LoadedMapper> mapper;
  DType input_dtype = DType::kFP32;
  Layout input_layout = Layout::kHND;
  DType output_dtype = DType::kFP32;
  Layout output_layout = Layout::kHND;
  int64_t num_tokens = 0;
  Positions positions;
  int64_t response_chunk_tokens = 0;  // 0 = by bytes
  // Where the source comes from and the target goes.
  bool input_in_region = false;   // header.input.region (system shm or CUDA)
  bool input_cached = false;      // header.input.cached: a leased stored prefix
  bool input_paged = false;       // the input region is paged (block table)
  bool output_in_region = false;  // header.output.region
  bool output_paged = false;
  bool region_layer_notices = false;  // header.region_layer_notices, with a region output
  PrefixLease prefix_lease;  // when input_cached
  LayerGeometry source_geometry, target_geometry;
  int64_t source_bytes = 0;
  int64_t target_bytes = 0;

  // A leased prefix and a packed or paged region are read where they are: no chunks.
  bool input_in_place() const { return input_in_region || input_cached; }
  const MapperView& view() const { return mapper->view(); }
  const ModelSpec& source_model() const { return mapper->view().source; }
  const ModelSpec& target_model() const { return mapper->view().target; }
};

// The parts of the service a plan is made with; all outlive the request.
struct PlanContext {
  const KvtdConfig* config = nullptr;
  MapperStore* store = nullptr;
  PrefixCache* prefix_cache = nullptr;  // null: header.input.cached is refused
};

// The header checked and the mapper acquired; `pair` gets the mapper's labels once it is known
// (metrics label failures after that point with them). Errors name the header field.
absl::StatusOr<TranslatePlan> PlanTranslate(const v1::TranslateHeader& header,
                                            const PlanContext& context,
                                            absl::Time client_deadline, PairLabels* pair);

// header.input.cached: the lease taken (single use) and checked against the header.
absl::StatusOr<PrefixLease> TakePrefixLease(PrefixCache* prefix_cache,
                                            const v1::TranslateHeader& header);
// The leased prefix is of the mapper's source model and shape, and the lease was issued for
// this mapper (and so its target and gate verdict); errors name the header field.
absl::Status CheckLeaseFitsMapper(const PrefixLease& lease, const LoadedMapper& mapper);

}  // namespace kvt
