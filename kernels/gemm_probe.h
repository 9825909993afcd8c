// Times the CPU backend's candidate GEMM engines (oneDNN bf16 on packed weights, OpenBLAS
// sgemm on fp32 weights) on given shapes, so `cpu_gemm: auto` picks by measurement on this
// machine instead of by CPU flags.
#pragma once

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
  // Wall time for the timed calls of both engines together (packing and primitive creation
  // excluded); each engine gets at least two calls per shape whatever the budget.
  absl::Duration budget = absl::Milliseconds(200);
  // At most this many shapes are timed: the largest by k * n (the ones that cost most).
  int max_shapes = 4;
};

struct GemmEngineTiming {
  bool available = false;  // oneDNN has no bf16 matmul below AVX-512
  double seconds = 0;      // best single-threaded time per shape, summed over the shapes
  double gflops = 0;       // FLOPs of the shapes / seconds
  int calls = 0;
};

struct GemmProbeResult {
  std::vector<GemmShape> shapes;  // the shapes timed
  int64_t rows = 0;
  GemmEngineTiming onednn_bf16;
  GemmEngineTiming sgemm;
  // oneDNN bf16 took less time than sgemm over the shapes.
  bool onednn_faster() const {
    return onednn_bf16.available && onednn_bf16.seconds < sgemm.seconds;
  }
  // "onednn_bf16 226.1 GFLOP/s vs sgemm 101.3 GFLOP/s on 1 shape x 512 rows (2048x1024)".
  std::string Summary() const;
};

// Single-threaded on the calling thread (each pool thread runs its own GEMMs), the engines'
// calls interleaved so that load from elsewhere hits both alike; best call per shape.
GemmProbeResult ProbeGemmEngines(const GemmProbeOptions& options);

// ProbeGemmEngines once per process for each (shapes, rows): backends built later in the same
// process (tests, further engines) reuse the first measurement instead of paying its budget.
GemmProbeResult ProbeGemmEnginesOnce(const GemmProbeOptions& options);

}  // namespace kvt
