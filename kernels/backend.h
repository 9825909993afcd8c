// The Backend interface every translation engine implements (CPU with BLAS, CUDA with cuBLAS):
// prepare a mapper's weights once, then translate whole caches or single target layers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/mapper_view.h"
#include "kernels/rope.h"
#include "kernels/types.h"

namespace kvt {

// One model's cache for a request: per layer, K and V each contiguous in `layout`.
struct CacheView {
  DType dtype = DType::kFP32;
  Layout layout = Layout::kHND;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t num_tokens = 0;
  std::vector<const void*> k;  // one pointer per layer
  std::vector<const void*> v;
};

struct MutableCacheView {
  DType dtype = DType::kFP32;
  Layout layout = Layout::kHND;
  int num_kv_heads = 0;
  int head_dim = 0;
  int64_t num_tokens = 0;
  std::vector<void*> k;
  std::vector<void*> v;
};

// Backend-specific copy of a mapper's weights (e.g. fp32 for BLAS, device memory for CUDA).
class PreparedMapper {
 public:
  virtual ~PreparedMapper() = default;
  virtual const MapperView& view() const = 0;
  // Bytes this preparation holds beyond the store's copy.
  virtual uint64_t bytes() const = 0;
};

struct TranslateOptions {
  // Tokens processed per step; bounds the working memory (0 = backend default).
  int64_t token_chunk = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;    // "cpu", "cuda"
  virtual std::string device() const = 0;  // "cpu", "cuda:0"
  // One line for the startup log: the engine and how it computes (e.g. the CPU's GEMM path).
  virtual std::string description() const { return name(); }

  virtual absl::StatusOr<std::shared_ptr<PreparedMapper>> Prepare(const MapperView& mapper) = 0;

  // Computes target layer `target_layer` (K and V) for all tokens. Reads only the source layers
  // in that layer's sigma lists, so a caller may start before other layers have arrived.
  virtual absl::Status TranslateLayer(const PreparedMapper& mapper, int target_layer,
                                      const CacheView& source, const Positions& positions,
                                      const TranslateOptions& options,
                                      MutableCacheView* target) = 0;

  // Every target layer. Shapes are checked against the mapper; errors name the field.
  virtual absl::Status Translate(const PreparedMapper& mapper, const CacheView& source,
                                 const Positions& positions, const TranslateOptions& options,
                                 MutableCacheView* target);

  // --- Paging hooks for the mapper store's device tier (mapper_store/store.h). The defaults
  // let any backend be paged; a GPU backend overrides them for streamed, budgeted page-ins. ---

  // Bytes Prepare(mapper) will hold, known before it runs so the pager can make room first.
  // The pager accounts PreparedMapper::bytes() once preparation has started; this only sizes
  // the reservation. Default: every weight as fp32 (what the CPU backend's sgemm path holds at
  // most; CpuBackend overrides it with its exact figure for either path).
  virtual uint64_t PreparedBytesEstimate(const MapperView& mapper) const;

  // Memory of this backend's device that prepared mappers may use; 0 = unknown (the pager
  // then relies on the configured budget alone). Default 0.
  virtual uint64_t DeviceMemoryBytes() const { return 0; }

  // Device memory the backend's calls may hold at most besides prepared mappers (per-call
  // workspaces, library handles); the automatic device budget leaves it free. Default 0.
  virtual uint64_t ReservedDeviceBytes() const { return 0; }

  // Streamed page-in: BeginPrepare allocates the backend's copy and returns it with no layer
  // ready yet; the pager then calls PrepareLayer(prepared, l) for l = 0 .. target layers - 1,
  // in order, from one thread, and lets TranslateLayer(l) run (on other threads) as soon as
  // PrepareLayer(l) has returned, so the first target layers compute while later ones copy.
  // bytes() must be final when BeginPrepare returns. Defaults: BeginPrepare = Prepare (all
  // layers ready at once) and PrepareLayer does nothing.
  virtual absl::StatusOr<std::shared_ptr<PreparedMapper>> BeginPrepare(const MapperView& mapper) {
    return Prepare(mapper);
  }
  virtual absl::Status PrepareLayer(PreparedMapper& prepared, int target_layer) {
    (void)prepared;
    (void)target_layer;
    return absl::OkStatus();
  }
};

// Checks a mapper before a backend prepares it: both models' shapes and RoPE, one entry per
// target layer, sigma lists within the source model, weight and bias shapes (ridge W / b, or
// both MLP chains by MlpView's stacking rules). Errors name the field (e.g. "layers[3].w_k is
// 4096x1024 but expected ...", "layers[0].mlp_v.a2 is ..."). Shared by every backend.
absl::Status CheckMapperView(const MapperView& mapper);

// Elements of one MLP chain's six tensors (0 for an empty view, i.e. a ridge mapper's).
uint64_t MlpParams(const MlpView& mlp);

// Checks that `source` / `target` match the mapper's models (layers, heads, head_dim, token
// counts, non-null pointers). Shared by every backend.
absl::Status CheckCacheShapes(const MapperView& mapper, const CacheView& source,
                              const MutableCacheView& target);

// The same checks for one TranslateLayer call: `target_layer` in range, its sigma lists within
// the source model, and non-null pointers only for the layers that call reads and writes.
absl::Status CheckLayerCacheShapes(const MapperView& mapper, int target_layer,
                                   const CacheView& source, const MutableCacheView& target);

}  // namespace kvt
