#include "fit/mlp.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvt {
namespace fit {
namespace {

// splitmix64: a generator fully defined here, so a seed means the same weights and batches with
// every standard library (std::*_distribution is implementation-defined).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }  // [0, 1)
  uint64_t Below(uint64_t n) { return Next() % n; }  // bias < n / 2^64: irrelevant here

 private:
  uint64_t state_;
};

void FillUniform(Rng* rng, double bound, std::vector<float>* values) {
  for (float& v : *values) v = static_cast<float>((2.0 * rng->Uniform() - 1.0) * bound);
}

// out[rows, n] = in[rows, k] a[k, n] + c (broadcast), then ReLU if asked.
void Affine(const float* in, int64_t rows, int64_t k, const std::vector<float>& a,
            const std::vector<float>& c, int64_t n, bool relu, float* out) {
  for (int64_t r = 0; r < rows; ++r) std::copy(c.begin(), c.end(), out + r * n);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, n, k, 1.0f, in, k, a.data(), n,
              1.0f, out, n);
  if (relu) {
    for (int64_t i = 0; i < rows * n; ++i) out[i] = std::max(out[i], 0.0f);
  }
}

void Forward(const MlpWeights& w, const float* x, int64_t rows, MlpWorkspace* ws, float* y) {
  Affine(x, rows, w.in, w.a1, w.c1, w.hidden, true, ws->h1.data());
  Affine(ws->h1.data(), rows, w.hidden, w.a2, w.c2, w.hidden, true, ws->h2.data());
  Affine(ws->h2.data(), rows, w.hidden, w.a3, w.c3, w.out, false, y);
}

// sums (+)= column sums of m [rows, cols].
void ColumnSums(const float* m, int64_t rows, int64_t cols, bool accumulate,
                std::vector<float>* sums) {
  if (!accumulate) std::fill(sums->begin(), sums->end(), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) (*sums)[c] += m[r * cols + c];
  }
}

// Forward, loss and backward of one batch: grad holds d loss / d parameter.
double LossAndGradient(const MlpWeights& w, const float* x, const float* y, int64_t rows,
                       MlpWorkspace* ws, std::vector<float>* yhat, std::vector<float>* dy,
                       MlpWeights* grad) {
  const int64_t out = w.out;
  Forward(w, x, rows, ws, yhat->data());
  const double scale = 1.0 / (static_cast<double>(rows) * out);
  double loss = 0;
  for (int64_t i = 0; i < rows * out; ++i) {
    const double e = static_cast<double>((*yhat)[i]) - y[i];
    loss += e * e;
    (*dy)[i] = static_cast<float>(2.0 * e * scale);
  }
  MlpBackward(w, x, rows, dy->data(), ws, grad);
  return loss * scale;
}

// Mean over rows and output columns of (chain(x) - y)^2, as the training loss measures it.
double ValidationLoss(const MlpWeights& w, const std::vector<float>& x,
                      const std::vector<float>& y, int64_t rows) {
  std::vector<float> yhat(rows * w.out);
  MlpForward(w, x.data(), rows, yhat.data());
  double sum = 0;
  for (size_t i = 0; i < yhat.size(); ++i) {
    const double d = static_cast<double>(yhat[i]) - y[i];
    sum += d * d;
  }
  return sum / static_cast<double>(yhat.size());
}

}  // namespace

void MlpWorkspace::Resize(int64_t rows, int64_t hidden) {
  h1.resize(rows * hidden);
  h2.resize(rows * hidden);
  dh1.resize(rows * hidden);
  dh2.resize(rows * hidden);
}

void MlpForwardKeep(const MlpWeights& w, const float* x, int64_t rows, MlpWorkspace* ws,
                    float* y) {
  ws->Resize(rows, w.hidden);
  Forward(w, x, rows, ws, y);
}

void MlpBackward(const MlpWeights& w, const float* x, int64_t rows, const float* dy,
                 MlpWorkspace* ws, MlpWeights* grad, bool accumulate) {
  const int64_t H = w.hidden, out = w.out;
  const float beta = accumulate ? 1.0f : 0.0f;
  // fc3: dA3 = H2^T dY, dc3 = colsum dY, dH2 = dY A3^T masked by ReLU.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, out, rows, 1.0f, ws->h2.data(), H, dy,
              out, beta, grad->a3.data(), out);
  ColumnSums(dy, rows, out, accumulate, &grad->c3);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, H, out, 1.0f, dy, out, w.a3.data(),
              out, 0.0f, ws->dh2.data(), H);
  for (int64_t i = 0; i < rows * H; ++i) {
    if (!(ws->h2[i] > 0.0f)) ws->dh2[i] = 0.0f;
  }
  // fc2.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, H, H, rows, 1.0f, ws->h1.data(), H,
              ws->dh2.data(), H, beta, grad->a2.data(), H);
  ColumnSums(ws->dh2.data(), rows, H, accumulate, &grad->c2);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, H, H, 1.0f, ws->dh2.data(), H,
              w.a2.data(), H, 0.0f, ws->dh1.data(), H);
  for (int64_t i = 0; i < rows * H; ++i) {
    if (!(ws->h1[i] > 0.0f)) ws->dh1[i] = 0.0f;
  }
  // fc1.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w.in, H, rows, 1.0f, x, w.in,
              ws->dh1.data(), H, beta, grad->a1.data(), H);
  ColumnSums(ws->dh1.data(), rows, H, accumulate, &grad->c1);
}

std::vector<std::vector<float>*> MlpParams(MlpWeights* w) {
  return {&w->a1, &w->c1, &w->a2, &w->c2, &w->a3, &w->c3};
}

absl::Status ValidateMlpOptions(const MlpOptions& o) {
  if (o.hidden < 1) return absl::InvalidArgumentError("--mlp_hidden must be >= 1");
  if (o.epochs < 1) return absl::InvalidArgumentError("--mlp_epochs must be >= 1");
  if (o.batch < 1) return absl::InvalidArgumentError("--mlp_batch must be >= 1");
  if (!(o.learning_rate > 0) || !std::isfinite(o.learning_rate)) {
    return absl::InvalidArgumentError("--mlp_lr must be a positive finite number");
  }
  return absl::OkStatus();
}

void MlpWeights::Resize(int64_t in_, int64_t hidden_, int64_t out_) {
  in = in_, hidden = hidden_, out = out_;
  a1.assign(in * hidden, 0.0f);
  c1.assign(hidden, 0.0f);
  a2.assign(hidden * hidden, 0.0f);
  c2.assign(hidden, 0.0f);
  a3.assign(hidden * out, 0.0f);
  c3.assign(out, 0.0f);
}

void MlpForward(const MlpWeights& w, const float* x, int64_t rows, float* y) {
  // In slices, so that a whole calibration set does not need rows x hidden floats at once.
  constexpr int64_t kSlice = 4096;
  MlpWorkspace ws;
  ws.Resize(std::min(rows, kSlice), w.hidden);
  for (int64_t r = 0; r < rows; r += kSlice) {
    const int64_t n = std::min(kSlice, rows - r);
    Forward(w, x + r * w.in, n, &ws, y + r * w.out);
  }
}

double MlpLossAndGradient(const MlpWeights& w, const float* x, const float* y, int64_t rows,
                          MlpWeights* grad) {
  MlpWorkspace ws;
  ws.Resize(rows, w.hidden);
  std::vector<float> yhat(rows * w.out), dy(rows * w.out);
  grad->Resize(w.in, w.hidden, w.out);
  return LossAndGradient(w, x, y, rows, &ws, &yhat, &dy, grad);
}

MlpWeights InitMlp(int64_t in, int64_t hidden, int64_t out, uint64_t seed) {
  MlpWeights w;
  w.Resize(in, hidden, out);
  Rng rng(seed ^ 0x6D6C702D696E6974ull);  // "mlp-init"
  FillUniform(&rng, std::sqrt(6.0 / in), &w.a1);
  FillUniform(&rng, std::sqrt(6.0 / hidden), &w.a2);
  FillUniform(&rng, std::sqrt(6.0 / (hidden + out)), &w.a3);
  return w;
}

absl::StatusOr<MlpWeights> TrainMlp(const std::vector<float>& x_in, const std::vector<float>& y_in,
                                    int64_t rows, int64_t in, int64_t out,
                                    const MlpOptions& options, MlpTrainLog* log,
                                    const MlpValidation* validation) {
  absl::Status valid = ValidateMlpOptions(options);
  if (!valid.ok()) return valid;
  if (rows < 1 || in < 1 || out < 1 || static_cast<int64_t>(x_in.size()) != rows * in ||
      static_cast<int64_t>(y_in.size()) != rows * out) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLP training data: ", rows, " rows of ", in, " -> ", out, " features, but x holds ",
        x_in.size(), " and y ", y_in.size(), " values"));
  }
  if (validation != nullptr && validation->rows > 0 &&
      (validation->x == nullptr || validation->y == nullptr ||
       static_cast<int64_t>(validation->x->size()) != validation->rows * in ||
       static_cast<int64_t>(validation->y->size()) != validation->rows * out)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MLP validation data: ", validation->rows, " rows of ", in, " -> ", out,
        " features, but x holds ", validation->x ? validation->x->size() : 0, " and y ",
        validation->y ? validation->y->size() : 0, " values"));
  }
  Rng rng(options.seed);
  // Seeded subsample (kept in the original order) when there are more rows than allowed.
  std::vector<int64_t> keep(rows);
  std::iota(keep.begin(), keep.end(), 0);
  if (options.max_observations > 0 && rows > options.max_observations) {
    for (int64_t i = 0; i < options.max_observations; ++i) {
      std::swap(keep[i], keep[i + rng.Below(rows - i)]);
    }
    keep.resize(options.max_observations);
    std::sort(keep.begin(), keep.end());
  }
  const int64_t n = keep.size();

  // Standardisation (float64 moments), applied to a float32 copy of the kept rows.
  std::vector<double> mu_x(in, 0.0), sd_x(in, 1.0), mu_y(out, 0.0);
  double sd_y = 1.0;
  if (options.standardize) {
    std::vector<double> sq_x(in, 0.0), sq_y(out, 0.0);
    for (int64_t r : keep) {
      for (int64_t j = 0; j < in; ++j) mu_x[j] += x_in[r * in + j];
      for (int64_t j = 0; j < out; ++j) mu_y[j] += y_in[r * out + j];
    }
    for (double& m : mu_x) m /= n;
    for (double& m : mu_y) m /= n;
    for (int64_t r : keep) {
      for (int64_t j = 0; j < in; ++j) {
        const double d = x_in[r * in + j] - mu_x[j];
        sq_x[j] += d * d;
      }
      for (int64_t j = 0; j < out; ++j) {
        const double d = y_in[r * out + j] - mu_y[j];
        sq_y[j] += d * d;
      }
    }
    for (int64_t j = 0; j < in; ++j) {
      const double sd = std::sqrt(sq_x[j] / n);
      sd_x[j] = sd > 1e-12 ? sd : 1.0;  // a constant feature: centred to 0, scale irrelevant
    }
    double var_y = 0;
    for (double s : sq_y) var_y += s / n;
    var_y /= out;
    sd_y = var_y > 1e-24 ? std::sqrt(var_y) : 1.0;
  }
  std::vector<float> x(n * in), y(n * out);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = keep[i];
    for (int64_t j = 0; j < in; ++j) {
      x[i * in + j] = static_cast<float>((x_in[r * in + j] - mu_x[j]) / sd_x[j]);
    }
    for (int64_t j = 0; j < out; ++j) {
      y[i * out + j] = static_cast<float>((y_in[r * out + j] - mu_y[j]) / sd_y);
    }
  }

  // The validation rows in the training rows' standardised scale, so that their loss is the
  // training loss's measure.
  const bool validate = validation != nullptr && validation->rows > 0;
  const int64_t nv = validate ? validation->rows : 0;
  std::vector<float> xv(nv * in), yv(nv * out);
  for (int64_t r = 0; r < nv; ++r) {
    for (int64_t j = 0; j < in; ++j) {
      xv[r * in + j] = static_cast<float>(((*validation->x)[r * in + j] - mu_x[j]) / sd_x[j]);
    }
    for (int64_t j = 0; j < out; ++j) {
      yv[r * out + j] = static_cast<float>(((*validation->y)[r * out + j] - mu_y[j]) / sd_y);
    }
  }

  const int64_t H = options.hidden;
  MlpWeights w = InitMlp(in, H, out, options.seed);
  MlpWeights best;
  double best_loss = std::numeric_limits<double>::infinity();
  int best_epoch = options.epochs;
  MlpWeights grad, m, v;
  grad.Resize(in, H, out);
  m.Resize(in, H, out);
  v.Resize(in, H, out);
  const int64_t batch = std::min(options.batch, n);
  MlpWorkspace ws;
  ws.Resize(batch, H);
  std::vector<float> bx(batch * in), by(batch * out), yhat(batch * out), dy(batch * out);
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  constexpr double kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8;
  int64_t step = 0;
  if (log != nullptr) {
    log->epoch_loss.clear();
    log->validation_loss.clear();
    log->rows_used = n;
  }
  for (int epoch = 0; epoch < options.epochs; ++epoch) {
    for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.Below(i + 1)]);
    double epoch_loss = 0;
    for (int64_t begin = 0; begin < n; begin += batch) {
      const int64_t b = std::min(batch, n - begin);
      for (int64_t i = 0; i < b; ++i) {
        const int64_t r = order[begin + i];
        std::copy(&x[r * in], &x[r * in] + in, &bx[i * in]);
        std::copy(&y[r * out], &y[r * out] + out, &by[i * out]);
      }
      const double loss =
          LossAndGradient(w, bx.data(), by.data(), b, &ws, &yhat, &dy, &grad);
      if (!std::isfinite(loss)) {
        return absl::InternalError(absl::StrCat(
            "MLP training diverged (loss ", loss, ") in epoch ", epoch + 1,
            "; lower --mlp_lr"));
      }
      epoch_loss += loss * b;
      ++step;
      const double lr_t = options.learning_rate * std::sqrt(1.0 - std::pow(kBeta2, step)) /
                          (1.0 - std::pow(kBeta1, step));
      std::vector<std::vector<float>*> p = MlpParams(&w), g = MlpParams(&grad),
                                       pm = MlpParams(&m), pv = MlpParams(&v);
      for (size_t t = 0; t < p.size(); ++t) {
        float* pp = p[t]->data();
        const float* gg = g[t]->data();
        float* mm = pm[t]->data();
        float* vv = pv[t]->data();
        const int64_t count = p[t]->size();
        for (int64_t i = 0; i < count; ++i) {
          mm[i] = static_cast<float>(kBeta1 * mm[i] + (1 - kBeta1) * gg[i]);
          vv[i] = static_cast<float>(kBeta2 * vv[i] + (1 - kBeta2) * gg[i] * gg[i]);
          pp[i] -= static_cast<float>(lr_t * mm[i] / (std::sqrt(vv[i]) + kEps));
        }
      }
    }
    if (log != nullptr) log->epoch_loss.push_back(epoch_loss / n);
    if (validate) {
      const double loss = ValidationLoss(w, xv, yv, nv);
      if (log != nullptr) log->validation_loss.push_back(loss);
      if (options.keep_best_epoch && loss < best_loss) {
        best_loss = loss;
        best_epoch = epoch + 1;
        if (best_epoch < options.epochs) best = w;  // the last epoch needs no copy
      }
    }
  }
  if (best_epoch < options.epochs) w = std::move(best);
  if (log != nullptr) log->returned_epoch = best_epoch;

  // Fold the standardisation into fc1 and fc3: the result maps raw x to raw y.
  if (options.standardize) {
    for (int64_t h = 0; h < H; ++h) {
      double shift = 0;
      for (int64_t j = 0; j < in; ++j) shift += mu_x[j] / sd_x[j] * w.a1[j * H + h];
      w.c1[h] = static_cast<float>(w.c1[h] - shift);
    }
    for (int64_t j = 0; j < in; ++j) {
      for (int64_t h = 0; h < H; ++h) {
        w.a1[j * H + h] = static_cast<float>(w.a1[j * H + h] / sd_x[j]);
      }
    }
    for (float& a : w.a3) a = static_cast<float>(a * sd_y);
    for (int64_t j = 0; j < out; ++j) {
      w.c3[j] = static_cast<float>(w.c3[j] * sd_y + mu_y[j]);
    }
  }
  return w;
}

}  // namespace fit
}  // namespace kvt
