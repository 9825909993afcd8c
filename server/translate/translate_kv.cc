#include "server/translate/translate_kv.h"

#include <memory>
#include <optional>
#include <utility>

#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "server/translate/chunk_intake.h"
#include "server/translate/layer_pipeline.h"
#include "server/translate/response_writer.h"
#include "server/translate/staging.h"
#include "kernels/finite.h"

namespace kvt {
namespace {

// An admitted request, its header sent: what the rest of the stream works with.
struct Admitted {
  const TranslateServices& services;
  const TranslateCall& call;
  const TranslatePlan& plan;
  RequestStaging& staging;
  const ComputeMapper& mapper;
  const FailureLog& fail;
  absl::Time start, admitted;
  double reprefill_estimate_ms = 0;
};

// Chunks in, target layers out, then the trailer. Layer pipelining: with inline input of at
// least transport.pipeline_min_tokens tokens, an output thread computes target layer l as soon
// as the source layers of its sigma lists have arrived and streams it back while this thread
// still reads the rest. Below the threshold the extra thread and handoffs cost more than the
// overlap gains, so everything arrives first.
grpc::Status StreamLayers(const Admitted& r, TranslateRecord* record) {
  const TranslatePlan& plan = r.plan;
  const KvtdConfig& config = *r.services.config;
  const bool pipelined =
      !plan.input_in_place() && plan.num_tokens >= config.transport.pipeline_min_tokens;
  LayerArrivals arrivals(&plan.view().layers, plan.source_model().num_layers,
                         plan.input_in_place());
  const StreamHooks hooks{r.fail, r.call.cancelled, r.call.closed};
  const std::unique_ptr<LayerSink> sink =
      MakeLayerSink(plan, r.staging, config, r.call.write, hooks);
  ProducerInputs inputs;
  inputs.plan = &plan;
  inputs.source = &r.staging.source();
  inputs.mapper = r.mapper;
  inputs.options.token_chunk = config.backend.token_chunk;
  inputs.deadline = r.call.deadline;
  inputs.compute = r.services.compute;
  inputs.buffers = r.services.buffers;
  LayerProducer producer(inputs, &arrivals, sink.get(), hooks);
  std::optional<double> input_shift;
  // A pass over (a sample of) the source features: cheap next to the GEMMs. Not pipelined, it
  // runs while layer 0 computes; pipelined, this thread takes it once every layer is in.
  auto score_input_shift = [&] {
    if (r.mapper.shift != nullptr) input_shift = r.mapper.shift->Score(r.staging.source(), plan.positions);
  };
  // Destroyed (stopped) before the producer, the sink and the arrivals it uses.
  std::optional<OutputThread> output;
  if (pipelined) output.emplace(&producer, &arrivals, r.call.read);

  {
    std::function<void(int, int)> arrived;
    if (pipelined) arrived = [&arrivals](int layer, int kind) { arrivals.Arrived(layer, kind); };
    ChunkIntake intake(
        plan, [&r](int layer, int kind) { return r.staging.SourceLayer(layer, kind); },
        std::move(arrived), config.transport.async_scatter_min_bytes);
    const absl::Status read =
        intake.ReadAll(r.call.read, [&output] { return output.has_value() && output->failed(); });
    if (!read.ok()) {
      if (output.has_value()) output->Stop();
      return r.fail(read);
    }
    if (output.has_value() && output->failed()) return output->Stop();
    if (r.call.cancelled()) return r.call.closed();
    if (absl::Status complete = intake.CheckComplete(); !complete.ok()) return r.fail(complete);
    // Before compute when not pipelined; pipelined, layers already streamed out are followed by
    // this error instead of a trailer, so the response is never taken as a result.
    if (!config.limits.allow_non_finite) {
      const char* field = plan.input_cached     ? "header.input.cached"
                          : plan.input_in_region ? "header.input.region"
                                                 : "chunk";
      if (absl::Status finite = CheckFinite(r.staging.source(), field); !finite.ok()) {
        if (output.has_value()) output->Stop();
        return r.fail(finite);
      }
    }
  }
  const absl::Time staged_in = absl::Now();

  grpc::Status output_status;
  if (pipelined) {
    // Every source layer is in; the output thread may still be computing.
    score_input_shift();
    output_status = output->Join();
  } else {
    arrivals.AllArrived();
    output_status = producer.Run(score_input_shift);
  }
  if (!output_status.ok()) return output_status;
  if (absl::Status intact = r.staging.CheckRegionsIntact(); !intact.ok()) return r.fail(intact);

  TrailerInputs trailer;
  trailer.request_id = r.fail.request_id();
  trailer.start = r.start;
  trailer.admitted = r.admitted;
  trailer.staged_in = staged_in;
  trailer.end = absl::Now();
  trailer.first_output = producer.first_output();
  trailer.compute_ms = producer.compute_ms();
  trailer.stage_out_ms = sink->stage_out_ms();
  trailer.pipelined = pipelined;
  trailer.num_tokens = plan.num_tokens;
  trailer.input_bytes = plan.source_bytes;
  trailer.output_bytes = sink->output_bytes();
  trailer.reprefill_estimate_ms = r.reprefill_estimate_ms;
  trailer.input_shift = input_shift;
  const TranslateResponseMessage message =
      ResponseTrailer(trailer, config, plan.target_model().name, record);
  if (!r.call.write(message)) return r.call.closed();

  const v1::StageTimings& timings = message.proto.trailer().timings();
  KVT_LOG(kInfo, "translate done")
      .With("request_id", trailer.request_id)
      .With("mapper", plan.mapper->id())
      .With("tokens", plan.num_tokens)
      .With("queue_ms", timings.queue_ms())
      .With("stage_in_ms", timings.stage_in_ms())
      .With("compute_ms", trailer.compute_ms)
      .With("stage_out_ms", trailer.stage_out_ms)
      .With("total_ms", timings.total_ms());
  return grpc::Status::OK;
}

}  // namespace

grpc::Status TranslateKV(const TranslateServices& services, const TranslateCall& call,
                         TranslateRecord* record) {
  const absl::Time start = absl::Now();
  TranslateRequestMessage message;
  if (!call.read(&message)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "stream ended before its header: send a TranslateHeader first");
  }
  if (!message.error.ok()) return ToGrpcStatus(message.error);
  if (!message.proto.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "first message must be a header (TranslateKVRequest.header)");
  }
  // Kept for the whole stream: explicit positions are read from it in place.
  const v1::TranslateHeader header = message.proto.header();
  const FailureLog fail("translate failed",
                        services.request_ids->Next(header.request_id()));
  if (absl::Status open = CheckNotDraining(services.draining->load()); !open.ok()) {
    return fail(open);
  }

  // --- The plan: the header checked (every error names the field), the mapper acquired. ---
  const PlanContext plan_context{services.config, services.store, services.prefix_cache};
  absl::StatusOr<TranslatePlan> planned =
      PlanTranslate(header, plan_context, call.deadline, &record->pair);
  if (!planned.ok()) return fail(planned.status());
  TranslatePlan& plan = *planned;

  // --- Shared-memory regions: leased for the whole request (an unregister waits for it). ---
  absl::StatusOr<std::unique_ptr<RequestStaging>> leased =
      RequestStaging::Lease(plan, header, services.system_memory, services.cuda_memory);
  if (!leased.ok()) return fail(leased.status());
  RequestStaging& staging = **leased;

  // --- Admission: the bytes this request makes kvtd hold; the mapper on its device. ---
  absl::StatusOr<AdmissionController::Ticket> ticket =
      services.admission->TryAdmit(staging.AdmissionBytes());
  if (!ticket.ok()) return fail(ticket.status());
  // The request's layer buffers go back to the pool before its ticket leaves admission (this is
  // destroyed first), so the next admitted request finds them there.
  struct BuffersBeforeTicket {
    RequestStaging* staging;
    ~BuffersBeforeTicket() { staging->ReleaseBuffers(); }
  } buffers_before_ticket{&staging};
  absl::StatusOr<ComputeMapper> mapper = PinForCompute(
      services.store, services.shift_stats, &plan.handle, plan.mapper_wait.deadline);
  if (!mapper.ok()) return fail(mapper.status());
  const absl::Time admitted = absl::Now();
  if (absl::Status staged = staging.StageCuda(services.buffers); !staged.ok()) return fail(staged);

  KVT_LOG(kInfo, "translate start")
      .With("request_id", fail.request_id())
      .With("mapper", plan.mapper->id())
      .With("tokens", plan.num_tokens)
      .With("session_id", header.session_id())
      .With("turn", header.turn());
  if (!call.write(ResponseHeader(fail.request_id(), plan, *mapper->backend))) {
    return call.closed();
  }

  // --- Stage in: inline chunks go into whole-layer buffers, a paged region is gathered into
  // them, a packed region or stored prefix is read in place (no copy). ---
  staging.StageSource(services.buffers);
  const Admitted request{services, call,  plan,  staging, *mapper,
                         fail,     start, admitted, header.reprefill_estimate_ms()};
  return StreamLayers(request, record);
}

}  // namespace kvt
