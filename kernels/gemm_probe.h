// Times the CPU backend's candidate GEMM engines (oneDNN bf16 and oneDNN fp32 on packed weights,
// OpenBLAS sgemm on fp32 weights) on given shapes, so `cpu_gemm: auto` picks by measurement on
// this machine instead of by CPU flags.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "kernels/mapper_view.h"

namespace kvt {

// What the backend serves when no mapper shape is known: k = 2 source layers of 8 KV heads x
// 128 into 8 x 128 (Qwen3-class models).
inline constexpr GemmShape kDefaultProbeShape = {2 * 8 * 128, 8 * 128};

struct GemmProbeOptions {
  std::vector<GemmShape> shapes;  // empty: {kDefaultProbeShape}
  int64_t rows = 512;             // the backend's token piece
  // Wall time for the timed calls of all engines together (packing and primitive creation
  // excluded); each engine gets at least two calls per shape whatever the budget.
  absl::Duration budget = absl::Milliseconds(200);
  // At most this many shapes are timed: the largest by k * n (the ones that cost most).
  int max_shapes = 4;
};

// How much faster than sgemm another engine must measure to replace it. The probe's figures move
// by about 10% on a shared machine, and a oneDNN engine holds a cached primitive (JIT code and
// descriptors) per GEMM shape and padded row count where sgemm holds nothing: an engine that is
// not clearly faster is not worth that memory or a choice that flips between restarts.
inline constexpr double kGemmSwitchMargin = 1.2;

// The GEMM engines of the CPU backend. The two fp32 ones are exact (SPEC 3's fp32 tolerance);
// oneDNN bf16 rounds x and the weights to bf16.
enum class GemmEngine : int { kOnednnBf16 = 0, kOnednnF32 = 1, kSgemm = 2 };
inline constexpr int kNumGemmEngines = 3;
const char* GemmEngineName(GemmEngine engine);  // "onednn_bf16", "onednn_f32", "sgemm"
bool IsFp32Engine(GemmEngine engine);

struct GemmEngineTiming {
  bool available = false;  // oneDNN has no bf16 matmul below AVX-512
  double seconds = 0;      // best single-threaded time per shape, summed over the shapes
  double gflops = 0;       // FLOPs of the shapes / seconds
  int calls = 0;
};

struct GemmProbeResult {
  std::vector<GemmShape> shapes;  // the shapes timed
  int64_t rows = 0;
  std::array<GemmEngineTiming, kNumGemmEngines> engines;  // indexed by GemmEngine

  const GemmEngineTiming& timing(GemmEngine engine) const {
    return engines[static_cast<int>(engine)];
  }
  // The available engine that took least time over the shapes (only the exact, fp32 ones when
  // `fp32_only`), where it beats sgemm by kGemmSwitchMargin; else sgemm, always available.
  GemmEngine Fastest(bool fp32_only) const;
  // "onednn_bf16 226.1, onednn_f32 111.2, sgemm 101.3 GFLOP/s on 1 shape x 512 rows (2048x1024);
  // sgemm on OpenBLAS core Cooperlake".
  std::string Summary() const;
};

// Single-threaded on the calling thread (each pool thread runs its own GEMMs), the engines'
// calls interleaved so that load from elsewhere hits both alike; best call per shape.
GemmProbeResult ProbeGemmEngines(const GemmProbeOptions& options);

// ProbeGemmEngines once per process for each (shapes, rows): backends built later in the same
// process (tests, further engines) reuse the first measurement instead of paying its budget.
GemmProbeResult ProbeGemmEnginesOnce(const GemmProbeOptions& options);

}  // namespace kvt
