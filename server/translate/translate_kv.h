// One TranslateKV, start to end: plan the header (request_plan), lease and stage (staging),
// admit, send the response header, read the chunks (chunk_intake) while the layer pipeline
// computes and the response writer delivers target layers, then the trailer. No gRPC types
// but the status: the call's stream and context come in as functions.
#pragma once

#include <atomic>
#include <functional>

#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "mapper_store/store.h"
#include "prefix_cache/prefix_cache.h"
#include "quality/input_shift_cache.h"
#include "server/admission.h"
#include "server/compute_executor.h"
#include "server/config.h"
#include "server/metrics.h"
#include "server/translate/request_plan.h"
#include "transport/buffer_pool.h"
#include "transport/cuda_registry.h"
#include "transport/shm_registry.h"

namespace kvt {

// The service's parts a TranslateKV uses; all outlive the calls.
struct TranslateServices {
  const KvtdConfig* config = nullptr;
  MapperStore* store = nullptr;
  PrefixCache* prefix_cache = nullptr;  // optional
  InputShiftCache* shift_stats = nullptr;
  SystemMemoryRegistry* system_memory = nullptr;
  CudaMemoryRegistry* cuda_memory = nullptr;
  AdmissionController* admission = nullptr;
  ComputeExecutor* compute = nullptr;
  BufferPool* buffers = nullptr;
  RequestIds* request_ids = nullptr;
  const std::atomic<bool>* draining = nullptr;
};

// One call: its stream halves and what its context says.
struct TranslateCall {
  RequestReader read;
  ResponseWriter write;
  std::function<bool()> cancelled;            // the client went away or the deadline passed
  absl::Time deadline = absl::InfiniteFuture();  // the client's
  std::function<grpc::Status()> closed;       // the status then: CANCELLED / DEADLINE_EXCEEDED
};

// Runs the call; `record` gets what metrics observe (pair, timings, speed-up, input shift).
grpc::Status TranslateKV(const TranslateServices& services, const TranslateCall& call,
                         TranslateRecord* record);

}  // namespace kvt
