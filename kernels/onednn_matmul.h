// oneDNN's bf16 matmul primitive for the CPU backend: weights packed once into the
// blocked layout oneDNN reads fastest, fp32 accumulation, primitives cached by shape.
//
// Threading: Debian's oneDNN 2.6.3 is built on the OpenMP runtime (libgomp), which has no
// threadpool interop. The CPU backend keeps its own pool and runs one single-threaded matmul per
// token piece on each pool thread (as it does with single-threaded sgemm): every call here
// must run under ScopedOmpThreads(1) or on a thread already at one OpenMP thread, so the
// primitive is created for and executed on one thread, with no OpenMP team spinning behind it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/types.h"

namespace kvt {

// The ISA oneDNN dispatches to on this machine ("avx512_core_amx", "avx512_core_bf16",
// "avx512_core", "avx2", ...), honouring DNNL_MAX_CPU_ISA.
std::string OnednnIsaName();
// "2.6.3".
std::string OnednnVersion();
// Whether oneDNN dispatches bf16 matmuls to bf16 hardware: AMX or AVX-512 BF16. Without it
// oneDNN still computes bf16 correctly (converting to fp32 in software), but slower than sgemm.
bool OnednnHasBf16Hardware();
// Whether oneDNN has a bf16 matmul here at all (it needs at least AVX-512; on AVX2-only CPUs
// the primitive is unimplemented).
bool OnednnBf16MatmulAvailable();

// Sets this thread's OpenMP thread count for the scope and restores it after.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int threads);
  ~ScopedOmpThreads();
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int saved_;
};

// A k x n weight matrix in oneDNN's blocked matmul layout, in bf16 (e.g. BA16a64b2a on AVX-512
// BF16: n padded to the 64-column block, k to 32 rows) or fp32. Immutable once packed.
class PackedWeights {
 public:
  ~PackedWeights();
  DType dtype() const { return dtype_; }  // kBF16 or kFP32
  int64_t k() const { return k_; }
  int64_t n() const { return n_; }
  uint64_t bytes() const { return bytes_; }
  const void* data() const { return data_; }

 private:
  friend absl::StatusOr<std::unique_ptr<PackedWeights>> PackWeights(
      DType packed, DType dtype, const void* src, int64_t k, int64_t n);
  DType dtype_ = DType::kBF16;
  int64_t k_ = 0, n_ = 0;
  uint64_t bytes_ = 0;
  void* data_ = nullptr;  // 64-byte aligned
};

// Packs a row-major k x n matrix of `dtype` as `packed` (kBF16: bf16 copied, fp16 / fp32
// rounded to bf16; kFP32: converted exactly). INVALID_ARGUMENT for another `packed`.
absl::StatusOr<std::unique_ptr<PackedWeights>> PackWeights(DType packed, DType dtype,
                                                           const void* src, int64_t k, int64_t n);
inline absl::StatusOr<std::unique_ptr<PackedWeights>> PackBf16Weights(DType dtype, const void* src,
                                                                      int64_t k, int64_t n) {
  return PackWeights(DType::kBF16, dtype, src, k, n);
}

// Bytes PackWeights(packed, .., k, n) will hold (padding included), without packing.
absl::StatusOr<uint64_t> PackedWeightBytes(DType packed, int64_t k, int64_t n);

// y = act(x w + bias) for an m x k bf16 x (row stride lda elements) and w packed as bf16,
// accumulated in fp32; bias: n floats or null; relu: act = max(0, .) else identity; y: m x n,
// fp32 or bf16 (`bf16_out`), row stride ldy elements. Single-threaded (see the file comment).
// Primitives are created on first use of each shape and kept, process-wide.
absl::Status Bf16Matmul(int64_t m, const uint16_t* x, int64_t lda, const PackedWeights& w,
                        const float* bias, bool relu, bool bf16_out, void* y, int64_t ldy);

// The same in fp32: x m x k fp32, w packed as fp32, y fp32. oneDNN's fp32 brgemm reaches the
// core's FMA peak on any AVX-512 CPU whatever its model number, where an OpenBLAS that does not
// know the CPU falls back to old kernels (docs/BENCHMARKS.md, "Which CPU libraries").
absl::Status F32Matmul(int64_t m, const float* x, int64_t lda, const PackedWeights& w,
                       const float* bias, bool relu, float* y, int64_t ldy);

// The oneDNN implementation Bf16Matmul runs for a dense m x k times k x n (e.g.
// "brg:avx512_core_amx", "brg:avx512_core_bf16"; "gemm:jit" or "ref:any" are slow fallbacks).
absl::StatusOr<std::string> Bf16MatmulImplementation(int64_t m, int64_t k, int64_t n, bool bias,
                                                     bool relu, bool bf16_out);
// The same for F32Matmul (e.g. "brg:avx512_core", "gemm:jit").
absl::StatusOr<std::string> F32MatmulImplementation(int64_t m, int64_t k, int64_t n);

// Primitives created so far (tests and benchmarks: the cache stays bounded).
int64_t OnednnCachedPrimitives();
// The oneDNN implementations those primitives chose, e.g. {"brg:avx512_core_bf16"}: anything
// but brg:* is a slow fallback worth a look (e.g. a strided dst in oneDNN 2.6).
std::vector<std::string> OnednnImplementations();

}  // namespace kvt
