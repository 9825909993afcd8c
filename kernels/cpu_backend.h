// The CPU translation engine: per token chunk, gather the source layers of sigma with source RoPE
// stripped, one OpenBLAS sgemm per kind (ridge) or the MLP's sgemm chain with fused bias + ReLU,
// then bias + target RoPE + dtype/layout conversion.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/thread_pool.h"

namespace kvt {

// Parallelism: the backend's own pool splits the tokens into pieces and each pool thread runs
// gather -> single-threaded sgemm -> epilogue on its pieces. Constructing a CpuBackend therefore
// calls openblas_set_num_threads(1), which is process-wide: other BLAS users in the same process
// that want OpenBLAS threads must set them for themselves. If they do, TranslateLayer notices
// (openblas_get_num_threads() > 1) and runs its pieces serially, letting BLAS thread the GEMMs.
struct CpuBackendOptions {
  // Threads of the pool (the calling thread included). 0: every core.
  int num_threads = 0;
  // Tokens per step when TranslateOptions::token_chunk is 0. Working memory per thread is about
  // token_chunk * (k n_s d_s + n_t d_t) floats, plus token_chunk * 2 H for an MLP mapper's
  // hidden activations (H = mlp.hidden).
  int64_t token_chunk = 512;
};

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options);

  std::string name() const override { return "cpu"; }
  std::string device() const override { return "cpu"; }

  // Converts every weight to fp32 once (fp32 weights are used in place, not copied) and checks
  // their shapes against the sigma lists and both models.
  absl::StatusOr<std::shared_ptr<PreparedMapper>> Prepare(const MapperView& mapper) override;

  absl::Status TranslateLayer(const PreparedMapper& mapper, int target_layer,
                              const CacheView& source, const Positions& positions,
                              const TranslateOptions& options, MutableCacheView* target) override;

 private:
  CpuBackendOptions options_;
  std::unique_ptr<ThreadPool> pool_;
};

std::unique_ptr<Backend> NewCpuBackend(const CpuBackendOptions& options = CpuBackendOptions());

}  // namespace kvt
