// Synthetic model pairs with a known ground truth for testing and benchmarking `kvt fit`: target
// K/V (content space) = a known linear map of chosen source layers + noise, each side with its
// own RoPE, written as real KV dump files and config.json texts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "fit/calibration.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"

namespace kvt {
namespace fit {
namespace testing {

struct FamilyOptions {
  ModelSpec source, target;
  // Target layer l is fed by true_sigma[l] (ordered by decreasing weight scale, so a correct
  // probe ranks them in this order). Every other source layer is independent of the target.
  std::vector<std::vector<int>> true_sigma;
  // Share of each target column's variance that is noise: the best possible R^2 is 1 - it.
  double noise_share = 0.05;
  uint64_t seed = 1;
  // > 0: target dumps also carry post-RoPE queries `queries.{l}` [query_group n_t, T, d_t]
  // (tools/dump_kv.py --queries; GQA with this group size), content-space entries N(0, 1) drawn
  // from a generator of their own (the K/V bytes are the same with or without them).
  int query_group = 0;
  // > 1: the target also reads true_sigma[l] at the window - 1 tokens before (zero before
  // token 0), as a window mapper does (MapperView::window); weights' rows offset-major.
  int window = 1;
  // Head-local ground truth: target head h reads only its matching source heads
  // (HeadSourceRows, fit/solve.h) of each block; every other weight is 0.
  bool head_local = false;
};

struct Family {
  FamilyOptions options;
  // Per target layer, row-major in the mapper layout (rows: true_sigma's layers in order, at
  // each token offset in turn when options.window > 1).
  std::vector<std::vector<double>> w_k, b_k, w_v, b_v;
  // Per source layer: feature means (features are mean + N(0, 1), K in content space).
  std::vector<std::vector<double>> mean_k, mean_v;
};

Family MakeFamily(const FamilyOptions& options);

// Writes sequences first .. first + count - 1 of `tokens` tokens each as
// `<dir>/source/seqNNNN.safetensors` and `<dir>/target/...` (post-RoPE keys, the default), plus
// noise-free targets under `<dir>/target_clean/` when `clean` is set. Every sequence is drawn
// from its own seed, so any subset is reproducible.
absl::Status WriteSequences(const Family& family, const std::string& dir, int first, int count,
                            int64_t tokens, DType dtype, bool clean = false);

// A Hugging Face config.json text describing `model` (neox RoPE), as `kvt fit` reads it.
std::string HfConfigJson(const ModelSpec& model);

// "seqNNNN.safetensors".
std::string SequenceFileName(int index);

}  // namespace testing
}  // namespace fit
}  // namespace kvt
