#include "fit/stats.h"

#include <cblas.h>

#include <cmath>
#include <cstring>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "safetensors/safetensors.h"

namespace kvt {
namespace fit {
namespace {

constexpr char kEncodingKey[] = "kvt_fit_stats";
constexpr char kEncoding[] = "f64-bits-as-f32-pairs v1";
constexpr char kPlanPrefix[] = "plan.";

// sum[c] += column sums; sumsq (may be null) += column sums of squares.
void SumColumns(const double* m, int64_t rows, int64_t cols, double* sum, double* sumsq) {
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = m + r * cols;
    for (int64_t c = 0; c < cols; ++c) sum[c] += row[c];
    if (sumsq == nullptr) continue;
    for (int64_t c = 0; c < cols; ++c) sumsq[c] += row[c] * row[c];
  }
}

// C [cols_a, cols_b] += A^T B for column blocks of two row-major matrices with `rows` rows.
void AddCross(const double* a, int64_t lda, int64_t cols_a, const double* b, int64_t ldb,
              int64_t cols_b, int64_t rows, double* c) {
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols_a, cols_b, rows, 1.0, a, lda, b, ldb,
              1.0, c, cols_b);
}

// Upper triangle of C [cols, cols] += A^T A.
void AddGram(const double* a, int64_t lda, int64_t cols, int64_t rows, double* c) {
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, cols, rows, 1.0, a, lda, 1.0, c, cols);
}

std::vector<double>& Zeros(StatSet* stats, const std::string& name, int64_t size) {
  std::vector<double>& array = stats->arrays[name];
  array.assign(size, 0.0);
  return array;
}

}  // namespace

std::string ProbeName(int kind, const std::string& what) {
  return absl::StrCat("probe.", KindName(kind), ".", what);
}
std::string FinalName(bool heldout, int kind, const std::string& what) {
  return absl::StrCat(heldout ? "heldout." : "train.", KindName(kind), ".", what);
}
std::string GramName(bool heldout, int kind, int j, int j2) {
  return FinalName(heldout, kind, absl::StrCat("gram.", j, ".", j2));
}
std::string CrossName(bool heldout, int kind, int j, int l) {
  return FinalName(heldout, kind, absl::StrCat("cross.", j, ".", l));
}

absl::Status StatSet::Add(const StatSet& other, const std::string& label) {
  for (const auto& [key, value] : other.metadata) {
    if (key == "sequences" || key == "shard") continue;
    auto it = metadata.find(key);
    if (it == metadata.end() || it->second != value) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, ": metadata '", key, "' is '", value, "' but the shards before it have '",
          it == metadata.end() ? std::string("(absent)") : it->second,
          "' (shards must come from the same models, stride, split and plan)"));
    }
  }
  if (other.arrays.size() != arrays.size()) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": holds ", other.arrays.size(),
                                                   " arrays, the shards before it ",
                                                   arrays.size()));
  }
  for (const auto& [name, values] : other.arrays) {
    auto it = arrays.find(name);
    if (it == arrays.end() || it->second.size() != values.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, ": array '", name, "' is missing from or shaped differently in the shards "
          "before it"));
    }
    if (absl::StartsWith(name, kPlanPrefix) && it->second != values) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": '", name, "' differs: the shards were made with different plans"));
    }
  }
  // Sequences: the union, and a sequence in two shards would be counted twice.
  nlohmann::json mine = nlohmann::json::parse(metadata["sequences"], nullptr, false);
  nlohmann::json theirs = nlohmann::json::parse(
      other.metadata.count("sequences") ? other.metadata.at("sequences") : "", nullptr, false);
  if (mine.is_discarded() || theirs.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": metadata 'sequences' is not JSON"));
  }
  // Entries are names or objects with a "name".
  auto name_of = [](const nlohmann::json& entry) {
    return entry.is_object() ? entry.value("name", std::string()) : entry.get<std::string>();
  };
  std::set<std::string> seen;
  for (const auto& entry : mine) seen.insert(name_of(entry));
  for (const auto& entry : theirs) {
    if (!seen.insert(name_of(entry)).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, ": sequence '", name_of(entry),
          "' is also in an earlier shard (it would be counted twice)"));
    }
    mine.push_back(entry);
  }
  metadata["sequences"] = mine.dump();
  for (const auto& [name, values] : other.arrays) {
    if (absl::StartsWith(name, kPlanPrefix)) continue;
    std::vector<double>& sum = arrays[name];
    for (size_t i = 0; i < values.size(); ++i) sum[i] += values[i];
  }
  return absl::OkStatus();
}

absl::Status WriteStatSet(const std::string& path, const StatSet& stats) {
  std::vector<TensorRef> tensors;
  for (const auto& [name, values] : stats.arrays) {
    TensorRef ref;
    ref.spec.name = name;
    ref.spec.dtype = DType::kFP32;
    ref.spec.shape = {static_cast<int64_t>(values.size()), 2};
    ref.bytes = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(values.data()),
                                          values.size() * sizeof(double));
    tensors.push_back(ref);
  }
  std::map<std::string, std::string> metadata = stats.metadata;
  metadata[kEncodingKey] = kEncoding;
  absl::StatusOr<SafetensorsWriteResult> written = WriteSafetensors(path, tensors, metadata);
  return written.status();
}

absl::StatusOr<StatSet> ReadStatSet(const std::string& path) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  StatSet stats;
  stats.metadata = (*file)->metadata();
  auto encoding = stats.metadata.find(kEncodingKey);
  if (encoding == stats.metadata.end() || encoding->second != kEncoding) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": not a kvt fit statistics file (metadata ", kEncodingKey, " is not '", kEncoding,
        "'; `kvt fit --partial` writes them)"));
  }
  stats.metadata.erase(encoding);
  for (const TensorInfo& tensor : (*file)->tensors()) {
    if (tensor.spec.dtype != DType::kFP32 || tensor.spec.shape.size() != 2 ||
        tensor.spec.shape[1] != 2) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": array '", tensor.spec.name,
                                                     "' is not float64 stored as F32 pairs"));
    }
    std::vector<double>& values = stats.arrays[tensor.spec.name];
    values.resize(tensor.spec.shape[0]);
    std::memcpy(values.data(), (*file)->data(tensor).data(), tensor.size);
  }
  return stats;
}

ProbeAccumulator::ProbeAccumulator(const FitShape& shape) : shape_(shape) {
  const int64_t ls = shape.source.num_layers, lt = shape.target.num_layers;
  Zeros(&stats_, "probe.n", 1);
  for (int c = 0; c < 2; ++c) {
    Zeros(&stats_, ProbeName(c, "sum_x"), ls * shape.ds());
    Zeros(&stats_, ProbeName(c, "sum_y"), lt * shape.dt());
    Zeros(&stats_, ProbeName(c, "sumsq_y"), lt * shape.dt());
    for (int j = 0; j < ls; ++j) {
      Zeros(&stats_, ProbeName(c, absl::StrCat("gram.", j)), shape.ds() * shape.ds());
    }
    if (shape.matched()) {
      const int64_t d = shape.source.head_dim;
      for (int h = 0; h < shape.source.num_kv_heads; ++h) {
        Zeros(&stats_, ProbeName(c, absl::StrCat("cross.h", h)), ls * d * lt * d);
      }
    } else {
      Zeros(&stats_, ProbeName(c, "cross"), ls * shape.ds() * lt * shape.dt());
    }
  }
}

void ProbeAccumulator::Add(const FeatureRows& rows) {
  const int64_t n = rows.rows;
  if (n == 0) return;
  const int64_t ls = shape_.source.num_layers, lt = shape_.target.num_layers;
  const int64_t ds = shape_.ds(), dt = shape_.dt();
  stats_.at("probe.n")[0] += n;
  for (int c = 0; c < 2; ++c) {
    const double* x = (c == 0 ? rows.source_k : rows.source_v).data();
    const double* y = (c == 0 ? rows.target_k : rows.target_v).data();
    SumColumns(x, n, ls * ds, stats_.at(ProbeName(c, "sum_x")).data(), nullptr);
    SumColumns(y, n, lt * dt, stats_.at(ProbeName(c, "sum_y")).data(),
               stats_.at(ProbeName(c, "sumsq_y")).data());
    for (int j = 0; j < ls; ++j) {
      AddGram(x + j * ds, ls * ds, ds, n, stats_.at(ProbeName(c, absl::StrCat("gram.", j))).data());
    }
    if (!shape_.matched()) {
      AddCross(x, ls * ds, ls * ds, y, lt * dt, lt * dt, n, stats_.at(ProbeName(c, "cross")).data());
      continue;
    }
    // Head h of every layer gathered into contiguous columns, so one GEMM per head covers every
    // (source layer, target layer) pair of that head.
    const int64_t d = shape_.source.head_dim;
    const int heads = shape_.source.num_kv_heads;
    head_x_.resize(n * ls * d);
    head_y_.resize(n * lt * d);
    for (int h = 0; h < heads; ++h) {
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < ls; ++j) {
          std::memcpy(&head_x_[(r * ls + j) * d], x + r * ls * ds + j * ds + h * d,
                      d * sizeof(double));
        }
        for (int64_t l = 0; l < lt; ++l) {
          std::memcpy(&head_y_[(r * lt + l) * d], y + r * lt * dt + l * dt + h * d,
                      d * sizeof(double));
        }
      }
      AddCross(head_x_.data(), ls * d, ls * d, head_y_.data(), lt * d, lt * d, n,
               stats_.at(ProbeName(c, absl::StrCat("cross.h", h))).data());
    }
  }
}

std::vector<int> WindowBlocks(const std::vector<int>& sigma, int source_layers, int window) {
  std::vector<int> blocks;
  blocks.reserve(sigma.size() * window);
  for (int o = 0; o < window; ++o) {
    for (int j : sigma) blocks.push_back(o * source_layers + j);
  }
  return blocks;
}

std::vector<int> SigmaOfBlocks(const std::vector<int>& blocks, int window) {
  return std::vector<int>(blocks.begin(), blocks.begin() + blocks.size() / window);
}

BlockPlan BlockPlan::FromSigma(const std::vector<std::vector<int>>& sigma) {
  std::set<std::pair<int, int>> gram, cross;
  for (size_t l = 0; l < sigma.size(); ++l) {
    for (int a : sigma[l]) {
      cross.insert({a, static_cast<int>(l)});
      for (int b : sigma[l]) {
        if (a <= b) gram.insert({a, b});
      }
    }
  }
  BlockPlan plan;
  plan.gram.assign(gram.begin(), gram.end());
  plan.cross.assign(cross.begin(), cross.end());
  return plan;
}

FinalAccumulator::FinalAccumulator(const FitShape& shape, const BlockPlan& plan)
    : shape_(shape), plan_(plan) {
  const int64_t ls = shape.source_blocks(), lt = shape.target.num_layers;
  const int64_t ds = shape.ds(), dt = shape.dt();
  for (bool heldout : {false, true}) {
    Zeros(&stats_, heldout ? "heldout.n" : "train.n", 1);
    for (int c = 0; c < 2; ++c) {
      Zeros(&stats_, FinalName(heldout, c, "sum_x"), ls * ds);
      Zeros(&stats_, FinalName(heldout, c, "sumsq_x"), ls * ds);
      Zeros(&stats_, FinalName(heldout, c, "sum_y"), lt * dt);
      Zeros(&stats_, FinalName(heldout, c, "sumsq_y"), lt * dt);
      for (auto [j, j2] : plan.gram) Zeros(&stats_, GramName(heldout, c, j, j2), ds * ds);
      for (auto [j, l] : plan.cross) Zeros(&stats_, CrossName(heldout, c, j, l), ds * dt);
    }
  }
}

void FinalAccumulator::Add(const FeatureRows& rows, bool heldout) {
  const int64_t n = rows.rows;
  if (n == 0) return;
  const int64_t ls = shape_.source_blocks(), lt = shape_.target.num_layers;
  const int64_t ds = shape_.ds(), dt = shape_.dt();
  stats_.at(heldout ? "heldout.n" : "train.n")[0] += n;
  for (int c = 0; c < 2; ++c) {
    const double* x = (c == 0 ? rows.source_k : rows.source_v).data();
    const double* y = (c == 0 ? rows.target_k : rows.target_v).data();
    SumColumns(x, n, ls * ds, stats_.at(FinalName(heldout, c, "sum_x")).data(),
               stats_.at(FinalName(heldout, c, "sumsq_x")).data());
    SumColumns(y, n, lt * dt, stats_.at(FinalName(heldout, c, "sum_y")).data(),
               stats_.at(FinalName(heldout, c, "sumsq_y")).data());
    for (auto [j, j2] : plan_.gram) {
      double* out = stats_.at(GramName(heldout, c, j, j2)).data();
      if (j == j2) {
        AddGram(x + j * ds, ls * ds, ds, n, out);
      } else {
        AddCross(x + j * ds, ls * ds, ds, x + j2 * ds, ls * ds, ds, n, out);
      }
    }
    for (auto [j, l] : plan_.cross) {
      AddCross(x + j * ds, ls * ds, ds, y + l * dt, lt * dt, dt, n,
               stats_.at(CrossName(heldout, c, j, l)).data());
    }
  }
}

std::vector<int64_t> HeadSourceRows(const FitShape& shape, int64_t blocks, int h) {
  const HeadSources heads = HeadLocalSources(shape.source, shape.target, h);
  const int64_t ds = shape.ds(), d_s = shape.source.head_dim;
  std::vector<int64_t> rows;
  rows.reserve(blocks * heads.count * d_s);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t i = heads.first * d_s; i < (heads.first + heads.count) * d_s; ++i) {
      rows.push_back(b * ds + i);
    }
  }
  return rows;
}

std::string WeightedName(int kind, int l, int h, const std::string& what) {
  return absl::StrCat("aw.", KindName(kind), ".", l, ".", h, ".", what);
}

HeadWeightedAccumulator::HeadWeightedAccumulator(const FitShape& shape,
                                                 const std::vector<std::vector<int>>& sigma)
    : shape_(shape), sigma_(sigma) {
  const int64_t d_t = shape.target.head_dim;
  for (int c = 0; c < 2; ++c) {
    for (int l = 0; l < shape.target.num_layers; ++l) {
      const int64_t in = HeadSourceRows(shape, sigma[l].size(), 0).size();
      for (int h = 0; h < shape.target.num_kv_heads; ++h) {
        for (auto [what, size] : {std::pair<const char*, int64_t>{"n", 1}, {"sum_x", in},
                                  {"gram", in * in}, {"cross", in * d_t}, {"sum_y", d_t},
                                  {"sumsq_y", d_t}}) {
          stats_.arrays[WeightedName(c, l, h, what)].assign(size, 0.0);
        }
      }
    }
  }
}

void HeadWeightedAccumulator::Add(const FeatureRows& rows, const std::vector<double>& weights) {
  const int64_t n = rows.rows, ds = shape_.ds(), dt = shape_.dt(), d_t = shape_.target.head_dim;
  const int heads = shape_.target.num_kv_heads;
  for (int l = 0; l < shape_.target.num_layers; ++l) {
    const std::vector<int>& sigma = sigma_[l];
    for (int h = 0; h < heads; ++h) {
      const double* w = weights.data() + (int64_t{l} * heads + h) * n;
      std::vector<int64_t> cols = HeadSourceRows(shape_, sigma.size(), h);
      for (int64_t& c : cols) c = sigma[c / ds] * ds + c % ds;  // gathered -> feature column
      const int64_t in = cols.size();
      for (int c = 0; c < 2; ++c) {
        const std::vector<double>& xs = c == 0 ? rows.source_k : rows.source_v;
        const std::vector<double>& ys = c == 0 ? rows.target_k : rows.target_v;
        std::vector<double> x(n * in), y(n * d_t);  // rows scaled by sqrt(w)
        std::vector<double>& sum_x = stats_.at(WeightedName(c, l, h, "sum_x"));
        std::vector<double>& sum_y = stats_.at(WeightedName(c, l, h, "sum_y"));
        std::vector<double>& sumsq_y = stats_.at(WeightedName(c, l, h, "sumsq_y"));
        double& total = stats_.at(WeightedName(c, l, h, "n"))[0];
        for (int64_t t = 0; t < n; ++t) {
          const double r = std::sqrt(w[t]);
          total += w[t];
          for (int64_t i = 0; i < in; ++i) {
            const double v = xs[t * rows.source_cols + cols[i]];
            x[t * in + i] = r * v;
            sum_x[i] += w[t] * v;
          }
          for (int64_t e = 0; e < d_t; ++e) {
            const double v = ys[t * rows.target_cols + l * dt + h * d_t + e];
            y[t * d_t + e] = r * v;
            sum_y[e] += w[t] * v;
            sumsq_y[e] += w[t] * v * v;
          }
        }
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, in, n, 1.0, x.data(), in,
                    x.data(), in, 1.0, stats_.at(WeightedName(c, l, h, "gram")).data(), in);
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, d_t, n, 1.0, x.data(), in,
                    y.data(), d_t, 1.0, stats_.at(WeightedName(c, l, h, "cross")).data(), d_t);
      }
    }
  }
}

}  // namespace fit
}  // namespace kvt
