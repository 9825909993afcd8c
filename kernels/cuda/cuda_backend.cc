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
  const MapperView& view() const override { return view_; }
  uint64_t bytes() const override { return bytes_; }

  MapperView view_;
  int device_ = 0;
  Rope source_rope_;
  Rope target_rope_;
  cuda::DeviceLayout layout_;  // cuda_plan.h: what each buffer below holds
  DType weight_dtype_ = DType::kFP32;
  int max_blocks_ = 0;       // max |sigma| over layers and kinds
  int64_t input_width_ = 0;  // window * max_blocks * n_s * d_s
  // Ridge W or MLP A1, [target layer][kind][window][max_blocks * n_s * d_s][...] in
  // weight_dtype_, each token offset's rows past |sigma| zero (cuda_plan.h DeviceLayout).
  DeviceBuffer weights_;
  DeviceBuffer a2_;           // MLP only: [target layer][kind][heads][H][H]
  DeviceBuffer a3_;           // MLP only: [target layer][kind][heads][H][head_out]
  DeviceBuffer bias_;         // ridge b or MLP c3: [target layer][kind][n_t d_t] fp32
  DeviceBuffer hidden_bias_;  // MLP only: c1 then c2, each [target layer][kind][heads H] fp32
  DeviceBuffer sigma_;        // [target layer][kind][max_blocks] int, -1 padded
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
  absl::Status Run(const CudaPreparedMapper& mapper, int layer_begin, int layer_end,
                   const CacheView& source, const Positions& positions,
                   const TranslateOptions& options, MutableCacheView* target, Context* context);
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

absl::StatusOr<std::shared_ptr<PreparedMapper>> CudaBackend::BeginPrepare(
    const MapperView& mapper) {
  if (absl::Status s = CheckMapperView(mapper); !s.ok()) return s;
  absl::StatusOr<cuda::DeviceLayout> layout_or = cuda::DeviceLayoutOf(mapper);
  if (!layout_or.ok()) return layout_or.status();
  const cuda::DeviceLayout& layout = *layout_or;
  const bool mlp = layout.kind == MapKind::kMlp;
  KVT_CUDA_RETURN_IF_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  auto prepared = std::make_shared<CudaPreparedMapper>();
  prepared->view_ = mapper;
  prepared->device_ = options_.device;
  absl::StatusOr<Rope> source_rope = Rope::Create(mapper.source.rope, mapper.source.head_dim);
  if (!source_rope.ok()) return source_rope.status();
  absl::StatusOr<Rope> target_rope = Rope::Create(mapper.target.rope, mapper.target.head_dim);
  if (!target_rope.ok()) return target_rope.status();
  prepared->source_rope_ = *std::move(source_rope);
  prepared->target_rope_ = *std::move(target_rope);

  const int layers = mapper.target.num_layers;
  prepared->layout_ = layout;
  prepared->weight_dtype_ = layout.weight_dtype;
  prepared->max_blocks_ = layout.max_blocks;
  prepared->input_width_ = layout.input_width;
  const int64_t element = static_cast<int64_t>(DTypeSize(layout.weight_dtype));
  // Ridge W or MLP A1: the matrices whose rows follow the (padded) sigma blocks, per token
  // offset.
  const int64_t first_bytes =
      static_cast<int64_t>(layers) * 2 *
      (mlp ? layout.a1_elements() : layout.matrix_elements()) * element;
  if (absl::Status s = prepared->weights_.Reserve(first_bytes); !s.ok()) return s;
  if (layout.padded) {
    // Rows of the padding blocks multiply zeros in X, but NaN * 0 is NaN: they must be zero.
    KVT_CUDA_RETURN_IF_ERROR("cudaMemset", cudaMemset(prepared->weights_.data(), 0, first_bytes));
  }
  const int64_t a2_bytes = static_cast<int64_t>(layers) * 2 * layout.a2_elements() * element;
  const int64_t a3_bytes = static_cast<int64_t>(layers) * 2 * layout.a3_elements() * element;
  if (mlp) {
    if (absl::Status s = prepared->a2_.Reserve(a2_bytes); !s.ok()) return s;
    if (absl::Status s = prepared->a3_.Reserve(a3_bytes); !s.ok()) return s;
  }
  const int64_t target_width = layout.target_width;
  const int64_t hidden_width = layout.hidden_width();
  std::vector<float> bias(static_cast<size_t>(layers) * 2 * target_width, 0.0f);
  // c1 for every (layer, kind), then c2 for every (layer, kind).
  std::vector<float> hidden_bias(static_cast<size_t>(layers) * 2 * 2 * hidden_width, 0.0f);
  const size_t c2_offset = static_cast<size_t>(layers) * 2 * hidden_width;
  std::vector<int> sigma(static_cast<size_t>(layers) * 2 * layout.max_blocks, -1);
  for (int l = 0; l < layers; ++l) {
    const LayerMapView& layer = mapper.layers[l];
    // MLP c3 [heads][head_out] is the n_t d_t output columns in order, like ridge's b.
    const WeightView* biases[2] = {mlp ? &layer.mlp_k.c3 : &layer.b_k,
                                   mlp ? &layer.mlp_v.c3 : &layer.b_v};
    const MlpView* chains[2] = {&layer.mlp_k, &layer.mlp_v};
    const std::vector<int>* sigmas[2] = {&layer.sigma_k, &layer.sigma_v};
    for (int kind = 0; kind < 2; ++kind) {
      const size_t lk = static_cast<size_t>(l) * 2 + kind;
      if (biases[kind]->data != nullptr) {
        ToFloat(biases[kind]->dtype, biases[kind]->data, bias.data() + lk * target_width,
                target_width);
      }
      if (mlp) {
        // c1, c2 [heads][H]: head h's units at [h H, (h+1) H), as in the stacked activations.
        ToFloat(chains[kind]->c1.dtype, chains[kind]->c1.data,
                hidden_bias.data() + lk * hidden_width, hidden_width);
        ToFloat(chains[kind]->c2.dtype, chains[kind]->c2.data,
                hidden_bias.data() + c2_offset + lk * hidden_width, hidden_width);
      }
      std::copy(sigmas[kind]->begin(), sigmas[kind]->end(),
                sigma.begin() + lk * layout.max_blocks);
    }
  }
  if (absl::Status s = prepared->bias_.Reserve(bias.size() * sizeof(float)); !s.ok()) return s;
  KVT_CUDA_RETURN_IF_ERROR("cudaMemcpy", cudaMemcpy(prepared->bias_.data(), bias.data(),
                                                    bias.size() * sizeof(float),
                                                    cudaMemcpyHostToDevice));
  if (mlp) {
    if (absl::Status s = prepared->hidden_bias_.Reserve(hidden_bias.size() * sizeof(float));
        !s.ok()) {
      return s;
    }
    KVT_CUDA_RETURN_IF_ERROR("cudaMemcpy",
                             cudaMemcpy(prepared->hidden_bias_.data(), hidden_bias.data(),
                                        hidden_bias.size() * sizeof(float),
                                        cudaMemcpyHostToDevice));
  }
  if (absl::Status s = prepared->sigma_.Reserve(sigma.size() * sizeof(int)); !s.ok()) return s;
  KVT_CUDA_RETURN_IF_ERROR("cudaMemcpy", cudaMemcpy(prepared->sigma_.data(), sigma.data(),
                                                    sigma.size() * sizeof(int),
                                                    cudaMemcpyHostToDevice));
  // The same sum PreparedBytesEstimate reserves by (DeviceLayout::prepared_bytes).
  prepared->bytes_ = static_cast<uint64_t>(first_bytes + (mlp ? a2_bytes + a3_bytes : 0)) +
                     bias.size() * sizeof(float) + (mlp ? hidden_bias.size() * sizeof(float) : 0) +
                     sigma.size() * sizeof(int);
  // A pageable cudaMemcpy may return before its DMA lands, and translations run on
  // non-blocking streams that do not wait for the legacy stream: wait here.
  KVT_CUDA_RETURN_IF_ERROR("cudaStreamSynchronize", cudaStreamSynchronize(cudaStreamLegacy));
  return std::shared_ptr<PreparedMapper>(std::move(prepared));
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
  const LayerMapView& layer = mapper.layers[target_layer];
  const cuda::DeviceLayout& layout = prepared->layout_;
  const size_t element = DTypeSize(prepared->weight_dtype_);
  std::vector<float> converted;
  std::vector<char> interleaved;
  // `w` into device memory at `device`, converted to the device copy's dtype (fp32 when the
  // stored dtypes differ); per_head A1 (`heads` > 1) interleaved by head (cuda_plan.h).
  // `input_rows`: W and A1, whose rows follow the window's token offsets, padded per offset on
  // the device (cuda_plan.h InputRowCopiesOf).
  const auto upload = [&](const WeightView& w, char* device, int heads,
                          bool input_rows) -> absl::Status {
    const int64_t count = w.rows * w.cols;
    const void* host = w.data;
    if (w.dtype != prepared->weight_dtype_) {
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
          "cudaMemcpy",
          cudaMemcpy(device + o * copies.device_stride,
                     static_cast<const char*>(host) + o * copies.bytes, copies.bytes,
                     cudaMemcpyHostToDevice));
    }
    return absl::OkStatus();
  };
  for (int kind = 0; kind < 2; ++kind) {
    const int64_t lk = static_cast<int64_t>(target_layer) * 2 + kind;
    if (layout.kind != MapKind::kMlp) {
      const WeightView& w = kind == 0 ? layer.w_k : layer.w_v;
      if (absl::Status s = upload(w, prepared->weights_.data() +
                                         lk * layout.matrix_elements() * element, 1, true);
          !s.ok()) {
        return s;
      }
      continue;
    }
    // A2 [heads H][H] and A3 [heads H][head_out] are stored head by head already.
    const MlpView& chain = kind == 0 ? layer.mlp_k : layer.mlp_v;
    if (absl::Status s = upload(chain.a1,
                                prepared->weights_.data() + lk * layout.a1_elements() * element,
                                layout.heads, true);
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            upload(chain.a2, prepared->a2_.data() + lk * layout.a2_elements() * element, 1,
                   false);
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            upload(chain.a3, prepared->a3_.data() + lk * layout.a3_elements() * element, 1,
                   false);
        !s.ok()) {
      return s;
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
  absl::StatusOr<std::unique_ptr<Context>> context = AcquireContext();
  if (!context.ok()) return context.status();
  absl::Status status = Run(**prepared, target_layer, target_layer + 1, source, positions,
                            options, target, context->get());
  ReleaseContext(*std::move(context));
  return status;
}

absl::Status CudaBackend::Translate(const PreparedMapper& mapper, const CacheView& source,
                                    const Positions& positions, const TranslateOptions& options,
                                    MutableCacheView* target) {
  if (target == nullptr) return absl::InvalidArgumentError("target is null");
  absl::StatusOr<const CudaPreparedMapper*> prepared = Cast(mapper);
  if (!prepared.ok()) return prepared.status();
  if (absl::Status s = CheckCacheShapes((*prepared)->view(), source, *target); !s.ok()) return s;
  if (source.num_tokens == 0) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<Context>> context = AcquireContext();
  if (!context.ok()) return context.status();
  absl::Status status = Run(**prepared, 0, (*prepared)->view().target.num_layers, source,
                            positions, options, target, context->get());
  ReleaseContext(*std::move(context));
  return status;
}

absl::Status CudaBackend::Run(const CudaPreparedMapper& mapper, int layer_begin, int layer_end,
                              const CacheView& source, const Positions& positions,
                              const TranslateOptions& options, MutableCacheView* target,
                              Context* context) {
  KVT_CUDA_RETURN_IF_ERROR("cudaSetDevice", cudaSetDevice(options_.device));
  const MapperView& view = mapper.view();
  const int source_layers = view.source.num_layers;
  const int target_layers = view.target.num_layers;
  const int64_t num_tokens = source.num_tokens;
  const int ns = source.num_kv_heads, ds = source.head_dim;
  const int nt = target->num_kv_heads, dt = target->head_dim;
  const int64_t source_width = static_cast<int64_t>(ns) * ds;
  const int64_t target_width = static_cast<int64_t>(nt) * dt;
  const size_t in_element = DTypeSize(source.dtype);
  const size_t out_element = DTypeSize(target->dtype);

  // Pointer tables: device layers are read / written in place, host layers through staging.
  std::vector<const void*> source_pointers(2 * source_layers, nullptr);
  std::vector<int> source_slots(2 * source_layers, -1);
  std::vector<void*> target_pointers(2 * target_layers, nullptr);
  std::vector<int> target_slots(2 * target_layers, -1);
  std::vector<std::pair<int, int>> staged_sources;  // (kind, layer) per slot
  const char* kind_names[2] = {"k", "v"};
  for (int l = layer_begin; l < layer_end; ++l) {
    const std::vector<int>* sigmas[2] = {&view.layers[l].sigma_k, &view.layers[l].sigma_v};
    for (int kind = 0; kind < 2; ++kind) {
      for (int j : *sigmas[kind]) {
        const int index = kind * source_layers + j;
        if (source_pointers[index] != nullptr) continue;
        const void* pointer = kind == 0 ? source.k[j] : source.v[j];
        source_pointers[index] = pointer;
        absl::StatusOr<bool> on_device =
            OnDevice(pointer, options_.device, "source", kind_names[kind], j);
        if (!on_device.ok()) return on_device.status();
        if (!*on_device) {
          source_slots[index] = static_cast<int>(staged_sources.size());
          staged_sources.emplace_back(kind, j);
        }
      }
      void* pointer = kind == 0 ? target->k[l] : target->v[l];
      target_pointers[kind * target_layers + l] = pointer;
      absl::StatusOr<bool> on_device =
          OnDevice(pointer, options_.device, "target", kind_names[kind], l);
      if (!on_device.ok()) return on_device.status();
      if (!*on_device) target_slots[kind * target_layers + l] = 0;
    }
  }
  const bool any_staged_target =
      std::any_of(target_slots.begin(), target_slots.end(), [](int s) { return s >= 0; });

  const DType gemm_dtype = cuda::GemmDType(source.dtype, mapper.weight_dtype_, target->dtype);
  const bool convert_weights = gemm_dtype != mapper.weight_dtype_;
  const Rope& strip = mapper.source_rope_;
  const Rope& apply = mapper.target_rope_;
  const int strip_half = strip.rotary_dim() / 2;
  const int apply_half = apply.rotary_dim() / 2;

  cuda::StepShape shape;
  shape.num_tokens = num_tokens;
  shape.num_layers = layer_end - layer_begin;
  shape.input_width = mapper.input_width_;
  shape.target_width = target_width;
  const cuda::DeviceLayout& layout = mapper.layout_;
  const bool mlp = layout.kind == MapKind::kMlp;
  const int window = layout.window;
  shape.window = window;
  shape.hidden_width = layout.hidden_width();
  shape.weight_elements = layout.matrix_elements();
  shape.gemm_dtype = gemm_dtype;
  shape.convert_weights = convert_weights;
  shape.rope_half_source = strip_half;
  shape.rope_half_target = apply_half;
  shape.staged_source_bytes_per_token =
      static_cast<int64_t>(staged_sources.size()) * source_width * in_element;
  shape.staged_target_bytes_per_layer_token =
      any_staged_target ? 2 * target_width * static_cast<int64_t>(out_element) : 0;
  const int64_t token_chunk = options.token_chunk > 0 ? options.token_chunk : options_.token_chunk;
  absl::StatusOr<cuda::StepPlan> plan_or =
      cuda::PlanSteps(shape, token_chunk, options_.workspace_bytes);
  if (!plan_or.ok()) return plan_or.status();
  const cuda::StepPlan& plan = *plan_or;
  const int64_t chunk = plan.chunk_tokens;

  // Workspace carve-up.
  const int64_t x_offset = 0;
  const int64_t y_offset = x_offset + Align(plan.x_bytes);
  const int64_t hidden_offset = y_offset + Align(plan.y_bytes);
  const int64_t w32_offset = hidden_offset + Align(plan.hidden_bytes);
  const int64_t table_offset = w32_offset + Align(plan.weights32_bytes);
  const int64_t stage_in_offset = table_offset + Align(plan.table_bytes);
  const int64_t stage_out_offset = stage_in_offset + Align(plan.staged_source_bytes);
  const int64_t workspace_bytes = stage_out_offset + Align(plan.staged_target_bytes);
  if (absl::Status s = context->workspace.Reserve(workspace_bytes); !s.ok()) return s;
  char* workspace = context->workspace.data();
  // A staged source slot also holds the window's window - 1 tokens before the chunk.
  const int64_t stage_in_slot = (chunk + window - 1) * source_width;  // elements
  const int64_t stage_out_slot = chunk * target_width;  // elements

  // Pointer tables to the device once per call (the stream orders them before every kernel).
  const int64_t pointer_bytes = Align(2 * source_layers * sizeof(void*)) +
                                Align(2 * source_layers * sizeof(int)) +
                                Align(2 * target_layers * sizeof(void*)) +
                                Align(2 * target_layers * sizeof(int));
  if (absl::Status s = context->pointer_tables.Reserve(pointer_bytes); !s.ok()) return s;
  if (absl::Status s = context->pinned_pointers.Reserve(pointer_bytes); !s.ok()) return s;
  // The previous call on this context ended with a stream synchronize: the pinned table is free.
  char* pinned = context->pinned_pointers.data();
  char* tables = context->pointer_tables.data();
  int64_t at = 0;
  const auto put = [&](const void* data, int64_t bytes) -> char* {
    std::memcpy(pinned + at, data, bytes);
    char* device = tables + at;
    at += Align(bytes);
    return device;
  };
  const auto* source_pointer_table = reinterpret_cast<const void* const*>(
      put(source_pointers.data(), source_pointers.size() * sizeof(void*)));
  const auto* source_slot_table =
      reinterpret_cast<const int*>(put(source_slots.data(), source_slots.size() * sizeof(int)));
  const auto* target_pointer_table = reinterpret_cast<const void* const*>(
      put(target_pointers.data(), target_pointers.size() * sizeof(void*)));
  const auto* target_slot_table =
      reinterpret_cast<const int*>(put(target_slots.data(), target_slots.size() * sizeof(int)));
  KVT_CUDA_RETURN_IF_ERROR("cudaMemcpyAsync",
                           cudaMemcpyAsync(tables, pinned, at, cudaMemcpyHostToDevice,
                                           context->stream));

  ki::GatherParams gather;
  gather.source.pointers = source_pointer_table;
  gather.source.stage_slot = source_slot_table;
  gather.source.stage = workspace + stage_in_offset;
  gather.source.stage_slot_elements = stage_in_slot;
  gather.num_source_layers = source_layers;
  gather.source_type = static_cast<int>(source.dtype);
  gather.source_layout = source.layout == Layout::kHND ? ki::kHND : ki::kNHD;
  gather.heads = ns;
  gather.head_dim = ds;
  gather.num_tokens = num_tokens;
  gather.sigma = reinterpret_cast<const int*>(mapper.sigma_.data());
  gather.max_blocks = mapper.max_blocks_;
  gather.window = window;
  gather.x = workspace + x_offset;
  gather.x_type = static_cast<int>(gemm_dtype);
  gather.strip.half = strip_half;
  gather.strip.neox = strip.style() == RopeStyle::kNeox ? 1 : 0;
  gather.strip.scale =
      static_cast<float>(1.0 / (strip.attention_factor() * strip.attention_factor()));

  ki::EpilogueParams epilogue;
  epilogue.y = reinterpret_cast<const float*>(workspace + y_offset);
  epilogue.bias = reinterpret_cast<const float*>(mapper.bias_.data());
  epilogue.target.pointers = target_pointer_table;
  epilogue.target.stage_slot = target_slot_table;
  epilogue.target.stage = workspace + stage_out_offset;
  epilogue.target.stage_slot_elements = stage_out_slot;
  epilogue.num_target_layers = target_layers;
  epilogue.target_type = static_cast<int>(target->dtype);
  epilogue.target_layout = target->layout == Layout::kHND ? ki::kHND : ki::kNHD;
  epilogue.heads = nt;
  epilogue.head_dim = dt;
  epilogue.num_tokens = num_tokens;
  epilogue.apply.half = apply_half;
  epilogue.apply.neox = apply.style() == RopeStyle::kNeox ? 1 : 0;
  // Per-head MLP outputs come out of their batched GEMM head by head.
  epilogue.y_head_major = mlp && layout.heads > 1 ? 1 : 0;

  // Bias + ReLU between the MLP's GEMMs: c1 after the first, c2 after the second.
  ki::BiasReluParams relu;
  relu.out = workspace + hidden_offset;
  relu.out_type = static_cast<int>(gemm_dtype);
  relu.heads = layout.heads;
  relu.hidden = static_cast<int>(layout.hidden);
  const float* c1 = reinterpret_cast<const float*>(mapper.hidden_bias_.data());
  const float* c2 = c1 + static_cast<int64_t>(target_layers) * 2 * layout.hidden_width();

  float* device_tables = reinterpret_cast<float*>(workspace + table_offset);
  const int64_t table_floats = (chunk + window - 1) * 2 * strip_half + chunk * 2 * apply_half;
  for (PinnedBuffer& buffer : context->pinned_tables) {
    if (absl::Status s = buffer.Reserve(table_floats * sizeof(float)); !s.ok()) return s;
  }
  if (!staged_sources.empty()) {
    for (PinnedBuffer& buffer : context->pinned_input) {
      if (absl::Status s = buffer.Reserve(plan.staged_source_bytes); !s.ok()) return s;
    }
  }
  if (any_staged_target) {
    for (PinnedBuffer& buffer : context->pinned_output) {
      if (absl::Status s = buffer.Reserve(plan.staged_target_bytes); !s.ok()) return s;
    }
  }
  context->table_used[0] = context->table_used[1] = false;
  context->input_used[0] = context->input_used[1] = false;

  // A staged step's output waits in pinned slot `slot` until the host copies it out; that copy
  // happens after the next step is queued, so the GPU is never idle waiting for the host.
  struct PendingOutput {
    bool valid = false;
    int64_t chunk_begin = 0, chunk_tokens = 0;
    int layer_begin = 0, num_layers = 0;
  };
  PendingOutput pending[2];
  const auto finish_output = [&](int slot) -> absl::Status {
    PendingOutput& out = pending[slot];
    if (!out.valid) return absl::OkStatus();
    out.valid = false;
    KVT_CUDA_RETURN_IF_ERROR("cudaEventSynchronize",
                             cudaEventSynchronize(context->output_copied[slot]));
    const char* base = context->pinned_output[slot].data();
    for (int g = 0; g < out.num_layers; ++g) {
      const int l = out.layer_begin + g;
      for (int kind = 0; kind < 2; ++kind) {
        if (target_slots[kind * target_layers + l] < 0) continue;
        const char* from = base + (static_cast<int64_t>(g) * 2 + kind) * stage_out_slot *
                                      static_cast<int64_t>(out_element);
        char* to = static_cast<char*>(target_pointers[kind * target_layers + l]);
        if (target->layout == Layout::kNHD) {
          std::memcpy(to + out.chunk_begin * target_width * out_element, from,
                      out.chunk_tokens * target_width * out_element);
        } else {
          for (int h = 0; h < nt; ++h) {
            std::memcpy(to + (h * num_tokens + out.chunk_begin) * dt * out_element,
                        from + h * out.chunk_tokens * dt * out_element,
                        out.chunk_tokens * dt * out_element);
          }
        }
      }
    }
    return absl::OkStatus();
  };

  const float alpha = 1.0f, beta = 0.0f;
  const size_t weight_element = DTypeSize(mapper.weight_dtype_);
  // Elements per (layer, kind) of the weights_ buffer: ridge W or MLP A1.
  const int64_t matrix_elements = mlp ? layout.a1_elements() : layout.matrix_elements();
  const int64_t a2_elements = layout.a2_elements(), a3_elements = layout.a3_elements();
  const int64_t hidden_width = layout.hidden_width();
  char* y = workspace + y_offset;
  char* activations = workspace + hidden_offset;
  int step = 0;
  for (int c = 0; c < plan.num_chunks; ++c) {
    const int64_t t0 = c * chunk;
    const int64_t tokens = std::min(chunk, num_tokens - t0);
    if (tokens <= 0) break;
    const int slot = c % 2;
    // The chunk's rows read source tokens [window_begin, t0 + tokens): its own and, for a
    // window mapper, up to window - 1 before it.
    const int64_t window_begin = std::max<int64_t>(0, t0 - (window - 1));
    const int64_t window_tokens = t0 + tokens - window_begin;

    // RoPE of both models for these positions, from kernels/rope (double-precision angles): the
    // source's for every token the chunk reads, the target's for the chunk's own.
    if (context->table_used[slot]) {
      KVT_CUDA_RETURN_IF_ERROR("cudaEventSynchronize",
                               cudaEventSynchronize(context->table_copied[slot]));
    }
    float* host_tables = reinterpret_cast<float*>(context->pinned_tables[slot].data());
    float* strip_cos = host_tables;
    float* strip_sin = strip_cos + window_tokens * strip_half;
    float* apply_cos = strip_sin + window_tokens * strip_half;
    float* apply_sin = apply_cos + tokens * apply_half;
    RopeTablesFor(strip, positions, window_begin, window_tokens, strip_cos, strip_sin);
    RopeTablesFor(apply, positions, t0, tokens, apply_cos, apply_sin);
    const int64_t used_floats = window_tokens * 2 * strip_half + tokens * 2 * apply_half;
    KVT_CUDA_RETURN_IF_ERROR("cudaMemcpyAsync",
                             cudaMemcpyAsync(device_tables, host_tables, used_floats * sizeof(float),
                                             cudaMemcpyHostToDevice, context->stream));
    KVT_CUDA_RETURN_IF_ERROR("cudaEventRecord",
                             cudaEventRecord(context->table_copied[slot], context->stream));
    context->table_used[slot] = true;
    gather.strip.cos = device_tables;
    gather.strip.sin = device_tables + window_tokens * strip_half;
    epilogue.apply.cos = device_tables + window_tokens * 2 * strip_half;
    epilogue.apply.sin = epilogue.apply.cos + tokens * apply_half;

    // Host-memory source layers: the tokens this chunk reads through pinned memory to the stage.
    if (!staged_sources.empty()) {
      if (context->input_used[slot]) {
        KVT_CUDA_RETURN_IF_ERROR("cudaEventSynchronize",
                                 cudaEventSynchronize(context->input_copied[slot]));
      }
      char* host = context->pinned_input[slot].data();
      for (size_t s = 0; s < staged_sources.size(); ++s) {
        const auto [kind, j] = staged_sources[s];
        const char* from = static_cast<const char*>(kind == 0 ? source.k[j] : source.v[j]);
        char* to = host + s * stage_in_slot * in_element;
        if (source.layout == Layout::kNHD) {
          std::memcpy(to, from + window_begin * source_width * in_element,
                      window_tokens * source_width * in_element);
        } else {
          for (int h = 0; h < ns; ++h) {
            std::memcpy(to + h * window_tokens * ds * in_element,
                        from + (h * num_tokens + window_begin) * ds * in_element,
                        window_tokens * ds * in_element);
          }
        }
      }
      KVT_CUDA_RETURN_IF_ERROR(
          "cudaMemcpyAsync",
          cudaMemcpyAsync(workspace + stage_in_offset, host,
                          staged_sources.size() * stage_in_slot * in_element,
                          cudaMemcpyHostToDevice, context->stream));
      KVT_CUDA_RETURN_IF_ERROR("cudaEventRecord",
                               cudaEventRecord(context->input_copied[slot], context->stream));
      context->input_used[slot] = true;
    }

    gather.chunk_begin = epilogue.chunk_begin = t0;
    gather.chunk_tokens = epilogue.chunk_tokens = tokens;
    gather.window_begin = window_begin;
    for (int l0 = layer_begin; l0 < layer_end; l0 += plan.layers_per_group, ++step) {
      const int group = std::min(plan.layers_per_group, layer_end - l0);
      const int out_slot = step % 2;
      const int64_t lk0 = static_cast<int64_t>(l0) * 2;  // first (layer, kind) of the group
      const int64_t group_kinds = static_cast<int64_t>(group) * 2;
      const char* weights = mapper.weights_.data() + lk0 * matrix_elements * weight_element;
      const char* a2 = mlp ? mapper.a2_.data() + lk0 * a2_elements * weight_element : nullptr;
      const char* a3 = mlp ? mapper.a3_.data() + lk0 * a3_elements * weight_element : nullptr;
      if (convert_weights) {
        float* w32 = reinterpret_cast<float*>(workspace + w32_offset);
        const int type = static_cast<int>(mapper.weight_dtype_);
        KVT_CUDA_RETURN_IF_ERROR(
            "ToFloat<<<>>>", ki::LaunchToFloat(weights, type, w32, group_kinds * matrix_elements,
                                               context->stream));
        weights = reinterpret_cast<const char*>(w32);
        if (mlp) {
          float* a2_32 = w32 + group_kinds * matrix_elements;
          float* a3_32 = a2_32 + group_kinds * a2_elements;
          KVT_CUDA_RETURN_IF_ERROR(
              "ToFloat<<<>>>",
              ki::LaunchToFloat(a2, type, a2_32, group_kinds * a2_elements, context->stream));
          KVT_CUDA_RETURN_IF_ERROR(
              "ToFloat<<<>>>",
              ki::LaunchToFloat(a3, type, a3_32, group_kinds * a3_elements, context->stream));
          a2 = reinterpret_cast<const char*>(a2_32);
          a3 = reinterpret_cast<const char*>(a3_32);
        }
      }
      gather.layer_begin = epilogue.layer_begin = l0;
      gather.num_layers = epilogue.num_layers = group;
      KVT_CUDA_RETURN_IF_ERROR("Gather<<<>>>", ki::LaunchGather(gather, context->stream));
      if (mlp) {
        // cuda_plan.h MlpGemms: A1 for every (layer, kind) (per_head: every head from the
        // shared x in one GEMM, A1 interleaved by head), then A2 and A3 per (layer, kind, head),
        // with bias + ReLU into the next GEMM's input dtype between them.
        const std::array<cuda::StridedGemm, 3> gemms =
            cuda::MlpGemms(layout, tokens, group_kinds);
        const char* a_operands[3] = {weights, a2, a3};
        const char* b_operands[3] = {workspace + x_offset, activations, activations};
        const float* hidden_biases[2] = {c1 + lk0 * hidden_width, c2 + lk0 * hidden_width};
        for (int stage = 0; stage < 3; ++stage) {
          const cuda::StridedGemm& gemm = gemms[stage];
          KVT_CUBLAS_RETURN_IF_ERROR(
              "cublasGemmStridedBatchedEx",
              cublasGemmStridedBatchedEx(
                  context->cublas, CUBLAS_OP_N, CUBLAS_OP_N, gemm.m, gemm.n, gemm.k, &alpha,
                  a_operands[stage], CudaType(gemm_dtype), gemm.lda, gemm.stride_a,
                  b_operands[stage], CudaType(gemm_dtype), gemm.ldb, gemm.stride_b, &beta, y,
                  CUDA_R_32F, gemm.ldc, gemm.stride_c, gemm.batch, CUBLAS_COMPUTE_32F,
                  CUBLAS_GEMM_DEFAULT));
          if (stage == 2) break;
          // relu(Y + c) -> activations [layer, kind][head][T][H] in the gemm dtype; the first
          // GEMM's Y has the heads side by side per token.
          relu.y = reinterpret_cast<const float*>(y);
          relu.y_interleaved = stage == 0 ? 1 : 0;
          relu.bias = hidden_biases[stage];
          relu.rows = group_kinds;
          relu.chunk_tokens = tokens;
          KVT_CUDA_RETURN_IF_ERROR("BiasRelu<<<>>>", ki::LaunchBiasRelu(relu, context->stream));
        }
      } else {
        // Row-major Y[T, n_t d_t] = X[T, K] W[K, n_t d_t] is column-major Y^T = W^T X^T: cuBLAS
        // sees W as an (n_t d_t) x K matrix and X as K x T. One batch entry per (layer, kind).
        KVT_CUBLAS_RETURN_IF_ERROR(
            "cublasGemmStridedBatchedEx",
            cublasGemmStridedBatchedEx(
                context->cublas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(target_width),
                static_cast<int>(tokens), static_cast<int>(mapper.input_width_), &alpha, weights,
                CudaType(gemm_dtype), static_cast<int>(target_width), matrix_elements,
                workspace + x_offset, CudaType(gemm_dtype), static_cast<int>(mapper.input_width_),
                tokens * mapper.input_width_, &beta, workspace + y_offset, CUDA_R_32F,
                static_cast<int>(target_width), tokens * target_width, 2 * group,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }
      if (any_staged_target) {
        // The slot's previous output must be out of pinned memory before it is overwritten.
        if (absl::Status s = finish_output(out_slot); !s.ok()) return s;
      }
      KVT_CUDA_RETURN_IF_ERROR("Epilogue<<<>>>", ki::LaunchEpilogue(epilogue, context->stream));
      if (any_staged_target) {
        KVT_CUDA_RETURN_IF_ERROR(
            "cudaMemcpyAsync",
            cudaMemcpyAsync(context->pinned_output[out_slot].data(), workspace + stage_out_offset,
                            static_cast<int64_t>(group) * 2 * stage_out_slot * out_element,
                            cudaMemcpyDeviceToHost, context->stream));
        KVT_CUDA_RETURN_IF_ERROR(
            "cudaEventRecord", cudaEventRecord(context->output_copied[out_slot], context->stream));
        pending[out_slot] = {true, t0, tokens, l0, group};
        if (absl::Status s = finish_output(1 - out_slot); !s.ok()) return s;
      }
    }
  }
  KVT_CUDA_RETURN_IF_ERROR("cudaStreamSynchronize", cudaStreamSynchronize(context->stream));
  for (int s = 0; s < 2; ++s) {
    if (absl::Status status = finish_output(s); !status.ok()) return status;
  }
  return absl::OkStatus();
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
