#include "kernels/cuda/cuda_backend.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#if KVT_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_plan.h"
#include "kernels/cuda/device.h"
#include "kernels/dtype.h"
#include "kernels/rope.h"
#include "kernels/translation_plan.h"
#endif

namespace kvt {

#if !KVT_HAVE_CUDA

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions&) {
  return absl::FailedPreconditionError(
      "backend cuda: this kvt was built without the CUDA toolkit");
}

#else  // KVT_HAVE_CUDA

namespace {

using cuda::CudaFailure;
namespace ki = cuda::internal;

CudaFailure Classify(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return CudaFailure::kOutOfMemory;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInvalidDevice:
      return CudaFailure::kNoDevice;
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorNoKernelImageForDevice:
      return CudaFailure::kNotSupported;
    case cudaErrorInvalidValue:
      return CudaFailure::kInvalidValue;
    default:
      return CudaFailure::kOther;
  }
}

absl::Status CudaStatus(const char* call, cudaError_t error) {
  return cuda::CudaCallStatus(call, Classify(error), static_cast<int>(error),
                              cudaGetErrorName(error), cudaGetErrorString(error));
}

absl::Status CublasStatus(const char* call, cublasStatus_t status) {
  CudaFailure failure = CudaFailure::kOther;
  if (status == CUBLAS_STATUS_ALLOC_FAILED) failure = CudaFailure::kOutOfMemory;
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_ARCH_MISMATCH) {
    failure = CudaFailure::kNotSupported;
  }
  if (status == CUBLAS_STATUS_NOT_INITIALIZED) failure = CudaFailure::kNoDevice;
  if (status == CUBLAS_STATUS_INVALID_VALUE) failure = CudaFailure::kInvalidValue;
  return cuda::CudaCallStatus(call, failure, static_cast<int>(status),
                              cublasGetStatusName(status), cublasGetStatusString(status));
}

// Every CUDA / cuBLAS call goes through these: the error names the call and the code.
#define KVT_CUDA_RETURN_IF_ERROR(name, expr)            \
  do {                                                  \
    const cudaError_t kvt_cuda_error = (expr);          \
    if (kvt_cuda_error != cudaSuccess) return CudaStatus(name, kvt_cuda_error); \
  } while (0)
#define KVT_CUBLAS_RETURN_IF_ERROR(name, expr)          \
  do {                                                  \
    const cublasStatus_t kvt_cublas_status = (expr);    \
    if (kvt_cublas_status != CUBLAS_STATUS_SUCCESS) {   \
      return CublasStatus(name, kvt_cublas_status);     \
    }                                                   \
  } while (0)

constexpr int64_t kAlign = 256;
int64_t Align(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

cudaDataType CudaType(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kFP16:
      return CUDA_R_16F;
    case DType::kFP32:
      return CUDA_R_32F;
  }
  return CUDA_R_32F;
}

// Makes `device` current for its scope and restores the caller's: frees and handle destroys
// act on the current device, and a destructor may run on any thread (the pager's, a gRPC
// worker's) with another GPU current.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~ScopedDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = -1;
};

// The calling thread's current device, which allocations land on.
int CurrentDevice() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return device;
}

// Grow-only device memory. Contents are never zero-filled: every element is written before
// it is read.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Free(); }
  absl::Status Reserve(int64_t bytes) {
    if (bytes <= size_) return absl::OkStatus();
    Free();
    device_ = CurrentDevice();
    KVT_CUDA_RETURN_IF_ERROR("cudaMalloc", cudaMalloc(&data_, static_cast<size_t>(bytes)));
    size_ = bytes;
    return absl::OkStatus();
  }
  char* data() const { return static_cast<char*>(data_); }
  int64_t size() const { return size_; }

 private:
  void Free() {
    if (data_ == nullptr) return;
    ScopedDevice on(device_);
    cudaFree(data_);
    data_ = nullptr;
    size_ = 0;
  }

  void* data_ = nullptr;
  int64_t size_ = 0;
  int device_ = 0;
};

// Grow-only page-locked host memory: the only host memory cudaMemcpyAsync copies without
// blocking, so staging through it overlaps the host's copies with the GPU's work.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { Free(); }
  absl::Status Reserve(int64_t bytes) {
    if (bytes <= size_) return absl::OkStatus();
    Free();
    device_ = CurrentDevice();
    KVT_CUDA_RETURN_IF_ERROR("cudaHostAlloc",
                             cudaHostAlloc(&data_, static_cast<size_t>(bytes), cudaHostAllocDefault));
    size_ = bytes;
    return absl::OkStatus();
  }
  char* data() const { return static_cast<char*>(data_); }

 private:
  void Free() {
    if (data_ == nullptr) return;
    ScopedDevice on(device_);
    cudaFreeHost(data_);
    data_ = nullptr;
    size_ = 0;
  }

  void* data_ = nullptr;
  int64_t size_ = 0;
  int device_ = 0;
};

class CudaPreparedMapper : public PreparedMapper {
 public:
  const MapperView& view() const override { return plan_.mapper(); }
  uint64_t bytes() const override { return bytes_; }

  // The device array GemmStage `index` reads: W / A1, A2, A3.
  const DeviceBuffer& stage_weights(int index) const {
    return index == 1 ? a2_ : index == 2 ? a3_ : weights_;
  }

  TranslationPlan plan_;
  int device_ = 0;
  cuda::DeviceLayout layout_;  // cuda_plan.h: what each buffer below holds
  // Ridge W or MLP A1, [target layer][kind][window][max_blocks * n_s * d_s][...] in
  // layout_.weight_dtype, each token offset's rows past |sigma| zero (cuda_plan.h DeviceLayout).
  DeviceBuffer weights_;
  DeviceBuffer a2_;           // MLP only: [target layer][kind][heads][H][H]
  DeviceBuffer a3_;           // MLP only: [target layer][kind][heads][H][head_out]
  DeviceBuffer bias_;         // ridge b or MLP c3: [target layer][kind][n_t d_t] fp32
  DeviceBuffer hidden_bias_;  // MLP only: c1 then c2, each [target layer][kind][heads H] fp32
  DeviceBuffer sigma_;        // [target layer][kind][max_blocks] int, -1 padded
  DeviceBuffer chain_first_;  // head-local ridge only: [n_t] int, each chain's first source head
  uint64_t bytes_ = 0;
};


// One call's GPU resources; calls run concurrently on separate contexts.
struct Context {
  explicit Context(int device) : device(device) {}
  const int device;  // the stream, handle and events belong to it
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  // Pinned slot reuse: the host may refill slot s only after the GPU has finished copying it.
  cudaEvent_t table_copied[2] = {nullptr, nullptr};
  cudaEvent_t input_copied[2] = {nullptr, nullptr};
  cudaEvent_t output_copied[2] = {nullptr, nullptr};
  bool table_used[2] = {false, false};
  bool input_used[2] = {false, false};
  DeviceBuffer workspace;
  DeviceBuffer pointer_tables;
  PinnedBuffer pinned_tables[2];
  PinnedBuffer pinned_input[2];
  PinnedBuffer pinned_output[2];
  PinnedBuffer pinned_pointers;

  ~Context() {
    ScopedDevice on(device);
    for (cudaEvent_t* events : {table_copied, input_copied, output_copied}) {
      for (int s = 0; s < 2; ++s) {
        if (events[s] != nullptr) cudaEventDestroy(events[s]);
      }
    }
    if (cublas != nullptr) cublasDestroy(cublas);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  absl::Status Init() {
    KVT_CUDA_RETURN_IF_ERROR("cudaSetDevice", cudaSetDevice(device));
    KVT_CUDA_RETURN_IF_ERROR("cudaStreamCreateWithFlags",
                             cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    KVT_CUBLAS_RETURN_IF_ERROR("cublasCreate", cublasCreate(&cublas));
    KVT_CUBLAS_RETURN_IF_ERROR("cublasSetStream", cublasSetStream(cublas, stream));
    // No TF32: fp32 caches get fp32 products (SPEC 3's 1e-5 for fp32 output).
    KVT_CUBLAS_RETURN_IF_ERROR("cublasSetMathMode",
                               cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));
    for (cudaEvent_t* events : {table_copied, input_copied, output_copied}) {
      for (int s = 0; s < 2; ++s) {
        KVT_CUDA_RETURN_IF_ERROR("cudaEventCreateWithFlags",
                                 cudaEventCreateWithFlags(&events[s], cudaEventDisableTiming));
      }
    }
    return absl::OkStatus();
  }
};

// Where a cache layer pointer lives. Device memory of another GPU is refused: the kernels
// would fault on it.
absl::StatusOr<bool> OnDevice(const void* pointer, int device, const char* which,
                              const char* kind, int layer) {
  cudaPointerAttributes attributes;
  const cudaError_t error = cudaPointerGetAttributes(&attributes, pointer);
  if (error != cudaSuccess) {
    cudaGetLastError();  // not sticky; host memory unknown to CUDA is reported this way by old drivers
    return false;
  }
  if (attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged) {
    if (attributes.device != device) {
      return absl::InvalidArgumentError(absl::StrCat(which, ".", kind, "[", layer,
                                                     "] is memory of cuda:", attributes.device,
                                                     " but the backend runs on cuda:", device));
    }
    return true;
  }
  return false;
}

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(const CudaBackendOptions& options) : options_(options) {}

  std::string name() const override { return "cuda"; }
  std::string device() const override { return absl::StrCat("cuda:", options_.device); }

  // BeginPrepare + every PrepareLayer.
  absl::StatusOr<std::shared_ptr<PreparedMapper>> Prepare(const MapperView& mapper) override;

  // Streamed page-in (kernels/backend.h): BeginPrepare checks the mapper, allocates all device
  // memory (bytes() final) and uploads the biases and sigma lists; PrepareLayer(l) uploads
  // layer l's weights, converted to the common weight dtype where they differ.
  absl::StatusOr<std::shared_ptr<PreparedMapper>> BeginPrepare(const MapperView& mapper) override;
  absl::Status PrepareLayer(PreparedMapper& prepared, int target_layer) override;
  uint64_t PreparedBytesEstimate(const MapperView& mapper) const override;
  uint64_t DeviceMemoryBytes() const override;
  uint64_t ReservedDeviceBytes() const override;

  absl::Status TranslateLayer(const PreparedMapper& mapper, int target_layer,
                              const CacheView& source, const Positions& positions,
                              const TranslateOptions& options,
                              MutableCacheView* target) override;

  // All target layers in steps of several layers each (one batched GEMM per step).
  absl::Status Translate(const PreparedMapper& mapper, const CacheView& source,
                         const Positions& positions, const TranslateOptions& options,
                         MutableCacheView* target) override;

 private:
  absl::StatusOr<const CudaPreparedMapper*> Cast(const PreparedMapper& mapper) const;
  // Target layers [layer_begin, layer_end) on a context of its own (CudaCall).
  absl::Status Run(const CudaPreparedMapper& mapper, int layer_begin, int layer_end,
                   const CacheView& source, const Positions& positions,
                   const TranslateOptions& options, MutableCacheView* target);
  absl::StatusOr<std::unique_ptr<Context>> AcquireContext();
  void ReleaseContext(std::unique_ptr<Context> context);

  CudaBackendOptions options_;
  Mutex mu_;
  CondVar context_released_;
  std::vector<std::unique_ptr<Context>> idle_ ABSL_GUARDED_BY(mu_);
  int contexts_ ABSL_GUARDED_BY(mu_) = 0;  // idle or in a call; at most max_concurrent_calls
};

uint64_t CudaBackend::PreparedBytesEstimate(const MapperView& mapper) const {
  absl::StatusOr<cuda::DeviceLayout> layout = cuda::DeviceLayoutOf(mapper);
  // A mapper the device copy cannot hold fails in BeginPrepare; the default sizes its attempt.
  if (!layout.ok()) return Backend::PreparedBytesEstimate(mapper);
  return layout->prepared_bytes(static_cast<int>(mapper.layers.size()));
}

uint64_t CudaBackend::ReservedDeviceBytes() const {
  return static_cast<uint64_t>(options_.max_concurrent_calls) *
         static_cast<uint64_t>(options_.workspace_bytes + cuda::kContextOverheadBytes);
}

uint64_t CudaBackend::DeviceMemoryBytes() const {
  if (cudaSetDevice(options_.device) != cudaSuccess) return 0;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
  return total_bytes;
}

absl::StatusOr<std::shared_ptr<PreparedMapper>> CudaBackend::Prepare(const MapperView& mapper) {
  absl::StatusOr<std::shared_ptr<PreparedMapper>> prepared = BeginPrepare(mapper);
  if (!prepared.ok()) return prepared.status();
  for (int l = 0; l < mapper.target.num_layers; ++l) {
    if (absl::Status s = PrepareLayer(**prepared, l); !s.ok()) return s;
  }
  return prepared;
}

// What BeginPrepare uploads besides the weights, in the device layout: fp32 output biases (ridge
// b or MLP c3) [layer][kind][n_t d_t], MLP c1 then c2 [layer][kind][heads H] each, and the sigma
// lists [layer][kind][max_blocks] padded with -1. Absent biases are zeros.
struct HostTables {
  std::vector<float> bias;
  std::vector<float> hidden_bias;
  std::vector<int> sigma;
  std::vector<int> chain_first;  // head-local ridge: the plan's chain_sources[h].first
};

HostTables MakeHostTables(const TranslationPlan& plan, const cuda::DeviceLayout& layout) {
  const int layers = plan.mapper().target.num_layers;
  const int64_t target_width = layout.target_width;
  const int64_t hidden_width = layout.hidden_width();
  HostTables t;
  t.bias.assign(static_cast<size_t>(layers) * 2 * target_width, 0.0f);
  t.hidden_bias.assign(static_cast<size_t>(layers) * 2 * 2 * hidden_width, 0.0f);
  t.sigma.assign(static_cast<size_t>(layers) * 2 * layout.max_blocks, -1);
  const size_t c2_offset = static_cast<size_t>(layers) * 2 * hidden_width;
  for (int l = 0; l < layers; ++l) {
    for (const KindPlan& kind : plan.layer(l).kinds) {
      const size_t lk = static_cast<size_t>(l) * 2 + static_cast<int>(kind.kind);
      // MLP c3 [heads][head_out] is the n_t d_t output columns in order, like ridge's b.
      const WeightView& b = StageBias(plan.mapper(), l, kind.kind, kind.last().index);
      if (b.data != nullptr) {
        ToFloat(b.dtype, b.data, t.bias.data() + lk * target_width, target_width);
      }
      if (layout.kind == MapKind::kMlp) {
        // c1, c2 [heads][H]: head h's units at [h H, (h+1) H), as in the stacked activations.
        const WeightView& c1 = StageBias(plan.mapper(), l, kind.kind, 0);
        const WeightView& c2 = StageBias(plan.mapper(), l, kind.kind, 1);
        ToFloat(c1.dtype, c1.data, t.hidden_bias.data() + lk * hidden_width, hidden_width);
        ToFloat(c2.dtype, c2.data, t.hidden_bias.data() + c2_offset + lk * hidden_width,
                hidden_width);
      }
      std::copy(kind.sigma.begin(), kind.sigma.end(), t.sigma.begin() + lk * layout.max_blocks);
    }
  }
  // Every (layer, kind) pairs its heads the same way: one table from the plan.
  for (const HeadSources& chain : plan.layer(0).kinds[0].chain_sources) {
    t.chain_first.push_back(chain.first);
  }
  return t;
}

// `bytes` of host `data` into a new device buffer.
absl::Status UploadTable(const void* data, int64_t bytes, DeviceBuffer* buffer) {
  if (absl::Status s = buffer->Reserve(bytes); !s.ok()) return s;
  KVT_CUDA_RETURN_IF_ERROR("cudaMemcpy",
                           cudaMemcpy(buffer->data(), data, bytes, cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

// The weight arrays, sized for every layer; PrepareLayer fills them.
absl::Status ReserveWeights(CudaPreparedMapper* prepared) {
  const cuda::DeviceLayout& layout = prepared->layout_;
  const int64_t pairs = static_cast<int64_t>(prepared->plan_.mapper().target.num_layers) * 2;
  const int64_t element = static_cast<int64_t>(DTypeSize(layout.weight_dtype));
  const int64_t first_bytes = pairs * layout.stage_elements(0) * element;
  if (absl::Status s = prepared->weights_.Reserve(first_bytes); !s.ok()) return s;
  if (layout.padded) {
    // Rows of the padding blocks multiply zeros in X, but NaN * 0 is NaN: they must be zero.
    KVT_CUDA_RETURN_IF_ERROR("cudaMemset", cudaMemset(prepared->weights_.data(), 0, first_bytes));
  }
  prepared->bytes_ += static_cast<uint64_t>(first_bytes);
  if (layout.kind != MapKind::kMlp) return absl::OkStatus();
  for (DeviceBuffer* buffer : {&prepared->a2_, &prepared->a3_}) {
    const int64_t bytes =
        pairs * layout.stage_elements(buffer == &prepared->a2_ ? 1 : 2) * element;
    if (absl::Status s = buffer->Reserve(bytes); !s.ok()) return s;
    prepared->bytes_ += static_cast<uint64_t>(bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<PreparedMapper>> CudaBackend::BeginPrepare(
    const MapperView& mapper) {
  absl::StatusOr<TranslationPlan> plan = TranslationPlan::Build(mapper);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<cuda::DeviceLayout> layout = cuda::DeviceLayoutOf(mapper);
  if (!layout.ok()) return layout.status();
  KVT_CUDA_RETURN_IF_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  auto prepared = std::make_shared<CudaPreparedMapper>();
  prepared->plan_ = *std::move(plan);
  prepared->device_ = options_.device;
  prepared->layout_ = *layout;
  if (absl::Status s = ReserveWeights(prepared.get()); !s.ok()) return s;
  const HostTables tables = MakeHostTables(prepared->plan_, prepared->layout_);
  const bool mlp = layout->kind == MapKind::kMlp;
  const int64_t bias_bytes = tables.bias.size() * sizeof(float);
  const int64_t hidden_bytes = mlp ? tables.hidden_bias.size() * sizeof(float) : 0;
  const int64_t sigma_bytes = tables.sigma.size() * sizeof(int);
  if (absl::Status s = UploadTable(tables.bias.data(), bias_bytes, &prepared->bias_); !s.ok()) {
    return s;
  }
  if (mlp) {
    if (absl::Status s =
            UploadTable(tables.hidden_bias.data(), hidden_bytes, &prepared->hidden_bias_);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = UploadTable(tables.sigma.data(), sigma_bytes, &prepared->sigma_); !s.ok()) {
    return s;
  }
  const int64_t chain_bytes = tables.chain_first.size() * sizeof(int);
  if (chain_bytes > 0) {
    if (absl::Status s =
            UploadTable(tables.chain_first.data(), chain_bytes, &prepared->chain_first_);
        !s.ok()) {
      return s;
    }
  }
  // The same sum PreparedBytesEstimate reserves by (DeviceLayout::prepared_bytes).
  prepared->bytes_ += static_cast<uint64_t>(bias_bytes + hidden_bytes + sigma_bytes + chain_bytes);
  // A pageable cudaMemcpy may return before its DMA lands, and translations run on
  // non-blocking streams that do not wait for the legacy stream: wait here.
  KVT_CUDA_RETURN_IF_ERROR("cudaStreamSynchronize", cudaStreamSynchronize(cudaStreamLegacy));
  return std::shared_ptr<PreparedMapper>(std::move(prepared));
}

// `w` into device memory at `device`, converted to the device copy's dtype (fp32 when the
// stored dtypes differ); per_head A1 (`heads` > 1) interleaved by head (cuda_plan.h).
// `input_rows`: W and A1, whose rows follow the window's token offsets, padded per offset on
// the device (cuda_plan.h InputRowCopiesOf).
absl::Status UploadWeight(const WeightView& w, const cuda::DeviceLayout& layout, int heads,
                          bool input_rows, char* device) {
  const size_t element = DTypeSize(layout.weight_dtype);
  const int64_t count = w.rows * w.cols;
  std::vector<float> converted;
  std::vector<char> interleaved;
  const void* host = w.data;
  if (w.dtype != layout.weight_dtype) {
    converted.resize(count);
    ToFloat(w.dtype, w.data, converted.data(), count);
    host = converted.data();
  }
  if (heads > 1) {
    interleaved.resize(count * element);
    cuda::InterleaveHeads(host, element, heads, w.rows / heads, w.cols, interleaved.data());
    host = interleaved.data();
  }
  const int64_t row_bytes = static_cast<int64_t>(heads) * w.cols * element;
  const cuda::InputRowCopies copies =
      input_rows ? cuda::InputRowCopiesOf(layout, w.rows / heads, row_bytes)
                 : cuda::InputRowCopies{1, count * static_cast<int64_t>(element), 0};
  for (int o = 0; o < copies.count; ++o) {
    KVT_CUDA_RETURN_IF_ERROR(
        "cudaMemcpy", cudaMemcpy(device + o * copies.device_stride,
                                 static_cast<const char*>(host) + o * copies.bytes, copies.bytes,
                                 cudaMemcpyHostToDevice));
  }
  return absl::OkStatus();
}

// A head-local ridge W, its n_t chains stacked along rows, chain by chain into its device block
// of chain_width rows (each padded per token offset like a whole-row W).
absl::Status UploadChains(const WeightView& w, const cuda::DeviceLayout& layout, char* device) {
  const int64_t heads = layout.ridge_heads;
  WeightView chain = w;
  chain.rows = w.rows / heads;
  const int64_t stored_bytes = chain.rows * chain.cols * static_cast<int64_t>(DTypeSize(w.dtype));
  const int64_t device_bytes = layout.chain_width * layout.head_out *
                               static_cast<int64_t>(DTypeSize(layout.weight_dtype));
  for (int64_t h = 0; h < heads; ++h) {
    chain.data = static_cast<const char*>(w.data) + h * stored_bytes;
    if (absl::Status s = UploadWeight(chain, layout, 1, true, device + h * device_bytes); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::PrepareLayer(PreparedMapper& prepared_mapper, int target_layer) {
  auto* prepared = dynamic_cast<CudaPreparedMapper*>(&prepared_mapper);
  if (prepared == nullptr) {
    return absl::InvalidArgumentError("mapper was not prepared by the cuda backend");
  }
  const MapperView& mapper = prepared->view();
  if (target_layer < 0 || target_layer >= mapper.target.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("target_layer=", target_layer,
                                                   " out of range [0, ",
                                                   mapper.target.num_layers, ")"));
  }
  KVT_CUDA_RETURN_IF_ERROR("cudaSetDevice", cudaSetDevice(prepared->device_));
  const cuda::DeviceLayout& layout = prepared->layout_;
  const size_t element = DTypeSize(layout.weight_dtype);
  for (const KindPlan& kind : prepared->plan_.layer(target_layer).kinds) {
    const int64_t lk = static_cast<int64_t>(target_layer) * 2 + static_cast<int>(kind.kind);
    if (kind.head_local()) {
      if (absl::Status s = UploadChains(StageMatrix(mapper, target_layer, kind.kind, 0), layout,
                                        prepared->weights_.data() + lk * layout.stage_elements(0) *
                                                                        element);
          !s.ok()) {
        return s;
      }
      continue;
    }
    // Stage 0 (W or A1) reads the gathered rows; an MLP's A1 chains sit side by side on the
    // device. A2 [heads H][H] and A3 [heads H][head_out] are stored head by head already.
    for (const GemmStage& stage : kind.map) {
      const bool input_rows = stage.index == 0;
      char* device = prepared->stage_weights(stage.index).data() +
                     lk * layout.stage_elements(stage.index) * element;
      if (absl::Status s = UploadWeight(StageMatrix(mapper, target_layer, kind.kind, stage.index),
                                        layout, input_rows ? kind.heads : 1, input_rows, device);
          !s.ok()) {
        return s;
      }
    }
  }
  // As in BeginPrepare: the layer is usable once its copies have landed.
  KVT_CUDA_RETURN_IF_ERROR("cudaStreamSynchronize", cudaStreamSynchronize(cudaStreamLegacy));
  return absl::OkStatus();
}

absl::StatusOr<const CudaPreparedMapper*> CudaBackend::Cast(const PreparedMapper& mapper) const {
  const auto* prepared = dynamic_cast<const CudaPreparedMapper*>(&mapper);
  if (prepared == nullptr) {
    return absl::InvalidArgumentError("mapper was not prepared by the cuda backend");
  }
  if (prepared->device_ != options_.device) {
    return absl::InvalidArgumentError(absl::StrCat("mapper was prepared on cuda:",
                                                   prepared->device_, " but the backend runs on ",
                                                   device()));
  }
  return prepared;
}

absl::StatusOr<std::unique_ptr<Context>> CudaBackend::AcquireContext() {
  {
    MutexLock lock(&mu_);
    // Each context keeps a workspace of up to workspace_bytes: bounding their number bounds
    // the device memory outside the mapper store (ReservedDeviceBytes). Calls beyond it wait.
    context_released_.Await(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !idle_.empty() || contexts_ < options_.max_concurrent_calls;
    });
    if (!idle_.empty()) {
      std::unique_ptr<Context> context = std::move(idle_.back());
      idle_.pop_back();
      return context;
    }
    ++contexts_;
  }
  // Streams and cuBLAS handles belong to the calling thread's current device.
  auto context = std::make_unique<Context>(options_.device);
  if (absl::Status status = context->Init(); !status.ok()) {
    context.reset();
    MutexLock lock(&mu_);
    --contexts_;
    context_released_.Signal();
    return status;
  }
  return context;
}

void CudaBackend::ReleaseContext(std::unique_ptr<Context> context) {
  // A call that failed half-way may have left copies into its pinned buffers in flight; the
  // next call on this context must not refill them before they finish.
  cudaStreamSynchronize(context->stream);
  MutexLock lock(&mu_);
  idle_.push_back(std::move(context));
  context_released_.Signal();
}

// One Translate / TranslateLayer call on one context: the executor of the plan's target layers
// [layer_begin, layer_end). Pieces are the token chunks the workspace holds (cuda_plan.h
// PlanSteps); each piece runs in groups of target layers that share one batched GEMM per stage:
// gather + strip (one kernel), multiply (cuBLAS; an MLP's hidden stages add and activate in a
// bias + ReLU kernel), then add + rotate + convert (the epilogue kernel).
class CudaCall {
 public:
  CudaCall(const CudaBackendOptions& options, const CudaPreparedMapper& mapper, int layer_begin,
           int layer_end, const CacheView& source, const Positions& positions,
           MutableCacheView* target, Context* context);

  absl::Status Run(int64_t token_chunk);

 private:
  // Device memory the step's matrices are read from (fp32 copies when converted).
  struct GroupWeights {
    const char* stage[3] = {nullptr, nullptr, nullptr};
  };
  // A staged step's output waits in pinned slot `slot` until the host copies it out.
  struct PendingOutput {
    bool valid = false;
    int64_t chunk_begin = 0, chunk_tokens = 0;
    int layer_begin = 0, num_layers = 0;
  };

  absl::Status ClassifyLayers();
  absl::Status ClassifySource(int kind, int layer);
  absl::Status PlanWorkspace(int64_t token_chunk);
  absl::Status UploadPointerTables();
  void SetKernelParams();
  absl::Status ReservePinned();
  absl::Status StageTables(const TokenPiece& piece, int slot);
  absl::Status StageSources(const TokenPiece& piece, int slot);
  absl::Status RunGroup(const TokenPiece& piece, int l0, int group, int step);
  absl::StatusOr<GroupWeights> ConvertWeights(int l0, int group);
  absl::Status MultiplyRidge(const GroupWeights& weights, int64_t tokens, int group);
  absl::Status MultiplyRidgeHeads(const GroupWeights& weights, int64_t tokens, int group);
  absl::Status MultiplyMlp(const GroupWeights& weights, int64_t tokens, int l0, int group);
  absl::Status Emit(const TokenPiece& piece, int l0, int group, int step);
  absl::Status FinishOutput(int slot);

  const CudaBackendOptions& options_;
  const CudaPreparedMapper& mapper_;
  const TranslationPlan& plan_;
  const cuda::DeviceLayout& layout_;
  const int layer_begin_, layer_end_;
  const CacheView& source_;
  const Positions& positions_;
  MutableCacheView* const target_;
  Context* const context_;
  const int source_layers_, target_layers_;
  const int64_t num_tokens_, source_width_, target_width_;
  const size_t in_element_, out_element_;

  // Pointer tables: device layers are read / written in place, host layers through staging.
  std::vector<const void*> source_pointers_;
  std::vector<int> source_slots_;
  std::vector<void*> target_pointers_;
  std::vector<int> target_slots_;
  std::vector<std::pair<int, int>> staged_sources_;  // (kind, layer) per slot
  bool any_staged_target_ = false;

  DType gemm_dtype_ = DType::kFP32;
  bool convert_weights_ = false;
  cuda::StepPlan steps_;
  // Workspace carve-up (byte offsets) and the staged slots' sizes (elements).
  int64_t x_offset_ = 0, y_offset_ = 0, hidden_offset_ = 0, w32_offset_ = 0;
  int64_t table_offset_ = 0, stage_in_offset_ = 0, stage_out_offset_ = 0;
  char* workspace_ = nullptr;
  int64_t stage_in_slot_ = 0, stage_out_slot_ = 0;
  const void* const* source_pointer_table_ = nullptr;
  const int* source_slot_table_ = nullptr;
  const void* const* target_pointer_table_ = nullptr;
  const int* target_slot_table_ = nullptr;

  ki::GatherParams gather_;
  ki::EpilogueParams epilogue_;
  ki::BiasReluParams relu_;  // between the MLP's GEMMs: c1 after the first, c2 after the second
  const float* hidden_bias_[2] = {nullptr, nullptr};
  PendingOutput pending_[2];
};

CudaCall::CudaCall(const CudaBackendOptions& options, const CudaPreparedMapper& mapper,
                   int layer_begin, int layer_end, const CacheView& source,
                   const Positions& positions, MutableCacheView* target, Context* context)
    : options_(options),
      mapper_(mapper),
      plan_(mapper.plan_),
      layout_(mapper.layout_),
      layer_begin_(layer_begin),
      layer_end_(layer_end),
      source_(source),
      positions_(positions),
      target_(target),
      context_(context),
      source_layers_(plan_.mapper().source.num_layers),
      target_layers_(plan_.mapper().target.num_layers),
      num_tokens_(source.num_tokens),
      source_width_(static_cast<int64_t>(source.num_kv_heads) * source.head_dim),
      target_width_(static_cast<int64_t>(target->num_kv_heads) * target->head_dim),
      in_element_(DTypeSize(source.dtype)),
      out_element_(DTypeSize(target->dtype)),
      source_pointers_(2 * source_layers_, nullptr),
      source_slots_(2 * source_layers_, -1),
      target_pointers_(2 * target_layers_, nullptr),
      target_slots_(2 * target_layers_, -1) {}

absl::Status CudaCall::Run(int64_t token_chunk) {
  KVT_CUDA_RETURN_IF_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  if (absl::Status s = ClassifyLayers(); !s.ok()) return s;
  if (absl::Status s = PlanWorkspace(token_chunk); !s.ok()) return s;
  if (absl::Status s = UploadPointerTables(); !s.ok()) return s;
  SetKernelParams();
  if (absl::Status s = ReservePinned(); !s.ok()) return s;
  context_->table_used[0] = context_->table_used[1] = false;
  context_->input_used[0] = context_->input_used[1] = false;
  const std::vector<TokenPiece> pieces =
      FixedPieces(num_tokens_, steps_.chunk_tokens, plan_.window());
  int step = 0;
  for (size_t c = 0; c < pieces.size(); ++c) {
    const TokenPiece& piece = pieces[c];
    if (absl::Status s = StageTables(piece, c % 2); !s.ok()) return s;
    if (absl::Status s = StageSources(piece, c % 2); !s.ok()) return s;
    gather_.chunk_begin = epilogue_.chunk_begin = piece.begin;
    gather_.chunk_tokens = epilogue_.chunk_tokens = piece.rows;
    gather_.window_begin = piece.read_begin;
    for (int l0 = layer_begin_; l0 < layer_end_; l0 += steps_.layers_per_group, ++step) {
      const int group = std::min(steps_.layers_per_group, layer_end_ - l0);
      if (absl::Status s = RunGroup(piece, l0, group, step); !s.ok()) return s;
    }
  }
  KVT_CUDA_RETURN_IF_ERROR("cudaStreamSynchronize", cudaStreamSynchronize(context_->stream));
  for (int s = 0; s < 2; ++s) {
    if (absl::Status status = FinishOutput(s); !status.ok()) return status;
  }
  return absl::OkStatus();
}

// Source layer `layer` of `kind` (0 = K, 1 = V) into the pointer tables, staged when it lives
// in host memory.
absl::Status CudaCall::ClassifySource(int kind, int layer) {
  const int index = kind * source_layers_ + layer;
  if (source_pointers_[index] != nullptr) return absl::OkStatus();
  const void* pointer = kind == 0 ? source_.k[layer] : source_.v[layer];
  source_pointers_[index] = pointer;
  absl::StatusOr<bool> on_device =
      OnDevice(pointer, options_.device, "source", kind == 0 ? "k" : "v", layer);
  if (!on_device.ok()) return on_device.status();
  if (!*on_device) {
    source_slots_[index] = static_cast<int>(staged_sources_.size());
    staged_sources_.emplace_back(kind, layer);
  }
  return absl::OkStatus();
}

// Every layer the call gathers from (the plan's sigma lists) and writes.
absl::Status CudaCall::ClassifyLayers() {
  for (int l = layer_begin_; l < layer_end_; ++l) {
    for (const KindPlan& plan : plan_.layer(l).kinds) {
      const int kind = static_cast<int>(plan.kind);
      for (int j : plan.sigma) {
        if (absl::Status s = ClassifySource(kind, j); !s.ok()) return s;
      }
      void* pointer = kind == 0 ? target_->k[l] : target_->v[l];
      target_pointers_[kind * target_layers_ + l] = pointer;
      absl::StatusOr<bool> on_device =
          OnDevice(pointer, options_.device, "target", kind == 0 ? "k" : "v", l);
      if (!on_device.ok()) return on_device.status();
      if (!*on_device) target_slots_[kind * target_layers_ + l] = 0;
    }
  }
  any_staged_target_ =
      std::any_of(target_slots_.begin(), target_slots_.end(), [](int s) { return s >= 0; });
  return absl::OkStatus();
}

// Tokens and target layers per step within the workspace budget, and the workspace carve-up.
absl::Status CudaCall::PlanWorkspace(int64_t token_chunk) {
  gemm_dtype_ = cuda::GemmDType(source_.dtype, layout_.weight_dtype, target_->dtype);
  convert_weights_ = gemm_dtype_ != layout_.weight_dtype;
  cuda::StepShape shape;
  shape.num_tokens = num_tokens_;
  shape.num_layers = layer_end_ - layer_begin_;
  shape.input_width = layout_.gathered_width();
  shape.target_width = target_width_;
  shape.window = layout_.window;
  shape.hidden_width = layout_.hidden_width();
  shape.weight_elements = layout_.matrix_elements();
  shape.gemm_dtype = gemm_dtype_;
  shape.convert_weights = convert_weights_;
  shape.rope_half_source = plan_.rope().strip_half();
  shape.rope_half_target = plan_.rope().apply_half();
  shape.staged_source_bytes_per_token =
      static_cast<int64_t>(staged_sources_.size()) * source_width_ * in_element_;
  shape.staged_target_bytes_per_layer_token =
      any_staged_target_ ? 2 * target_width_ * static_cast<int64_t>(out_element_) : 0;
  absl::StatusOr<cuda::StepPlan> steps =
      cuda::PlanSteps(shape, token_chunk, options_.workspace_bytes);
  if (!steps.ok()) return steps.status();
  steps_ = *steps;
  y_offset_ = x_offset_ + Align(steps_.x_bytes);
  hidden_offset_ = y_offset_ + Align(steps_.y_bytes);
  w32_offset_ = hidden_offset_ + Align(steps_.hidden_bytes);
  table_offset_ = w32_offset_ + Align(steps_.weights32_bytes);
  stage_in_offset_ = table_offset_ + Align(steps_.table_bytes);
  stage_out_offset_ = stage_in_offset_ + Align(steps_.staged_source_bytes);
  const int64_t workspace_bytes = stage_out_offset_ + Align(steps_.staged_target_bytes);
  if (absl::Status s = context_->workspace.Reserve(workspace_bytes); !s.ok()) return s;
  workspace_ = context_->workspace.data();
  // A staged source slot also holds the window's window - 1 tokens before the chunk.
  stage_in_slot_ = (steps_.chunk_tokens + layout_.window - 1) * source_width_;
  stage_out_slot_ = steps_.chunk_tokens * target_width_;
  return absl::OkStatus();
}

// Pointer tables to the device once per call (the stream orders them before every kernel).
absl::Status CudaCall::UploadPointerTables() {
  const int64_t pointer_bytes = Align(2 * source_layers_ * sizeof(void*)) +
                                Align(2 * source_layers_ * sizeof(int)) +
                                Align(2 * target_layers_ * sizeof(void*)) +
                                Align(2 * target_layers_ * sizeof(int));
  if (absl::Status s = context_->pointer_tables.Reserve(pointer_bytes); !s.ok()) return s;
  if (absl::Status s = context_->pinned_pointers.Reserve(pointer_bytes); !s.ok()) return s;
  // The previous call on this context ended with a stream synchronize: the pinned table is free.
  char* pinned = context_->pinned_pointers.data();
  char* tables = context_->pointer_tables.data();
  int64_t at = 0;
  const auto put = [&](const void* data, int64_t bytes) -> char* {
    std::memcpy(pinned + at, data, bytes);
    char* device = tables + at;
    at += Align(bytes);
    return device;
  };
  source_pointer_table_ = reinterpret_cast<const void* const*>(
      put(source_pointers_.data(), source_pointers_.size() * sizeof(void*)));
  source_slot_table_ =
      reinterpret_cast<const int*>(put(source_slots_.data(), source_slots_.size() * sizeof(int)));
  target_pointer_table_ = reinterpret_cast<const void* const*>(
      put(target_pointers_.data(), target_pointers_.size() * sizeof(void*)));
  target_slot_table_ =
      reinterpret_cast<const int*>(put(target_slots_.data(), target_slots_.size() * sizeof(int)));
  KVT_CUDA_RETURN_IF_ERROR("cudaMemcpyAsync",
                           cudaMemcpyAsync(tables, pinned, at, cudaMemcpyHostToDevice,
                                           context_->stream));
  return absl::OkStatus();
}

// The kernels' parameters that hold for the whole call; the rest is set per piece and group.
void CudaCall::SetKernelParams() {
  const Rope& strip = plan_.rope().strip();
  const Rope& apply = plan_.rope().apply();
  gather_.source = {source_pointer_table_, source_slot_table_, workspace_ + stage_in_offset_,
                    stage_in_slot_};
  gather_.num_source_layers = source_layers_;
  gather_.source_type = static_cast<int>(source_.dtype);
  gather_.source_layout = source_.layout == Layout::kHND ? ki::kHND : ki::kNHD;
  gather_.heads = source_.num_kv_heads;
  gather_.head_dim = source_.head_dim;
  gather_.num_tokens = num_tokens_;
  gather_.sigma = reinterpret_cast<const int*>(mapper_.sigma_.data());
  gather_.max_blocks = layout_.max_blocks;
  gather_.window = layout_.window;
  gather_.x = workspace_ + x_offset_;
  gather_.chains = layout_.ridge_heads;
  gather_.group = layout_.group;
  gather_.chain_first = reinterpret_cast<const int*>(mapper_.chain_first_.data());
  gather_.chain_width = layout_.chain_width;
  gather_.x_type = static_cast<int>(gemm_dtype_);
  gather_.strip.half = plan_.rope().strip_half();
  gather_.strip.neox = strip.style() == RopeStyle::kNeox ? 1 : 0;
  gather_.strip.scale = strip.strip_scale();

  epilogue_.y = reinterpret_cast<const float*>(workspace_ + y_offset_);
  epilogue_.bias = reinterpret_cast<const float*>(mapper_.bias_.data());
  epilogue_.target = {target_pointer_table_, target_slot_table_, workspace_ + stage_out_offset_,
                      stage_out_slot_};
  epilogue_.num_target_layers = target_layers_;
  epilogue_.target_type = static_cast<int>(target_->dtype);
  epilogue_.target_layout = target_->layout == Layout::kHND ? ki::kHND : ki::kNHD;
  epilogue_.heads = target_->num_kv_heads;
  epilogue_.head_dim = target_->head_dim;
  epilogue_.num_tokens = num_tokens_;
  epilogue_.apply.half = plan_.rope().apply_half();
  epilogue_.apply.neox = apply.style() == RopeStyle::kNeox ? 1 : 0;
  // Per-head MLP and head-local ridge outputs come out of their batched GEMM head by head.
  epilogue_.y_head_major =
      (layout_.kind == MapKind::kMlp && layout_.heads > 1) || layout_.head_local() ? 1 : 0;

  relu_.out = workspace_ + hidden_offset_;
  relu_.out_type = static_cast<int>(gemm_dtype_);
  relu_.heads = layout_.heads;
  relu_.hidden = static_cast<int>(layout_.hidden);
  hidden_bias_[0] = reinterpret_cast<const float*>(mapper_.hidden_bias_.data());
  hidden_bias_[1] =
      hidden_bias_[0] + static_cast<int64_t>(target_layers_) * 2 * layout_.hidden_width();
}

// Pinned host slots (two of each, so the host fills one while the GPU copies the other).
absl::Status CudaCall::ReservePinned() {
  const int64_t table_floats =
      plan_.rope().TableLayout(steps_.chunk_tokens + layout_.window - 1, steps_.chunk_tokens)
          .floats;
  for (PinnedBuffer& buffer : context_->pinned_tables) {
    if (absl::Status s = buffer.Reserve(table_floats * sizeof(float)); !s.ok()) return s;
  }
  if (!staged_sources_.empty()) {
    for (PinnedBuffer& buffer : context_->pinned_input) {
      if (absl::Status s = buffer.Reserve(steps_.staged_source_bytes); !s.ok()) return s;
    }
  }
  if (any_staged_target_) {
    for (PinnedBuffer& buffer : context_->pinned_output) {
      if (absl::Status s = buffer.Reserve(steps_.staged_target_bytes); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// RoPE of both models for the piece's positions, from kernels/rope (double-precision angles):
// the source's for every token the piece reads, the target's for its own.
absl::Status CudaCall::StageTables(const TokenPiece& piece, int slot) {
  if (context_->table_used[slot]) {
    KVT_CUDA_RETURN_IF_ERROR("cudaEventSynchronize",
                             cudaEventSynchronize(context_->table_copied[slot]));
  }
  float* host = reinterpret_cast<float*>(context_->pinned_tables[slot].data());
  const RopeTableLayout layout = plan_.rope().Fill(positions_, piece.read_begin,
                                                   piece.read_rows(), piece.begin, piece.rows,
                                                   host);
  float* device = reinterpret_cast<float*>(workspace_ + table_offset_);
  KVT_CUDA_RETURN_IF_ERROR("cudaMemcpyAsync",
                           cudaMemcpyAsync(device, host, layout.floats * sizeof(float),
                                           cudaMemcpyHostToDevice, context_->stream));
  KVT_CUDA_RETURN_IF_ERROR("cudaEventRecord",
                           cudaEventRecord(context_->table_copied[slot], context_->stream));
  context_->table_used[slot] = true;
  gather_.strip.cos = device + layout.strip_cos;
  gather_.strip.sin = device + layout.strip_sin;
  epilogue_.apply.cos = device + layout.apply_cos;
  epilogue_.apply.sin = device + layout.apply_sin;
  return absl::OkStatus();
}

// Host-memory source layers: the tokens this piece reads through pinned memory to the stage.
absl::Status CudaCall::StageSources(const TokenPiece& piece, int slot) {
  if (staged_sources_.empty()) return absl::OkStatus();
  if (context_->input_used[slot]) {
    KVT_CUDA_RETURN_IF_ERROR("cudaEventSynchronize",
                             cudaEventSynchronize(context_->input_copied[slot]));
  }
  const int64_t rows = piece.read_rows();
  const int64_t ds = source_.head_dim;
  char* host = context_->pinned_input[slot].data();
  for (size_t s = 0; s < staged_sources_.size(); ++s) {
    const auto [kind, j] = staged_sources_[s];
    const char* from = static_cast<const char*>(kind == 0 ? source_.k[j] : source_.v[j]);
    char* to = host + s * stage_in_slot_ * in_element_;
    if (source_.layout == Layout::kNHD) {
      std::memcpy(to, from + piece.read_begin * source_width_ * in_element_,
                  rows * source_width_ * in_element_);
      continue;
    }
    for (int h = 0; h < source_.num_kv_heads; ++h) {
      std::memcpy(to + h * rows * ds * in_element_,
                  from + (h * num_tokens_ + piece.read_begin) * ds * in_element_,
                  rows * ds * in_element_);
    }
  }
  KVT_CUDA_RETURN_IF_ERROR("cudaMemcpyAsync",
                           cudaMemcpyAsync(workspace_ + stage_in_offset_, host,
                                           staged_sources_.size() * stage_in_slot_ * in_element_,
                                           cudaMemcpyHostToDevice, context_->stream));
  KVT_CUDA_RETURN_IF_ERROR("cudaEventRecord",
                           cudaEventRecord(context_->input_copied[slot], context_->stream));
  context_->input_used[slot] = true;
  return absl::OkStatus();
}

// The group's matrices of every stage, in the GEMM dtype: the device copy in place, or fp32
// copies in the workspace when the dtypes differ.
absl::StatusOr<CudaCall::GroupWeights> CudaCall::ConvertWeights(int l0, int group) {
  const size_t element = DTypeSize(layout_.weight_dtype);
  const int64_t lk0 = static_cast<int64_t>(l0) * 2;  // first (layer, kind) of the group
  const int64_t group_kinds = static_cast<int64_t>(group) * 2;
  const int stages = static_cast<int>(plan_.layer(l0).kinds[0].map.size());
  GroupWeights weights;
  float* w32 = reinterpret_cast<float*>(workspace_ + w32_offset_);
  for (int s = 0; s < stages; ++s) {
    const int64_t elements = layout_.stage_elements(s);
    weights.stage[s] = mapper_.stage_weights(s).data() + lk0 * elements * element;
    if (!convert_weights_) continue;
    KVT_CUDA_RETURN_IF_ERROR(
        "ToFloat<<<>>>",
        ki::LaunchToFloat(weights.stage[s], static_cast<int>(layout_.weight_dtype), w32,
                          group_kinds * elements, context_->stream));
    weights.stage[s] = reinterpret_cast<const char*>(w32);
    w32 += group_kinds * elements;
  }
  return weights;
}

// Row-major Y[T, n_t d_t] = X[T, K] W[K, n_t d_t] is column-major Y^T = W^T X^T: cuBLAS sees W
// as an (n_t d_t) x K matrix and X as K x T. One batch entry per (layer, kind).
absl::Status CudaCall::MultiplyRidge(const GroupWeights& weights, int64_t tokens, int group) {
  if (layout_.head_local()) return MultiplyRidgeHeads(weights, tokens, group);
  const float alpha = 1.0f, beta = 0.0f;
  const int64_t input_width = layout_.input_width;
  KVT_CUBLAS_RETURN_IF_ERROR(
      "cublasGemmStridedBatchedEx",
      cublasGemmStridedBatchedEx(
          context_->cublas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(target_width_),
          static_cast<int>(tokens), static_cast<int>(input_width), &alpha, weights.stage[0],
          CudaType(gemm_dtype_), static_cast<int>(target_width_), layout_.stage_elements(0),
          workspace_ + x_offset_, CudaType(gemm_dtype_), static_cast<int>(input_width),
          tokens * input_width, &beta, workspace_ + y_offset_, CUDA_R_32F,
          static_cast<int>(target_width_), tokens * target_width_, 2 * group,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

// Head-local: n_t small GEMMs per (layer, kind), all of the group's in one strided batch
// (cuda_plan.h RidgeHeadGemm), Y head-major for the epilogue.
absl::Status CudaCall::MultiplyRidgeHeads(const GroupWeights& weights, int64_t tokens,
                                          int group) {
  const float alpha = 1.0f, beta = 0.0f;
  const cuda::StridedGemm gemm = cuda::RidgeHeadGemm(layout_, tokens, int64_t{2} * group);
  KVT_CUBLAS_RETURN_IF_ERROR(
      "cublasGemmStridedBatchedEx",
      cublasGemmStridedBatchedEx(
          context_->cublas, CUBLAS_OP_N, CUBLAS_OP_N, gemm.m, gemm.n, gemm.k, &alpha,
          weights.stage[0], CudaType(gemm_dtype_), gemm.lda, gemm.stride_a,
          workspace_ + x_offset_, CudaType(gemm_dtype_), gemm.ldb, gemm.stride_b, &beta,
          workspace_ + y_offset_, CUDA_R_32F, gemm.ldc, gemm.stride_c, gemm.batch,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

// cuda_plan.h MlpGemms: A1 for every (layer, kind) (per_head: every head from the shared x in
// one GEMM, A1 interleaved by head), then A2 and A3 per (layer, kind, head); after each stage
// the plan activates, bias + ReLU into the next GEMM's input dtype.
absl::Status CudaCall::MultiplyMlp(const GroupWeights& weights, int64_t tokens, int l0,
                                   int group) {
  const float alpha = 1.0f, beta = 0.0f;
  const int64_t group_kinds = static_cast<int64_t>(group) * 2;
  const std::array<cuda::StridedGemm, 3> gemms = cuda::MlpGemms(layout_, tokens, group_kinds);
  char* y = workspace_ + y_offset_;
  char* activations = workspace_ + hidden_offset_;
  const char* inputs[3] = {workspace_ + x_offset_, activations, activations};
  const std::vector<GemmStage>& stages = plan_.layer(l0).kinds[0].map;
  for (size_t s = 0; s < stages.size(); ++s) {
    const cuda::StridedGemm& gemm = gemms[s];
    KVT_CUBLAS_RETURN_IF_ERROR(
        "cublasGemmStridedBatchedEx",
        cublasGemmStridedBatchedEx(
            context_->cublas, CUBLAS_OP_N, CUBLAS_OP_N, gemm.m, gemm.n, gemm.k, &alpha,
            weights.stage[s], CudaType(gemm_dtype_), gemm.lda, gemm.stride_a, inputs[s],
            CudaType(gemm_dtype_), gemm.ldb, gemm.stride_b, &beta, y, CUDA_R_32F, gemm.ldc,
            gemm.stride_c, gemm.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (!stages[s].activate) continue;
    // relu(Y + c) -> activations [layer, kind][head][T][H] in the gemm dtype; the first GEMM's
    // Y has the heads side by side per token.
    relu_.y = reinterpret_cast<const float*>(y);
    relu_.y_interleaved = s == 0 ? 1 : 0;
    relu_.bias = hidden_bias_[s] + static_cast<int64_t>(l0) * 2 * layout_.hidden_width();
    relu_.rows = group_kinds;
    relu_.chunk_tokens = tokens;
    KVT_CUDA_RETURN_IF_ERROR("BiasRelu<<<>>>", ki::LaunchBiasRelu(relu_, context_->stream));
  }
  return absl::OkStatus();
}

// Target layers [l0, l0 + group) of one piece: gather + strip, multiply, epilogue.
absl::Status CudaCall::RunGroup(const TokenPiece& piece, int l0, int group, int step) {
  absl::StatusOr<GroupWeights> weights = ConvertWeights(l0, group);
  if (!weights.ok()) return weights.status();
  gather_.layer_begin = epilogue_.layer_begin = l0;
  gather_.num_layers = epilogue_.num_layers = group;
  KVT_CUDA_RETURN_IF_ERROR("Gather<<<>>>", ki::LaunchGather(gather_, context_->stream));
  const absl::Status multiplied = layout_.kind == MapKind::kMlp
                                      ? MultiplyMlp(*weights, piece.rows, l0, group)
                                      : MultiplyRidge(*weights, piece.rows, group);
  if (!multiplied.ok()) return multiplied;
  return Emit(piece, l0, group, step);
}

// Add + rotate + convert into the targets; a staged step's output goes to pinned slot
// step % 2 and is copied out after the next step is queued, so the GPU never waits for the host.
absl::Status CudaCall::Emit(const TokenPiece& piece, int l0, int group, int step) {
  const int out_slot = step % 2;
  if (any_staged_target_) {
    // The slot's previous output must be out of pinned memory before it is overwritten.
    if (absl::Status s = FinishOutput(out_slot); !s.ok()) return s;
  }
  KVT_CUDA_RETURN_IF_ERROR("Epilogue<<<>>>", ki::LaunchEpilogue(epilogue_, context_->stream));
  if (!any_staged_target_) return absl::OkStatus();
  KVT_CUDA_RETURN_IF_ERROR(
      "cudaMemcpyAsync",
      cudaMemcpyAsync(context_->pinned_output[out_slot].data(), workspace_ + stage_out_offset_,
                      static_cast<int64_t>(group) * 2 * stage_out_slot_ * out_element_,
                      cudaMemcpyDeviceToHost, context_->stream));
  KVT_CUDA_RETURN_IF_ERROR(
      "cudaEventRecord", cudaEventRecord(context_->output_copied[out_slot], context_->stream));
  pending_[out_slot] = {true, piece.begin, piece.rows, l0, group};
  return FinishOutput(1 - out_slot);
}

// Pinned slot `slot`'s pending output into the host-memory target layers.
absl::Status CudaCall::FinishOutput(int slot) {
  PendingOutput& out = pending_[slot];
  if (!out.valid) return absl::OkStatus();
  out.valid = false;
  KVT_CUDA_RETURN_IF_ERROR("cudaEventSynchronize",
                           cudaEventSynchronize(context_->output_copied[slot]));
  const char* base = context_->pinned_output[slot].data();
  const int64_t dt = target_->head_dim;
  const int64_t bytes = out.chunk_tokens * out_element_;
  for (int g = 0; g < out.num_layers; ++g) {
    const int l = out.layer_begin + g;
    for (int kind = 0; kind < 2; ++kind) {
      if (target_slots_[kind * target_layers_ + l] < 0) continue;
      const char* from =
          base + (static_cast<int64_t>(g) * 2 + kind) * stage_out_slot_ * out_element_;
      char* to = static_cast<char*>(target_pointers_[kind * target_layers_ + l]);
      if (target_->layout == Layout::kNHD) {
        std::memcpy(to + out.chunk_begin * target_width_ * out_element_, from,
                    bytes * target_width_);
        continue;
      }
      for (int h = 0; h < target_->num_kv_heads; ++h) {
        std::memcpy(to + (h * num_tokens_ + out.chunk_begin) * dt * out_element_,
                    from + h * bytes * dt, bytes * dt);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::TranslateLayer(const PreparedMapper& mapper, int target_layer,
                                         const CacheView& source, const Positions& positions,
                                         const TranslateOptions& options,
                                         MutableCacheView* target) {
  if (target == nullptr) return absl::InvalidArgumentError("target is null");
  absl::StatusOr<const CudaPreparedMapper*> prepared = Cast(mapper);
  if (!prepared.ok()) return prepared.status();
  if (absl::Status s = CheckLayerCacheShapes((*prepared)->view(), target_layer, source, *target);
      !s.ok()) {
    return s;
  }
  if (source.num_tokens == 0) return absl::OkStatus();
  return Run(**prepared, target_layer, target_layer + 1, source, positions, options, target);
}

absl::Status CudaBackend::Translate(const PreparedMapper& mapper, const CacheView& source,
                                    const Positions& positions, const TranslateOptions& options,
                                    MutableCacheView* target) {
  if (target == nullptr) return absl::InvalidArgumentError("target is null");
  absl::StatusOr<const CudaPreparedMapper*> prepared = Cast(mapper);
  if (!prepared.ok()) return prepared.status();
  if (absl::Status s = CheckCacheShapes((*prepared)->view(), source, *target); !s.ok()) return s;
  if (source.num_tokens == 0) return absl::OkStatus();
  return Run(**prepared, 0, (*prepared)->view().target.num_layers, source, positions, options,
             target);
}

absl::Status CudaBackend::Run(const CudaPreparedMapper& mapper, int layer_begin, int layer_end,
                              const CacheView& source, const Positions& positions,
                              const TranslateOptions& options, MutableCacheView* target) {
  absl::StatusOr<std::unique_ptr<Context>> context = AcquireContext();
  if (!context.ok()) return context.status();
  const int64_t token_chunk = options.token_chunk > 0 ? options.token_chunk : options_.token_chunk;
  absl::Status status = CudaCall(options_, mapper, layer_begin, layer_end, source, positions,
                                 target, context->get())
                            .Run(token_chunk);
  ReleaseContext(*std::move(context));
  return status;
}


}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(const CudaBackendOptions& options) {
  absl::StatusOr<int> devices = cuda::DeviceCount();
  if (!devices.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("backend cuda: no usable CUDA device (", devices.status().message(), ")"));
  }
  if (options.device < 0 || options.device >= *devices) {
    return absl::InvalidArgumentError(absl::StrCat("backend cuda: device ", options.device,
                                                   " out of range [0, ", *devices, ")"));
  }
  if (options.max_concurrent_calls <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend cuda: max_concurrent_calls=", options.max_concurrent_calls, " must be positive"));
  }
  if (options.workspace_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend cuda: workspace_bytes=", options.workspace_bytes, " must be positive"));
  }
  KVT_CUDA_RETURN_IF_ERROR("cudaSetDevice", cudaSetDevice(options.device));
  // The first runtime call creates the context: fail here, at startup, not in a request.
  KVT_CUDA_RETURN_IF_ERROR("cudaFree", cudaFree(nullptr));
  return std::unique_ptr<Backend>(new CudaBackend(options));
}

#endif  // KVT_HAVE_CUDA

}  // namespace kvt