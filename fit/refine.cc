#include "fit/refine.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "fit/calibration.h"
#include "fit/progress.h"
#include "mapper_store/mapper.h"

namespace kvt {
namespace fit {
namespace {

// SplitMix64 steps: a generator whose stream this code fixes (not the C++ library).
uint64_t NextRandom(uint64_t* state) {
  uint64_t x = (*state += 0x9e3779b97f4a7c15ull);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Fisher-Yates with NextRandom.
template <typename T>
void Shuffle(uint64_t* state, std::vector<T>* v) {
  for (size_t i = v->size(); i > 1; --i) std::swap((*v)[i - 1], (*v)[NextRandom(state) % i]);
}

// `count` distinct tokens of [0, tokens), ascending (all when count <= 0 or >= tokens).
std::vector<int64_t> SampleRows(int64_t tokens, int count, uint64_t* state) {
  std::vector<int64_t> rows(tokens);
  for (int64_t t = 0; t < tokens; ++t) rows[t] = t;
  if (count > 0 && count < tokens) {
    // Partial Fisher-Yates: the first `count` entries are a uniform sample.
    for (int64_t i = 0; i < count; ++i) {
      std::swap(rows[i], rows[i + NextRandom(state) % (tokens - i)]);
    }
    rows.resize(count);
    std::sort(rows.begin(), rows.end());
  }
  return rows;
}

// `count` distinct query rows of [from, tokens), ascending (all when count <= 0).
std::vector<int64_t> RowsFrom(int64_t from, int64_t tokens, int count, uint64_t* state) {
  std::vector<int64_t> rows = SampleRows(tokens - from, count, state);
  for (int64_t& r : rows) r += from;
  return rows;
}

// Causal attention of `n` query rows over keys [0, visible_end): P (row i sees keys <=
// last[i]) and O = P V. Q [n, d], K/V rows at stride `ld`.
void Attend(int64_t n, int64_t visible_end, int d, const double* q, const double* k,
            const double* v, int64_t ld, const std::vector<int64_t>& last, double* p, double* o) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, visible_end, d, scale, q, d, k, ld, 0.0,
              p, visible_end);
  for (int64_t i = 0; i < n; ++i) {
    double* row = p + i * visible_end;
    const int64_t seen = last[i] + 1;
    const double top = *std::max_element(row, row + seen);
    double sum = 0;
    for (int64_t s = 0; s < seen; ++s) sum += (row[s] = std::exp(row[s] - top));
    for (int64_t s = 0; s < seen; ++s) row[s] /= sum;
    std::fill(row + seen, row + visible_end, 0.0);
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, visible_end, 1.0, p, visible_end, v,
              ld, 0.0, o, d);
}

// y [rows, out] = x [rows, in] W + b.
void Affine(int64_t rows, int64_t in, int64_t out, const double* x, const std::vector<double>& w,
            const std::vector<double>& b, double* y) {
  for (int64_t r = 0; r < rows; ++r) std::copy(b.begin(), b.end(), y + r * out);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, out, in, 1.0, x, in, w.data(), out,
              1.0, y, out);
}

// grad W += x^T dy, grad b += column sums of dy.
void AffineBackward(int64_t rows, int64_t in, int64_t out, const double* x, const double* dy,
                    std::vector<double>* grad_w, std::vector<double>* grad_b) {
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, out, rows, 1.0, x, in, dy, out, 1.0,
              grad_w->data(), out);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < out; ++c) (*grad_b)[c] += dy[r * out + c];
  }
}

}  // namespace

void RidgeMaps::Resize(int64_t in_, int64_t out_) {
  in = in_;
  out = out_;
  w_k.assign(in * out, 0.0);
  w_v.assign(in * out, 0.0);
  b_k.assign(out, 0.0);
  b_v.assign(out, 0.0);
}

RopeRows RopeRows::Of(const Rope& rope, const std::vector<uint64_t>& positions) {
  RopeRows r;
  r.style = rope.style();
  r.half = rope.rotary_dim() / 2;
  r.cos.resize(positions.size() * r.half);
  r.sin.resize(r.cos.size());
  const double factor = rope.attention_factor();
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int m = 0; m < r.half; ++m) {
      const double angle = rope.Angle(positions[t], m);
      r.cos[t * r.half + m] = factor * std::cos(angle);
      r.sin[t * r.half + m] = factor * std::sin(angle);
    }
  }
  return r;
}

void RopeRows::Rotate(int64_t tokens, int heads, int head_dim, bool transpose, double* m) const {
  const double sign = transpose ? -1.0 : 1.0;
  for (int64_t t = 0; t < tokens; ++t) {
    const double* c = cos.data() + t * half;
    const double* s = sin.data() + t * half;
    for (int h = 0; h < heads; ++h) {
      double* x = m + (t * heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        double& a = style == RopeStyle::kNeox ? x[i] : x[2 * i];
        double& b = style == RopeStyle::kNeox ? x[i + half] : x[2 * i + 1];
        const double a0 = a, b0 = b;
        a = a0 * c[i] - sign * b0 * s[i];
        b = b0 * c[i] + sign * a0 * s[i];
      }
    }
  }
}

AttentionError AttentionOutputErrorAndGradient(const AttentionProblem& p, const double* k_in,
                                               const double* v_hat, double* dk_hat,
                                               double* dv_hat) {
  AttentionError result;
  if (p.rows.empty()) return result;
  const int d = p.head_dim, group = p.query_heads / p.kv_heads;
  const int64_t out = int64_t{p.kv_heads} * d;
  // Keys past the last query row are never seen: only the first `te` tokens matter.
  const int64_t te = VisibleTokens(p), m = p.rows.size(), n = group * m;
  const bool grad = dk_hat != nullptr && dv_hat != nullptr;
  std::vector<double> k_hat(k_in, k_in + te * out);
  p.rope->Rotate(te, p.kv_heads, d, /*transpose=*/false, k_hat.data());
  // Past a handoff boundary the target's own rows (K post-RoPE already) replace the mapped ones.
  const int64_t own = p.own_from < 0 ? te : std::min(p.own_from, te);
  std::vector<double> v_mixed;
  if (own < te) {
    std::copy(p.k_true + own * out, p.k_true + te * out, k_hat.begin() + own * out);
    v_mixed.assign(v_hat, v_hat + own * out);
    v_mixed.insert(v_mixed.end(), p.v_true + own * out, p.v_true + te * out);
    v_hat = v_mixed.data();
  }

  std::vector<int64_t> last(n);
  for (int g = 0; g < group; ++g) std::copy(p.rows.begin(), p.rows.end(), last.begin() + g * m);
  std::vector<double> q(n * d), p_true(n * te), o_true(n * d), p_hat(n * te), o_hat(n * d);
  std::vector<double> d_o(n * d), d_p(n * te);
  if (grad) {
    std::fill(dk_hat, dk_hat + te * out, 0.0);
    std::fill(dv_hat, dv_hat + te * out, 0.0);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int h = 0; h < p.kv_heads; ++h) {
    // The group's query rows stacked: query head h * group + g, row i at g * m + i.
    for (int g = 0; g < group; ++g) {
      const int qh = h * group + g;
      for (int64_t i = 0; i < m; ++i) {
        const double* src = p.queries + (p.rows[i] * p.query_heads + qh) * d;
        std::copy(src, src + d, &q[(g * m + i) * d]);
      }
    }
    const int64_t col = int64_t{h} * d;
    Attend(n, te, d, q.data(), p.k_true + col, p.v_true + col, out, last, p_true.data(),
           o_true.data());
    Attend(n, te, d, q.data(), k_hat.data() + col, v_hat + col, out, last, p_hat.data(),
           o_hat.data());
    for (int64_t i = 0; i < n * d; ++i) {
      const double e = o_hat[i] - o_true[i];
      result.error += e * e;
      result.norm += o_true[i] * o_true[i];
      d_o[i] = 2.0 * e;
    }
    if (!grad) continue;
    // dV^ = P^T dO; dP = dO V^T; dS = P (dP - rowsum(P dP)); dK^ = scale dS^T Q.
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, te, d, n, 1.0, p_hat.data(), te,
                d_o.data(), d, 1.0, dv_hat + col, out);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, te, d, 1.0, d_o.data(), d,
                v_hat + col, out, 0.0, d_p.data(), te);
    for (int64_t i = 0; i < n; ++i) {
      double* dp = d_p.data() + i * te;
      const double* pr = p_hat.data() + i * te;
      double dot = 0;
      for (int64_t s = 0; s < te; ++s) dot += pr[s] * dp[s];
      for (int64_t s = 0; s < te; ++s) dp[s] = pr[s] * (dp[s] - dot);
    }
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, te, d, n, scale, d_p.data(), te,
                q.data(), d, 1.0, dk_hat + col, out);
  }
  if (!grad) return result;
  // The target's own rows are not the mapper's output: nothing flows back through them.
  std::fill(dk_hat + own * out, dk_hat + te * out, 0.0);
  std::fill(dv_hat + own * out, dv_hat + te * out, 0.0);
  // Back to content space: d / d (content K^) = R^T d / d (rotated K^).
  p.rope->Rotate(te, p.kv_heads, d, /*transpose=*/true, dk_hat);
  return result;
}

AttentionError AttentionErrorAndGradient(const AttentionProblem& p, const RidgeMaps& maps,
                                         RidgeMaps* grad) {
  if (p.rows.empty()) return AttentionError();
  // Rows past the mapped ones are the target's own (AttentionOutputErrorAndGradient fills
  // them): the maps run on the mapped rows only.
  const int64_t out = maps.out, in = maps.in, te = VisibleTokens(p), tm = MappedTokens(p);
  std::vector<double> k_hat(te * out), v_hat(te * out);
  Affine(tm, in, out, p.x_k, maps.w_k, maps.b_k, k_hat.data());
  Affine(tm, in, out, p.x_v, maps.w_v, maps.b_v, v_hat.data());
  if (grad == nullptr) {
    return AttentionOutputErrorAndGradient(p, k_hat.data(), v_hat.data(), nullptr, nullptr);
  }
  std::vector<double> dk_hat(te * out), dv_hat(te * out);
  const AttentionError result =
      AttentionOutputErrorAndGradient(p, k_hat.data(), v_hat.data(), dk_hat.data(), dv_hat.data());
  AffineBackward(tm, in, out, p.x_k, dk_hat.data(), &grad->w_k, &grad->b_k);
  AffineBackward(tm, in, out, p.x_v, dv_hat.data(), &grad->w_v, &grad->b_v);
  return result;
}

MlpMaps MlpMaps::ZerosLike(const MlpMaps& like) {
  MlpMaps z;
  for (int c = 0; c < 2; ++c) {
    for (const MlpWeights& w : c == 0 ? like.k : like.v) {
      MlpWeights zero;
      zero.Resize(w.in, w.hidden, w.out);
      (c == 0 ? z.k : z.v).push_back(std::move(zero));
    }
  }
  return z;
}

std::vector<std::vector<float>*> MlpMaps::Tensors() {
  std::vector<std::vector<float>*> t;
  for (std::vector<MlpWeights>* chains : {&k, &v}) {
    for (MlpWeights& w : *chains) {
      for (std::vector<float>* p : MlpParams(&w)) t.push_back(p);
    }
  }
  return t;
}

AttentionError MlpAttentionErrorAndGradient(const AttentionProblem& p, const MlpMaps& maps,
                                            MlpMaps* grad) {
  if (p.rows.empty()) return AttentionError();
  const int64_t te = VisibleTokens(p), tm = MappedTokens(p);
  const int64_t out = int64_t{p.kv_heads} * p.head_dim, in = maps.k.front().in;
  // Forward: every chain on the mapped tokens, outputs placed at its columns (float64); the
  // rows after them are the target's own (AttentionOutputErrorAndGradient fills them).
  std::vector<float> x[2];
  std::vector<double> y[2];
  std::vector<MlpWorkspace> ws[2];
  for (int c = 0; c < 2; ++c) {
    const double* src = c == 0 ? p.x_k : p.x_v;
    x[c].assign(src, src + tm * in);
    y[c].assign(te * out, 0.0);
    const std::vector<MlpWeights>& chains = c == 0 ? maps.k : maps.v;
    ws[c].resize(chains.size());
    const int64_t width = out / static_cast<int64_t>(chains.size());
    std::vector<float> part(tm * width);
    for (size_t h = 0; h < chains.size(); ++h) {
      MlpForwardKeep(chains[h], x[c].data(), tm, &ws[c][h], part.data());
      for (int64_t t = 0; t < tm; ++t) {
        std::copy(&part[t * width], &part[t * width] + width, &y[c][t * out + h * width]);
      }
    }
  }
  if (grad == nullptr) {
    return AttentionOutputErrorAndGradient(p, y[0].data(), y[1].data(), nullptr, nullptr);
  }
  std::vector<double> dy[2] = {std::vector<double>(te * out), std::vector<double>(te * out)};
  const AttentionError result =
      AttentionOutputErrorAndGradient(p, y[0].data(), y[1].data(), dy[0].data(), dy[1].data());
  for (int c = 0; c < 2; ++c) {
    const std::vector<MlpWeights>& chains = c == 0 ? maps.k : maps.v;
    std::vector<MlpWeights>& grads = c == 0 ? grad->k : grad->v;
    const int64_t width = out / static_cast<int64_t>(chains.size());
    std::vector<float> part(tm * width);
    for (size_t h = 0; h < chains.size(); ++h) {
      for (int64_t t = 0; t < tm; ++t) {
        for (int64_t j = 0; j < width; ++j) {
          part[t * width + j] = static_cast<float>(dy[c][t * out + h * width + j]);
        }
      }
      MlpBackward(chains[h], x[c].data(), tm, part.data(), &ws[c][h], &grads[h],
                  /*accumulate=*/true);
    }
  }
  return result;
}

namespace {

// One calibration sequence as the refinement reads it: stride-1 features of both models
// (content space), the target's queries and RoPE rows.
struct LoadedSequence {
  FeatureRows rows;
  DumpQueries queries;
  RopeRows rope;

  int64_t Bytes() const {
    int64_t floats = 0;
    for (const std::vector<float>& q : queries.layers) floats += q.size();
    return 8 * static_cast<int64_t>(rows.source_k.size() + rows.source_v.size() +
                                    rows.target_k.size() + rows.target_v.size() +
                                    rope.cos.size() + rope.sin.size()) +
           4 * floats;
  }
};

absl::StatusOr<LoadedSequence> LoadSequence(const SequencePair& pair, const FitShape& shape,
                                            const Rope& rope) {
  // The queries first: NOT_FOUND then means the dump has none (the ridge passes read the files).
  absl::StatusOr<DumpQueries> queries = ReadDumpQueries(pair.target_path, shape.target);
  if (!queries.ok()) return queries.status();
  LoadedSequence s;
  s.rows.Reset(shape.source_blocks() * shape.ds(),
               int64_t{shape.target.num_layers} * shape.dt());
  absl::StatusOr<int64_t> tokens =
      AppendSequence(pair, shape.source, shape.target, /*stride=*/1, &s.rows, shape.window);
  if (!tokens.ok()) {
    // Not to be taken for "no queries".
    return absl::Status(absl::IsNotFound(tokens.status()) ? absl::StatusCode::kInvalidArgument
                                                          : tokens.status().code(),
                        tokens.status().message());
  }
  if (queries->num_tokens != s.rows.rows) {
    return absl::InvalidArgumentError(absl::StrCat(pair.target_path, ": ", queries->num_tokens,
                                                   " query tokens but ", s.rows.rows,
                                                   " KV tokens"));
  }
  s.queries = std::move(*queries);
  s.rope = RopeRows::Of(rope, s.queries.positions);
  return s;
}

// The calibration sequences the refinement reads, kept in memory while they fit in a byte
// budget (the tiny family's whole calibration set), so that later epochs and the second held-out
// pass skip the disk and the parsing; beyond the budget they stream (read again at each use).
class SequenceCache {
 public:
  SequenceCache(const FitShape& shape, const Rope& rope, int64_t budget_bytes)
      : shape_(shape), rope_(rope), budget_(budget_bytes) {}

  // NOT_FOUND: the target dump has no queries.
  absl::StatusOr<std::shared_ptr<const LoadedSequence>> Get(const SequencePair& pair) {
    if (auto hit = kept_.find(&pair); hit != kept_.end()) return hit->second;
    absl::StatusOr<LoadedSequence> loaded = LoadSequence(pair, shape_, rope_);
    if (!loaded.ok()) return loaded.status();
    auto shared = std::make_shared<const LoadedSequence>(std::move(*loaded));
    if (used_ + shared->Bytes() <= budget_) {
      used_ += shared->Bytes();
      kept_.emplace(&pair, shared);
    }
    return shared;
  }

 private:
  const FitShape& shape_;
  const Rope& rope_;
  const int64_t budget_;
  int64_t used_ = 0;
  std::map<const SequencePair*, std::shared_ptr<const LoadedSequence>> kept_;
};

// Per target layer: the problem's inputs gathered from a loaded sequence.
struct LayerInputs {
  std::vector<double> x_k, x_v, k_true, v_true, queries;
  AttentionProblem problem;
};

void GatherLayer(const LoadedSequence& s, const FitShape& shape, int l,
                 const std::vector<int>& sigma, std::vector<int64_t> rows, LayerInputs* in) {
  const int64_t T = s.rows.rows, ds = shape.ds(), dt = shape.dt();
  const int64_t width = static_cast<int64_t>(sigma.size()) * ds;
  in->x_k.resize(T * width);
  in->x_v.resize(T * width);
  in->k_true.resize(T * dt);
  in->v_true.resize(T * dt);
  for (int64_t t = 0; t < T; ++t) {
    for (size_t a = 0; a < sigma.size(); ++a) {
      const int64_t from = t * s.rows.source_cols + sigma[a] * ds;
      std::copy_n(&s.rows.source_k[from], ds, &in->x_k[t * width + a * ds]);
      std::copy_n(&s.rows.source_v[from], ds, &in->x_v[t * width + a * ds]);
    }
    const int64_t from = t * s.rows.target_cols + l * dt;
    std::copy_n(&s.rows.target_k[from], dt, &in->k_true[t * dt]);
    std::copy_n(&s.rows.target_v[from], dt, &in->v_true[t * dt]);
  }
  s.rope.Rotate(T, shape.target.num_kv_heads, shape.target.head_dim, false, in->k_true.data());
  const std::vector<float>& q = s.queries.layers[l];
  in->queries.assign(q.begin(), q.end());
  AttentionProblem& p = in->problem;
  p.tokens = T;
  p.kv_heads = shape.target.num_kv_heads;
  p.head_dim = shape.target.head_dim;
  p.query_heads = s.queries.num_query_heads;
  p.x_k = in->x_k.data();
  p.x_v = in->x_v.data();
  p.k_true = in->k_true.data();
  p.v_true = in->v_true.data();
  p.queries = in->queries.data();
  p.rope = &s.rope;
  p.rows = std::move(rows);
}

// Adam over one layer's tensors ((weight, bias) pairs), each with its own step size lr x
// RMS(start); float64 moments whatever the parameters' type.
template <typename T>
struct Adam {
  std::vector<std::vector<double>> m, v;
  std::vector<double> step;
  int t = 0;
  void Init(const std::vector<std::vector<T>*>& tensors, double lr) {
    auto rms_of = [](const std::vector<T>& w) {
      double rms = 0;
      for (T x : w) rms += static_cast<double>(x) * x;
      return std::sqrt(rms / std::max<size_t>(1, w.size()));
    };
    for (size_t i = 0; i < tensors.size(); ++i) {
      double rms = rms_of(*tensors[i]);
      // A zero bias moves on its weights' scale.
      if (rms == 0 && i % 2 == 1) rms = rms_of(*tensors[i - 1]);
      step.push_back(lr * rms);
      m.emplace_back(tensors[i]->size(), 0.0);
      v.emplace_back(tensors[i]->size(), 0.0);
    }
  }
  void Update(const std::vector<std::vector<T>*>& tensors,
              const std::vector<std::vector<T>*>& grads) {
    constexpr double kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-12;
    ++t;
    const double c1 = 1 - std::pow(kBeta1, t), c2 = 1 - std::pow(kBeta2, t);
    for (size_t i = 0; i < tensors.size(); ++i) {
      for (size_t j = 0; j < tensors[i]->size(); ++j) {
        const double g = (*grads[i])[j];
        m[i][j] = kBeta1 * m[i][j] + (1 - kBeta1) * g;
        v[i][j] = kBeta2 * v[i][j] + (1 - kBeta2) * g * g;
        (*tensors[i])[j] = static_cast<T>(
            (*tensors[i])[j] - step[i] * (m[i][j] / c1) / (std::sqrt(v[i][j] / c2) + kEps));
      }
    }
  }
};

// One mapper kind's side of the refinement, per target layer.
struct RefineTarget {
  // Adds the layer's batch gradient for `problem` and returns its error.
  std::function<AttentionError(int l, const AttentionProblem& problem)> accumulate;
  // Zeroes every layer's gradient (before a step's batch).
  std::function<void()> zero;
  // Divides layer l's gradient by `norm`, then takes its Adam step.
  std::function<void(int l, double norm)> update;
};

// The loop both kinds share: seeded epochs over the training sequences with queries, `batch`
// sequences a step, a seeded sample of query rows, every target layer, one Adam step a layer.
absl::StatusOr<RefineLog> RefineLoop(const FitOptions& options, const ParsedFinal& parsed,
                                     const RefineTarget& target, SequenceCache* sequences) {
  const RefineOptions& ro = options.refine;
  const auto start = std::chrono::steady_clock::now();
  const FitShape& shape = parsed.shape;
  // Training sequences; one whose target dump turns out to have no queries is dropped when it
  // is first read (reading every dump up front would cost a pass of its own).
  std::vector<const SequencePair*> train;
  for (const SequencePair& pair : options.sequences) {
    if (!pair.heldout) train.push_back(&pair);
  }
  const int L = shape.target.num_layers;
  std::unique_ptr<Progress> progress;
  if (options.solve.show_progress) {
    progress = std::make_unique<Progress>("refine", ro.steps, "steps", options.solve.log);
  }
  RefineLog log;
  // A stream of its own (the MLP trainer and the split hash the same seed differently); the
  // same for both kinds, so they see the same sequences and query rows.
  uint64_t rng = ro.seed ^ 0x5265666996e65ull;
  std::vector<const SequencePair*> order;
  size_t next = 0;
  LayerInputs inputs;
  for (int step = 0; step < ro.steps; ++step) {
    std::vector<AttentionError> err(L);
    target.zero();
    for (int b = 0; b < ro.batch; ++b) {
      absl::StatusOr<std::shared_ptr<const LoadedSequence>> s = absl::NotFoundError("");
      while (!s.ok()) {
        if (train.empty()) {
          return absl::FailedPreconditionError(
              "kvt fit --refine=attention: no training target dump has queries (dump the target "
              "with tools/dump_kv.py --queries)");
        }
        if (next == order.size()) {  // a new epoch: a fresh seeded order
          order = train;
          Shuffle(&rng, &order);
          next = 0;
        }
        const SequencePair* pair = order[next++];
        if (std::find(train.begin(), train.end(), pair) == train.end()) continue;  // dropped
        s = sequences->Get(*pair);
        if (absl::IsNotFound(s.status())) {
          train.erase(std::find(train.begin(), train.end(), pair));
          continue;
        }
        if (!s.ok()) return s.status();
      }
      const LoadedSequence& seq = **s;
      const int64_t T = seq.rows.rows;
      int64_t own_from = -1;
      if (ro.handoff && T >= 2) {
        own_from = T / 2 + static_cast<int64_t>(NextRandom(&rng) % (T - T / 2));
      }
      const std::vector<int64_t> rows =
          RowsFrom(std::max<int64_t>(own_from, 0), T, ro.queries, &rng);
      for (int l = 0; l < L; ++l) {
        GatherLayer(seq, shape, l, parsed.sigma[l], rows, &inputs);
        inputs.problem.own_from = own_from;
        const AttentionError e = target.accumulate(l, inputs.problem);
        err[l].error += e.error;
        err[l].norm += e.norm;
      }
    }
    double loss = 0;
    for (int l = 0; l < L; ++l) {
      // Relative error: each layer's loss is scale-free, so one learning rate suits every layer.
      const double norm = std::max(err[l].norm, std::numeric_limits<double>::min());
      loss += err[l].error / norm / L;
      target.update(l, norm);
    }
    if (!std::isfinite(loss)) {
      return absl::InternalError(absl::StrCat("kvt fit --refine=attention diverged (loss ", loss,
                                              ") at step ", step + 1, "; lower --refine_lr"));
    }
    log.loss.push_back(loss);
    if (progress) progress->Advance(1, 0);
  }
  if (progress) progress->Finish();
  log.sequences = static_cast<int>(train.size());
  log.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return log;
}

using ErrorOf = std::function<AttentionError(int l, const AttentionProblem& problem)>;

// The refinement's objective on the held-out sequences with target queries, deterministic: the
// handoff boundary at 3/4 of each sequence and every query after it (or every query, for the
// prefix objective); the mean over target layers of summed error / summed norm. nullopt when no
// held-out sequence has queries.
absl::StatusOr<std::optional<double>> HeldoutLoss(const FitOptions& options,
                                                  const ParsedFinal& parsed, const ErrorOf& error,
                                                  SequenceCache* sequences) {
  const FitShape& shape = parsed.shape;
  const int L = shape.target.num_layers;
  std::vector<AttentionError> err(L);
  bool any = false;
  LayerInputs inputs;
  for (const SequencePair& pair : options.sequences) {
    if (!pair.heldout) continue;
    absl::StatusOr<std::shared_ptr<const LoadedSequence>> s = sequences->Get(pair);
    if (absl::IsNotFound(s.status())) continue;
    if (!s.ok()) return s.status();
    const LoadedSequence& seq = **s;
    const int64_t T = seq.rows.rows;
    const int64_t own_from = options.refine.handoff && T >= 2 ? T * 3 / 4 : -1;
    const std::vector<int64_t> rows = RowsFrom(std::max<int64_t>(own_from, 0), T, 0, nullptr);
    for (int l = 0; l < L; ++l) {
      GatherLayer(seq, shape, l, parsed.sigma[l], rows, &inputs);
      inputs.problem.own_from = own_from;
      const AttentionError e = error(l, inputs.problem);
      err[l].error += e.error;
      err[l].norm += e.norm;
    }
    any = true;
  }
  if (!any) return std::optional<double>();
  double loss = 0;
  for (const AttentionError& e : err) {
    loss += e.error / std::max(e.norm, std::numeric_limits<double>::min()) / L;
  }
  return std::optional<double>(loss);
}

// RefineLoop between two held-out measurements of its objective.
absl::StatusOr<RefineLog> MeasuredRefineLoop(const FitOptions& options,
                                             const ParsedFinal& parsed,
                                             const RefineTarget& target, const ErrorOf& error) {
  const FitShape& shape = parsed.shape;
  absl::StatusOr<Rope> rope = Rope::Create(shape.target.rope, shape.target.head_dim);
  if (!rope.ok()) return rope.status();
  SetBlasThreads(options.num_threads);
  SequenceCache sequences(shape, *rope, options.refine.cache_bytes);
  absl::StatusOr<std::optional<double>> before = HeldoutLoss(options, parsed, error, &sequences);
  if (!before.ok()) return before.status();
  absl::StatusOr<RefineLog> log = RefineLoop(options, parsed, target, &sequences);
  if (!log.ok()) return log.status();
  absl::StatusOr<std::optional<double>> after = HeldoutLoss(options, parsed, error, &sequences);
  if (!after.ok()) return after.status();
  log->heldout_before = *before;
  log->heldout_after = *after;
  // Held-out sequences are the only evidence the steps generalise: when they say no, the
  // caller keeps its start.
  log->kept_start = options.refine.keep_start_unless_better && *before && *after &&
                    !(**after < **before);
  return log;
}

template <typename T>
void DivideAll(const std::vector<std::vector<T>*>& tensors, double norm) {
  for (std::vector<T>* t : tensors) {
    for (T& x : *t) x = static_cast<T>(x / norm);
  }
}

template <typename T>
void ZeroAll(const std::vector<std::vector<T>*>& tensors) {
  for (std::vector<T>* t : tensors) std::fill(t->begin(), t->end(), T(0));
}

}  // namespace

absl::Status ValidateRefineOptions(const RefineOptions& options) {
  if (options.steps < 1 || options.batch < 1 || options.queries < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--refine_steps and --refine_batch must be >= 1 and --refine_queries >= 0, got ",
        options.steps, ", ", options.batch, ", ", options.queries));
  }
  if (options.mlp_steps < 1 || options.mlp_batch < 1 || options.mlp_queries < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--refine_mlp_steps and --refine_mlp_batch must be >= 1 and --refine_mlp_queries >= 0, "
        "got ", options.mlp_steps, ", ", options.mlp_batch, ", ", options.mlp_queries));
  }
  if (!(options.learning_rate > 0) || !(options.mlp_learning_rate > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--refine_lr and --refine_mlp_lr must be > 0, got ", options.learning_rate, " and ",
        options.mlp_learning_rate));
  }
  return absl::OkStatus();
}

namespace {

// 1 where a head-local map may be non-zero (HeadSourceRows x the head's columns), [in, out].
std::vector<char> HeadLocalMask(const FitShape& shape, int64_t blocks) {
  const int64_t out = shape.dt(), d_t = shape.target.head_dim;
  std::vector<char> mask(blocks * shape.ds() * out, 0);
  for (int h = 0; h < shape.target.num_kv_heads; ++h) {
    for (int64_t row : HeadSourceRows(shape, blocks, h)) {
      std::fill(mask.begin() + row * out + h * d_t, mask.begin() + row * out + (h + 1) * d_t, 1);
    }
  }
  return mask;
}

}  // namespace

absl::StatusOr<RefineLog> RefineRidge(const FitOptions& options, const ParsedFinal& parsed,
                                      std::vector<LayerFit>* fits, bool per_head) {
  if (absl::Status valid = ValidateRefineOptions(options.refine); !valid.ok()) return valid;
  const FitShape& shape = parsed.shape;
  const int L = shape.target.num_layers;
  const int64_t out = shape.dt();
  std::vector<RidgeMaps> maps(L), grads(L);
  std::vector<Adam<double>> adam(L);
  // Head-local maps: their zeros stay zeros (a zero gradient leaves Adam's step at 0).
  std::vector<std::vector<char>> masks(per_head ? L : 0);
  for (int l = 0; l < L; ++l) {
    const LayerFit& f = (*fits)[l];
    if (per_head) masks[l] = HeadLocalMask(shape, parsed.sigma[l].size());
    maps[l].in = static_cast<int64_t>(parsed.sigma[l].size()) * shape.ds();
    maps[l].out = out;
    maps[l].w_k = f.w_k;
    maps[l].b_k = f.b_k;
    maps[l].w_v = f.w_v;
    maps[l].b_v = f.b_v;
    grads[l].Resize(maps[l].in, out);
    adam[l].Init(maps[l].Tensors(), options.refine.learning_rate);
  }
  RefineTarget target;
  target.accumulate = [&](int l, const AttentionProblem& p) {
    return AttentionErrorAndGradient(p, maps[l], &grads[l]);
  };
  target.zero = [&] {
    for (RidgeMaps& g : grads) ZeroAll(g.Tensors());
  };
  target.update = [&](int l, double norm) {
    DivideAll(grads[l].Tensors(), norm);
    if (per_head) {
      for (std::vector<double>* w : {&grads[l].w_k, &grads[l].w_v}) {
        for (size_t i = 0; i < w->size(); ++i) (*w)[i] *= masks[l][i];
      }
    }
    adam[l].Update(maps[l].Tensors(), grads[l].Tensors());
  };
  absl::StatusOr<RefineLog> log =
      MeasuredRefineLoop(options, parsed, target, [&](int l, const AttentionProblem& p) {
        return AttentionErrorAndGradient(p, maps[l], nullptr);
      });
  if (!log.ok()) return log.status();
  if (log->kept_start) return log;  // `fits` still hold the closed form
  for (int l = 0; l < L; ++l) {
    LayerFit& f = (*fits)[l];
    f.w_k = std::move(maps[l].w_k);
    f.b_k = std::move(maps[l].b_k);
    f.w_v = std::move(maps[l].w_v);
    f.b_v = std::move(maps[l].b_v);
  }
  return log;
}

absl::StatusOr<RefineLog> RefineMlp(const FitOptions& options, const ParsedFinal& parsed,
                                    std::vector<MlpMaps>* layers) {
  // Before ForMlp() below, so that an error names the MLP's own flag.
  if (absl::Status valid = ValidateRefineOptions(options.refine); !valid.ok()) return valid;
  const int L = parsed.shape.target.num_layers;
  if (static_cast<int>(layers->size()) != L) {
    return absl::InvalidArgumentError(
        absl::StrCat("RefineMlp: ", layers->size(), " layers of chains for ", L, " target layers"));
  }
  // The loop and Adam read steps, batch, queries and step size from options.refine: the MLP's
  // budget there.
  FitOptions mlp_options = options;
  mlp_options.refine = options.refine.ForMlp();
  std::vector<MlpMaps> grads(L);
  std::vector<Adam<float>> adam(L);
  for (int l = 0; l < L; ++l) {
    grads[l] = MlpMaps::ZerosLike((*layers)[l]);
    adam[l].Init((*layers)[l].Tensors(), mlp_options.refine.learning_rate);
  }
  const std::vector<MlpMaps> start = *layers;
  RefineTarget target;
  target.accumulate = [&](int l, const AttentionProblem& p) {
    return MlpAttentionErrorAndGradient(p, (*layers)[l], &grads[l]);
  };
  target.zero = [&] {
    for (MlpMaps& g : grads) ZeroAll(g.Tensors());
  };
  target.update = [&](int l, double norm) {
    DivideAll(grads[l].Tensors(), norm);
    adam[l].Update((*layers)[l].Tensors(), grads[l].Tensors());
  };
  absl::StatusOr<RefineLog> log =
      MeasuredRefineLoop(mlp_options, parsed, target, [&](int l, const AttentionProblem& p) {
        return MlpAttentionErrorAndGradient(p, (*layers)[l], nullptr);
      });
  if (log.ok() && log->kept_start) *layers = start;
  return log;
}

absl::StatusOr<std::optional<HeldoutQuality>> MeasureInMemory(
    const FitOptions& options, const Manifest& manifest,
    const std::vector<std::vector<uint8_t>>& storage, const std::string& what) {
  absl::StatusOr<bool> have = HeldoutHasQueries(options);
  if (!have.ok()) return have.status();
  if (!*have) return std::optional<HeldoutQuality>();
  const std::vector<TensorSpec> specs = MapperTensorSpecs(manifest);
  std::vector<TensorRef> tensors;
  for (size_t i = 0; i < specs.size(); ++i) {
    tensors.push_back({specs[i], absl::Span<const uint8_t>(storage[i].data(), storage[i].size())});
  }
  absl::StatusOr<MapperView> view = MapperViewOf(manifest, tensors);
  if (!view.ok()) return view.status();
  absl::StatusOr<HeldoutQuality> measured = MeasureHeldout(options, *view);
  if (!measured.ok()) return measured.status();
  if (options.solve.show_progress) {
    std::fprintf(options.solve.log,
                 "kvt fit: %s: held-out attention-output cosine %.6f without layer 0, %.6f all "
                 "layers\n",
                 what.c_str(), measured->attention_cosine_without_layer0,
                 measured->attention_cosine);
  }
  return std::optional<HeldoutQuality>(*measured);
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> RefineLayers(
    const FitOptions& options, const StatSet& stats, const ParsedFinal& parsed,
    const Manifest& manifest, DType dtype, std::vector<LayerFit>* fits, bool per_head,
    RefinementSummary* summary) {
  // The start as served: its bytes through the CPU backend, as WriteFitted measures the result.
  Manifest start = manifest;
  const std::vector<std::vector<uint8_t>> storage =
      RidgeStorage(parsed.sigma, *fits, dtype, &start);
  absl::StatusOr<std::optional<HeldoutQuality>> before =
      MeasureInMemory(options, start, storage, "closed-form ridge");
  if (!before.ok()) return before.status();
  absl::StatusOr<RefineLog> log = RefineRidge(options, parsed, fits, per_head);
  if (!log.ok()) return log.status();
  for (int l = 0; l < static_cast<int>(fits->size()); ++l) {
    EvaluateLayerR2(parsed.shape, stats, l, parsed.sigma[l], &(*fits)[l]);
  }
  if (options.solve.show_progress) {
    std::fprintf(options.solve.log,
                 "kvt fit: refined %d steps in %.2f s: loss %.5f -> %.5f (relative attention-"
                 "output error, training batches)%s\n",
                 options.refine.steps, log->seconds, log->loss.front(), log->loss.back(),
                 log->heldout_after
                     ? absl::StrFormat("; held-out %.5f -> %.5f%s", *log->heldout_before,
                                       *log->heldout_after,
                                       log->kept_start ? ", so the closed form is kept" : "")
                           .c_str()
                     : "");
  }
  if (summary != nullptr) *summary = SummaryOf(options.refine, *log);
  return RefineFacts(options.refine, *log, *before ? &**before : nullptr,
                     "the closed-form ridge");
}

RefinementSummary SummaryOf(const RefineOptions& budget, const RefineLog& log) {
  RefinementSummary s;
  s.steps = budget.steps;
  s.batch = budget.batch;
  s.queries = budget.queries;
  s.learning_rate = budget.learning_rate;
  s.handoff = budget.handoff;
  s.seconds = log.seconds;
  s.kept_start = log.kept_start;
  s.heldout_before = log.heldout_before;
  s.heldout_after = log.heldout_after;
  return s;
}

std::vector<std::pair<std::string, std::string>> RefineFacts(const RefineOptions& options,
                                                             const RefineLog& log,
                                                             const HeldoutQuality* before,
                                                             const std::string& start) {
  // The curve at ~10 evenly spaced steps, each the mean of the steps around it (batches vary).
  std::vector<std::string> points;
  const int n = static_cast<int>(log.loss.size());
  const int bins = std::min(10, n);
  for (int i = 0; i < bins; ++i) {
    const int lo = i * n / bins, hi = (i + 1) * n / bins;
    double sum = 0;
    for (int s = lo; s < hi; ++s) sum += log.loss[s];
    points.push_back(absl::StrFormat("%d-%d: %.4f", lo + 1, hi, sum / (hi - lo)));
  }
  std::vector<std::pair<std::string, std::string>> facts = {
      {"refinement",
       absl::StrCat("attention: Adam from ", start, " on ||o^ - o||^2 / ||o||^2 of the "
                    "target's causal attention outputs (its own post-RoPE queries), per layer, "
                    "K and V jointly; ",
                    options.handoff ? "queries after a handoff boundary (mapped keys before "
                                      "it, the target's own from it on); "
                                    : "queries inside the mapped prefix; ",
                    options.steps, " steps of ", options.batch, " sequences x ",
                    options.queries > 0 ? absl::StrCat(options.queries) : std::string("all"),
                    " query tokens, lr ", options.learning_rate, " x tensor RMS, seed ",
                    options.seed, "; ", log.sequences, " training sequences with queries; ",
                    absl::StrFormat("%.2f s", log.seconds))},
      {"refinement loss (mean over layers)", absl::StrJoin(points, ", ")},
  };
  if (log.heldout_before && log.heldout_after) {
    facts.push_back(
        {"held-out refinement loss",
         absl::StrFormat("%.6f -> %.6f (the objective on the held-out sequences, %s)%s",
                         *log.heldout_before, *log.heldout_after,
                         options.handoff ? "boundary at 3/4, every query after it"
                                         : "every query",
                         log.kept_start ? "; not lower, so the start is kept: this mapper is "
                                          "the unrefined one"
                                        : "")});
  }
  if (before != nullptr) {
    facts.push_back(
        {"held-out attention-output cosine before refinement",
         absl::StrFormat("%.6f without layer 0, %.6f all layers (%s as served)",
                         before->attention_cosine_without_layer0, before->attention_cosine,
                         start)});
  }
  return facts;
}

}  // namespace fit
}  // namespace kvt
