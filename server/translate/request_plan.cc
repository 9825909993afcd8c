#include "server/translate/request_plan.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/echo.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "server/request_checks.h"
#include "transport/paged.h"
#include "transport/proto_convert.h"

namespace kvt {

std::string RequestIds::Next(const std::string& from_header) {
  return from_header.empty() ? absl::StrCat("kvt-", next_.fetch_add(1)) : from_header;
}

grpc::Status FailureLog::operator()(const absl::Status& status) const {
  KVT_LOG(kWarning, what_)
      .With("request_id", request_id_)
      .With("code", absl::StatusCodeToString(status.code()))
      .With("error", status.message());
  return ToGrpcStatus(status);
}

absl::Status CheckNotDraining(bool draining) {
  if (!draining) return absl::OkStatus();
  return absl::UnavailableError("server is draining (shutting down); retry on another replica");
}

AcquireOptions MapperWait(const KvtdConfig& config, absl::Time client_deadline) {
  AcquireOptions options;
  options.deadline =
      std::min(client_deadline,
               absl::Now() + absl::Seconds(config.mapper_store.acquire_timeout_seconds));
  return options;
}

absl::StatusOr<ComputeMapper> PinForCompute(MapperStore* store, InputShiftCache* shift_stats,
                                            MapperHandle* handle, absl::Time deadline) {
  AcquireOptions options;
  options.deadline = deadline;
  options.device = "any";
  if (absl::Status pinned = store->PinOnDevice(handle, options); !pinned.ok()) return pinned;
  ComputeMapper mapper;
  mapper.prepared = handle->prepared();
  mapper.backend = handle->backend();
  mapper.shift = shift_stats->Get(handle->shared_mapper());
  return mapper;
}

absl::StatusOr<PrefixLease> TakePrefixLease(PrefixCache* prefix_cache,
                                            const v1::TranslateHeader& header) {
  if (prefix_cache == nullptr) {
    return absl::FailedPreconditionError(
        "header.input.cached: the prefix cache is disabled on this server "
        "(prefix_cache.enabled); send the source cache inline");
  }
  absl::StatusOr<PrefixLease> lease = prefix_cache->Take(header.input().cached().lease_id());
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

absl::Status CheckLeaseFitsMapper(const PrefixLease& lease, const LoadedMapper& mapper) {
  const MapperView& view = mapper.view();
  const PrefixEntry& entry = *lease.match().entry;
  const LeaseBinding& bound = lease.binding();
  // The lease is good for what the lookup checked (and gated) only: its source, its target and
  // its mapper. Anything else would skip the gate's verdict on that pair.
  if (entry.model() != view.source.name) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.input.cached: the leased prefix is of model '", Echo(entry.model()),
        "' but mapper reads '", Echo(view.source.name),
        "'; use LookupPrefixResponse.mapper_id"));
  }
  if (bound.target_model != view.target.name) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.target_model: the lease was issued for target '", Echo(bound.target_model),
        "' but the mapper writes '", Echo(view.target.name), "'; look the prefix up again"));
  }
  if (bound.mapper_id != mapper.id()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.mapper_id: the lease was issued for mapper '", Echo(bound.mapper_id), "' (gate ",
        bound.gate_passed ? "passed" : "refused, forced", ") but the request uses '",
        Echo(mapper.id()), "'; use LookupPrefixResponse.mapper_id"));
  }
  const EntryShape& shape = entry.shape();
  if (shape.num_layers != view.source.num_layers ||
      shape.num_kv_heads != view.source.num_kv_heads || shape.head_dim != view.source.head_dim) {
    return absl::FailedPreconditionError(absl::StrCat(
        "header.input.cached: the stored prefix has ", shape.num_layers, " layers x ",
        shape.num_kv_heads, " heads x ", shape.head_dim, " but the mapper's source '",
        view.source.name, "' has ", view.source.num_layers, " x ", view.source.num_kv_heads,
        " x ", view.source.head_dim));
  }
  return absl::OkStatus();
}

namespace {

// The dtypes, layouts, tokens and positions of both sides, and the side kinds; the prefix
// lease taken when the input names one. Checked in the order TranslateKV always checked them.
absl::Status CheckSides(const v1::TranslateHeader& header, const PlanContext& context,
                        TranslatePlan* plan) {
  absl::StatusOr<InputHeader> input = CheckInputHeader(header, context.config->limits.max_tokens);
  if (!input.ok()) return input.status();
  plan->input_dtype = input->dtype;
  plan->input_layout = input->layout;
  plan->num_tokens = input->num_tokens;
  plan->positions = input->positions;
  plan->output_dtype = plan->input_dtype;
  plan->output_layout = plan->input_layout;
  if (header.output_dtype() != v1::DTYPE_UNSPECIFIED) {
    absl::StatusOr<DType> dtype = DTypeFromProto(header.output_dtype(), "header.output_dtype");
    if (!dtype.ok()) return dtype.status();
    plan->output_dtype = *dtype;
  }
  if (header.output_layout() != v1::LAYOUT_UNSPECIFIED) {
    absl::StatusOr<Layout> layout =
        LayoutFromProto(header.output_layout(), "header.output_layout");
    if (!layout.ok()) return layout.status();
    plan->output_layout = *layout;
  }
  plan->input_in_region = header.input().has_region();
  plan->output_in_region = header.output().has_region();
  // A leased stored prefix is read in place, like a packed region: no chunks, no staging.
  plan->input_cached = header.input().has_cached();
  if (header.output().has_cached()) {
    return absl::InvalidArgumentError(
        "header.output.cached: a stored prefix is an input only; set header.output.inline or "
        "header.output.region");
  }
  if (plan->input_cached) {
    absl::StatusOr<PrefixLease> taken = TakePrefixLease(context.prefix_cache, header);
    if (!taken.ok()) return taken.status();
    plan->prefix_lease = std::move(*taken);
  }
  // A paged region side is staged through whole-layer buffers: the backends read and write
  // contiguous layers.
  plan->input_paged = plan->input_in_region && header.input().region().has_paged();
  plan->output_paged = plan->output_in_region && header.output().region().has_paged();
  plan->region_layer_notices = plan->output_in_region && header.region_layer_notices();
  if ((plan->input_in_region || plan->output_in_region) &&
      !context.config->shared_memory.allow_client_regions) {
    return absl::FailedPreconditionError(absl::StrCat(
        plan->input_in_region ? "header.input.region" : "header.output.region",
        ": client shared memory is disabled on this server "
        "(shared_memory.allow_client_regions); send KV inline"));
  }
  plan->response_chunk_tokens = header.output().inline_().chunk_tokens();
  return absl::OkStatus();
}

}  // namespace

// A window mapper reads each token's predecessors in the request, which are only its
// predecessors in the sequence when the positions run on without gaps.
absl::Status CheckWindowPositions(const v1::TranslateHeader& header, const MapperView& view) {
  if (view.window == 1) return absl::OkStatus();
  for (int i = 1; i < header.positions_size(); ++i) {
    if (header.positions(i) != header.positions(i - 1) + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.positions[", i, "]=", header.positions(i), " does not follow positions[",
          i - 1, "]=", header.positions(i - 1), ": mapper '", view.source.name, "' -> '",
          view.target.name, "' has window ", view.window,
          " (each token reads the tokens before it in the request), so positions must be "
          "consecutive"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TranslatePlan> PlanTranslate(const v1::TranslateHeader& header,
                                            const PlanContext& context,
                                            absl::Time client_deadline, PairLabels* pair) {
  TranslatePlan plan;
  if (absl::Status sides = CheckSides(header, context, &plan); !sides.ok()) return sides;

  plan.mapper_wait = MapperWait(*context.config, client_deadline);
  absl::StatusOr<MapperHandle> mapper = AcquireMapper(context.store, header, plan.mapper_wait);
  if (!mapper.ok()) return mapper.status();
  plan.handle = std::move(*mapper);
  plan.mapper = plan.handle.shared_mapper();
  const MapperView& view = plan.mapper->view();
  *pair = PairLabels::Of(view);
  const ModelSpec& src_model = view.source;
  const ModelSpec& tgt_model = view.target;
  if (absl::Status s = CheckWindowPositions(header, view); !s.ok()) return s;
  if (plan.input_cached) {
    if (absl::Status matches = CheckLeaseFitsMapper(plan.prefix_lease, *plan.mapper);
        !matches.ok()) {
      return matches;
    }
  }

  plan.source_geometry = LayerGeometry{plan.input_layout, src_model.num_kv_heads,
                                       plan.num_tokens, src_model.head_dim,
                                       static_cast<int64_t>(DTypeSize(plan.input_dtype))};
  plan.target_geometry = LayerGeometry{plan.output_layout, tgt_model.num_kv_heads,
                                       plan.num_tokens, tgt_model.head_dim,
                                       static_cast<int64_t>(DTypeSize(plan.output_dtype))};
  plan.source_bytes = 2 * src_model.num_layers * plan.source_geometry.layer_bytes();
  plan.target_bytes = 2 * tgt_model.num_layers * plan.target_geometry.layer_bytes();
  const int64_t max_request_bytes = context.config->limits.max_request_bytes;
  if (plan.source_bytes + plan.target_bytes > max_request_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "header.num_tokens=", plan.num_tokens, " makes ", plan.source_bytes, " source + ",
        plan.target_bytes, " target cache bytes, over limits.max_request_bytes=",
        max_request_bytes, "; split the cache into several requests",
        view.window > 1 ? absl::StrCat(" (each after the first starting ", view.window - 1,
                                       " tokens early: the mapper's window)")
                        : ""));
  }
  return std::move(plan);
}

}  // namespace kvt
