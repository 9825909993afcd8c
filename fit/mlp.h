// Training of the MLP mapper chain relu(relu(x A1 + c1) A2 + c2) A3 + c3 (SPEC 3, kind: mlp) for
// `kvt fit --kind mlp`: Adam on the mean squared error, forward and backward through OpenBLAS
// sgemm, seeded and deterministic.
//
// Hand-written rather than PyTorch on purpose: the dumps reader, the RoPE strip, the top-k
// selection from the ridge probe and the held-out split then have one home (fit/), shared with
// ridge, and the fit path needs no Python. The network is three GEMMs each way; sgemm does the work.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvt {
namespace fit {

struct MlpOptions {
  int64_t hidden = 1024;
  int epochs = 20;
  int64_t batch = 4096;
  double learning_rate = 1e-3;
  uint64_t seed = 1;
  // Training rows kept (a seeded subsample when there are more); <= 0: all.
  int64_t max_observations = 200000;
  // Trains on standardised inputs (per column) and outputs (per-column mean, one common scale,
  // so the loss still weighs output columns as the raw MSE does); the affine maps are folded
  // into fc1 and fc3 afterwards, so the written weights are the plain format.
  bool standardize = true;
  // With validation rows (TrainMlp's `validation`): return the weights of the epoch with the
  // lowest validation loss, not the last epoch's. Off by default: on the bundled family it
  // changed nothing downstream, because the fit's held-out sequences share documents with the
  // training ones and keep improving when other documents get worse (docs/FIT.md).
  bool keep_best_epoch = false;
};

// Checks every field, naming the offending one (as its `kvt fit` flag).
absl::Status ValidateMlpOptions(const MlpOptions& options);

// One chain, float32 row-major in the `x A + c` orientation of the mapper format.
struct MlpWeights {
  int64_t in = 0, hidden = 0, out = 0;
  std::vector<float> a1, c1, a2, c2, a3, c3;  // [in,H] [H] [H,H] [H] [H,out] [out]
  void Resize(int64_t in, int64_t hidden, int64_t out);  // zero-filled
};

// y[rows, out] = chain(x[rows, in]) through sgemm.
void MlpForward(const MlpWeights& w, const float* x, int64_t rows, float* y);

// The activations of one forward pass, which MlpBackward reads.
struct MlpWorkspace {
  std::vector<float> h1, h2, dh1, dh2;
  void Resize(int64_t rows, int64_t hidden);
};

// y[rows, out] = chain(x[rows, in]), keeping the activations in `ws` (resized).
void MlpForwardKeep(const MlpWeights& w, const float* x, int64_t rows, MlpWorkspace* ws,
                    float* y);

// Backpropagation of an arbitrary output gradient dy = d loss / d y [rows, out] of the forward
// pass that filled `ws` (same w, x, rows): d loss / d parameters into `grad` (sized like w),
// added to it when `accumulate`, else overwriting it. Three sgemm each way. The MSE trainer and
// the attention refinement (fit/refine.h) both use it.
void MlpBackward(const MlpWeights& w, const float* x, int64_t rows, const float* dy,
                 MlpWorkspace* ws, MlpWeights* grad, bool accumulate = false);

// The six parameter tensors in the format's order (a1, c1, a2, c2, a3, c3): weight, bias pairs.
std::vector<std::vector<float>*> MlpParams(MlpWeights* w);

// Loss = mean over rows and output columns of (chain(x) - y)^2, and its gradient with respect to
// every parameter (into `grad`, resized). Exposed for the gradient check.
double MlpLossAndGradient(const MlpWeights& w, const float* x, const float* y, int64_t rows,
                          MlpWeights* grad);

// Initial weights: He-uniform fc1/fc2 (ReLU), Glorot-uniform fc3, zero biases, from `seed` by a
// generator whose stream is fixed by this code (not by the C++ library).
MlpWeights InitMlp(int64_t in, int64_t hidden, int64_t out, uint64_t seed);

struct MlpTrainLog {
  std::vector<double> epoch_loss;  // mean training loss per epoch (standardised scale)
  // With validation rows: their loss after each epoch (same scale) and the epoch returned
  // (1-based; the last one unless keep_best_epoch chose an earlier one).
  std::vector<double> validation_loss;
  int returned_epoch = 0;
  int64_t rows_used = 0;
};

// Rows the trainer never learns from (the fit's held-out sequences), scored after each epoch.
struct MlpValidation {
  const std::vector<float>* x = nullptr;  // [rows, in]
  const std::vector<float>* y = nullptr;  // [rows, out]
  int64_t rows = 0;
};

// Trains one chain on x[rows, in] -> y[rows, out] (float32 row-major). The same inputs, options
// and OpenBLAS thread count give bit-identical weights. `validation` (optional, rows > 0) is
// scored after every epoch with the training rows' standardisation and, with keep_best_epoch,
// picks the epoch returned; it never changes the training steps themselves.
absl::StatusOr<MlpWeights> TrainMlp(const std::vector<float>& x, const std::vector<float>& y,
                                    int64_t rows, int64_t in, int64_t out,
                                    const MlpOptions& options, MlpTrainLog* log = nullptr,
                                    const MlpValidation* validation = nullptr);

}  // namespace fit
}  // namespace kvt
