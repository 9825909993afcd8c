// The CPU executor of the translation plan (kernels/translation_plan.h): per token piece, gather
// the source layers of sigma with source RoPE stripped, one GEMM per kind (ridge) or the MLP's
// GEMM chain with fused bias + ReLU, then bias + target RoPE + dtype/layout conversion. The GEMMs are OpenBLAS sgemm on fp32 weights, or
// for bf16 / fp16 mappers on CPUs with bf16 matrix hardware oneDNN's bf16 matmul:
// weights packed once in bf16, the gathered keys and values rounded to bf16, fp32 accumulation.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/gemm_probe.h"
#include "kernels/thread_pool.h"

namespace kvt {

// Parallelism: the backend's own pool splits the tokens into pieces and each pool thread runs
// gather -> single-threaded sgemm -> epilogue on its pieces. Constructing a CpuBackend therefore
// calls openblas_set_num_threads(1), which is process-wide: other BLAS users in the same process
// that want OpenBLAS threads must set them for themselves. If they do, TranslateLayer notices
// (openblas_get_num_threads() > 1) and runs its pieces serially, letting BLAS thread the GEMMs.
// The GEMM engines of the CPU backend (kernels/gemm_probe.h times them):
//   kOnednnBf16: oneDNN's bf16 matmul on packed bf16 weights, x rounded to bf16 (bf16 / fp16
//     mappers only: SPEC 3's bf16 tolerance; fp16 weights are rounded to bf16 when packed);
//   kOnednnF32: oneDNN's fp32 matmul on packed fp32 weights (exact);
//   kSgemm: OpenBLAS sgemm on fp32 weights (exact; fp32 mappers' weights used in place).
// Configured (backend.cpu_gemm) as:
//   kAuto: bf16 / fp16 mappers on whichever of the three measures fastest here, fp32 mappers
//     on the faster exact one (measured at construction on the served mappers' shapes,
//     single-threaded, within a bounded budget);
//   kOnednnBf16: bf16 / fp16 mappers on oneDNN bf16 (correct everywhere; without bf16 hardware
//     oneDNN converts in software), fp32 mappers on sgemm;
//   kOnednnF32, kSgemm: every mapper on that exact engine.
enum class CpuGemmPath { kAuto, kOnednnBf16, kOnednnF32, kSgemm };

// "auto", "onednn_bf16", "onednn_f32", "sgemm".
const char* CpuGemmPathName(CpuGemmPath path);
// "auto"; "bf16" / "onednn_bf16"; "fp32" / "sgemm"; "onednn_f32" (the config spellings and
// the enum names).
absl::StatusOr<CpuGemmPath> ParseCpuGemmPath(absl::string_view name);

struct CpuBackendOptions {
  // Threads of the pool (the calling thread included). 0: every core.
  int num_threads = 0;
  // Tokens per step when TranslateOptions::token_chunk is 0. Working memory per thread is about
  // token_chunk * (k n_s d_s + n_t d_t) floats (a head-local ridge: k g d_s n_t instead of
  // k n_s d_s, each head's inputs apart), plus token_chunk * 2 H for an MLP mapper's
  // hidden activations (H = mlp.hidden).
  int64_t token_chunk = 512;
  CpuGemmPath gemm_path = CpuGemmPath::kAuto;
  // kAuto's measurement: the shapes (the served mappers' weight matrices; empty: a Qwen3-class
  // default) and the time it may take. The rows are token_chunk.
  std::vector<GemmShape> probe_shapes;
  absl::Duration probe_budget = absl::Milliseconds(200);
};

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& options);

  std::string name() const override { return "cpu"; }
  std::string device() const override { return "cpu"; }
  // E.g. "cpu: bf16/fp16 mappers on oneDNN 2.6.3 bf16 matmul (ISA avx512_core_bf16; auto: ...),
  // fp32 mappers on OpenBLAS sgemm".
  std::string description() const override;

  // The engine bf16 / fp16 mappers take here, resolved at construction (never kAuto), and the
  // one fp32 mappers take (kOnednnF32 or kSgemm).
  CpuGemmPath gemm_path() const { return gemm_path_; }
  CpuGemmPath fp32_gemm_path() const { return fp32_path_; }
  // Why (e.g. "auto: measured onednn_bf16 226.1 GFLOP/s vs sgemm 101.3 GFLOP/s on ...; oneDNN
  // dispatches avx512_core_bf16").
  const std::string& gemm_reason() const { return gemm_reason_; }
  // kAuto's measurement; nullopt when a path was forced.
  const std::optional<GemmProbeResult>& gemm_probe() const { return gemm_probe_; }

  // Checks the weights' shapes against the sigma lists and both models, then on the sgemm path
  // converts every weight to fp32 once (fp32 weights are used in place, not copied), on the
  // oneDNN path packs each weight matrix into bf16 blocks and each bias into fp32.
  absl::StatusOr<std::shared_ptr<PreparedMapper>> Prepare(const MapperView& mapper) override;

  // Exactly the bytes Prepare will hold: fp32 copies, or packed bf16 matrices + fp32 biases.
  uint64_t PreparedBytesEstimate(const MapperView& mapper) const override;

  absl::Status TranslateLayer(const PreparedMapper& mapper, int target_layer,
                              const CacheView& source, const Positions& positions,
                              const TranslateOptions& options, MutableCacheView* target) override;

 private:
  // The engine `mapper` runs on here: gemm_path() for bf16 / fp16 weight matrices, else
  // fp32_gemm_path().
  CpuGemmPath PathFor(const MapperView& mapper) const;
  static CpuGemmPath PathOf(GemmEngine engine);

  CpuBackendOptions options_;
  std::unique_ptr<ThreadPool> pool_;
  CpuGemmPath gemm_path_ = CpuGemmPath::kSgemm;
  CpuGemmPath fp32_path_ = CpuGemmPath::kSgemm;
  std::string gemm_reason_;
  std::optional<GemmProbeResult> gemm_probe_;
};

// The GEMM engine a mapper prepared by a CpuBackend runs on (kAuto for a mapper some other
// backend prepared).
CpuGemmPath PreparedGemmPath(const PreparedMapper& prepared);

std::unique_ptr<Backend> NewCpuBackend(const CpuBackendOptions& options = CpuBackendOptions());

}  // namespace kvt
