#include "fit/synthetic_family.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file_util.h"
#include "fit/solve.h"
#include "host_cache/cache_file.h"
#include "kernels/dtype.h"
#include "kernels/rope.h"
#include "safetensors/safetensors.h"

namespace kvt {
namespace fit {
namespace testing {
namespace {

int64_t Width(const ModelSpec& m) { return int64_t{m.num_kv_heads} * m.head_dim; }

HostCache EmptyCache(const ModelSpec& model, int64_t tokens, DType dtype) {
  return HostCache::Zeros(dtype, Layout::kHND, model.num_layers, model.num_kv_heads,
                          model.head_dim, tokens);
}

// Stores content-space rows [tokens, n d] of one layer into the cache in HND, applying the
// model's RoPE to keys (as a model writes its cache).
void Store(const ModelSpec& model, const Rope& rope, const std::vector<double>& rows, bool key,
           std::vector<char>* layer, DType dtype) {
  const int64_t tokens = rows.size() / Width(model);
  const int d = model.head_dim, half = rope.rotary_dim() / 2;
  std::vector<float> head(d), cos(half), sin(half);
  for (int64_t t = 0; t < tokens; ++t) {
    if (key) rope.CosSin(t, cos.data(), sin.data());
    for (int h = 0; h < model.num_kv_heads; ++h) {
      for (int i = 0; i < d; ++i) head[i] = rows[t * Width(model) + h * d + i];
      if (key) rope.ApplyHead(cos.data(), sin.data(), head.data());
      FromFloat(dtype, head.data(),
                layer->data() + ((h * tokens + t) * d) * DTypeSize(dtype), d);
    }
  }
}

// The target dump of sequence `s` with its queries (the layout tools/dump_kv.py --queries
// writes): the cache's tensors, then `queries.{l}` [g n_t, T, d] post-RoPE.
absl::Status WriteWithQueries(const FamilyOptions& o, const Rope& rope, int s,
                              const HostCache& cache, const std::string& path, DType dtype) {
  std::mt19937_64 rng(o.seed * 1000003 + s + 0x9e3779b97f4a7c15ull);
  std::normal_distribution<double> normal;
  const int64_t T = cache.num_tokens;
  const int nq = o.query_group * o.target.num_kv_heads, d = o.target.head_dim;
  const int half = rope.rotary_dim() / 2;
  std::vector<float> cos(half), sin(half), head(d);
  std::vector<std::vector<char>> queries(o.target.num_layers,
                                         std::vector<char>(nq * T * d * DTypeSize(dtype)));
  for (int l = 0; l < o.target.num_layers; ++l) {
    for (int q = 0; q < nq; ++q) {
      for (int64_t t = 0; t < T; ++t) {
        rope.CosSin(t, cos.data(), sin.data());
        for (int i = 0; i < d; ++i) head[i] = static_cast<float>(normal(rng));
        rope.ApplyHead(cos.data(), sin.data(), head.data());
        FromFloat(dtype, head.data(), queries[l].data() + ((q * T + t) * d) * DTypeSize(dtype),
                  d);
      }
    }
  }
  std::vector<TensorRef> tensors;
  auto add = [&](std::string name, const std::vector<char>& bytes, int64_t heads) {
    TensorRef t;
    t.spec.name = std::move(name);
    t.spec.dtype = dtype;
    t.spec.shape = {heads, T, d};
    t.bytes = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()),
                                        bytes.size());
    tensors.push_back(std::move(t));
  };
  for (int l = 0; l < o.target.num_layers; ++l) {
    add(absl::StrCat("layers.", l, ".k"), cache.k[l], o.target.num_kv_heads);
    add(absl::StrCat("layers.", l, ".v"), cache.v[l], o.target.num_kv_heads);
    add(absl::StrCat("queries.", l), queries[l], nq);
  }
  return WriteSafetensors(path, tensors, {{"rope", "post"}}).status();
}

// Zeroes every weight outside the head-local pattern (rows of target head h's source heads x
// its d_t columns), rows block-major, head-major inside.
void KeepHeadLocal(const FamilyOptions& o, size_t blocks, std::vector<double>* weights) {
  const int64_t dt = Width(o.target);
  std::vector<double> kept(weights->size(), 0.0);
  const FitShape shape{o.source, o.target};
  for (int h = 0; h < o.target.num_kv_heads; ++h) {
    for (int64_t row : HeadSourceRows(shape, blocks, h)) {
      for (int64_t c = h * o.target.head_dim; c < (h + 1) * o.target.head_dim; ++c) {
        kept[row * dt + c] = (*weights)[row * dt + c];
      }
    }
  }
  *weights = std::move(kept);
}

}  // namespace

std::string SequenceFileName(int index) {
  return absl::StrFormat("seq%04d.safetensors", index);
}

Family MakeFamily(const FamilyOptions& options) {
  Family family;
  family.options = options;
  std::mt19937_64 rng(options.seed);
  std::normal_distribution<double> normal;
  const int64_t ds = Width(options.source), dt = Width(options.target);
  for (int j = 0; j < options.source.num_layers; ++j) {
    for (auto* means : {&family.mean_k, &family.mean_v}) {
      std::vector<double> mean(ds);
      for (double& m : mean) m = 1.5 * normal(rng);
      means->push_back(mean);
    }
  }
  for (int l = 0; l < options.target.num_layers; ++l) {
    const std::vector<int>& sigma = options.true_sigma[l];
    for (auto [w, b] : {std::pair{&family.w_k, &family.b_k}, std::pair{&family.w_v, &family.b_v}}) {
      const size_t blocks = sigma.size() * options.window;
      std::vector<double> weights(blocks * ds * dt);
      for (size_t block = 0; block < blocks; ++block) {
        // Decreasing scales give the true layers distinct probe scores in sigma's order (the
        // earlier tokens' blocks weigh less, so the probe at offset 0 still ranks them).
        const size_t a = block % sigma.size(), o = block / sigma.size();
        const double scale = std::pow(0.6, a) * std::pow(0.7, o) / std::sqrt(static_cast<double>(ds));
        for (int64_t i = 0; i < ds * dt; ++i) weights[block * ds * dt + i] = scale * normal(rng);
      }
      if (options.head_local) KeepHeadLocal(options, blocks, &weights);
      std::vector<double> bias(dt);
      for (double& x : bias) x = 0.5 * normal(rng);
      w->push_back(weights);
      b->push_back(bias);
    }
  }
  return family;
}

absl::Status WriteSequences(const Family& family, const std::string& dir, int first, int count,
                            int64_t tokens, DType dtype, bool clean) {
  const FamilyOptions& o = family.options;
  const int64_t ds = Width(o.source), dt = Width(o.target);
  absl::StatusOr<Rope> source_rope = Rope::Create(o.source.rope, o.source.head_dim);
  absl::StatusOr<Rope> target_rope = Rope::Create(o.target.rope, o.target.head_dim);
  if (!source_rope.ok()) return source_rope.status();
  if (!target_rope.ok()) return target_rope.status();
  for (const char* sub : {"source", "target", "target_clean"}) {
    if (!clean && std::string(sub) == "target_clean") continue;
    absl::Status made = MakeDirs(JoinPath(dir, sub));
    if (!made.ok()) return made;
  }
  for (int s = first; s < first + count; ++s) {
    std::mt19937_64 rng(o.seed * 1000003 + s);
    std::normal_distribution<double> normal;
    HostCache source = EmptyCache(o.source, tokens, dtype);
    HostCache target = EmptyCache(o.target, tokens, dtype);
    HostCache target_clean = EmptyCache(o.target, tokens, dtype);
    // Content-space features per source layer, [tokens, ds].
    std::vector<std::vector<double>> xk(o.source.num_layers), xv(o.source.num_layers);
    for (int j = 0; j < o.source.num_layers; ++j) {
      for (auto [x, mean] : {std::pair{&xk[j], &family.mean_k[j]},
                             std::pair{&xv[j], &family.mean_v[j]}}) {
        x->resize(tokens * ds);
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t i = 0; i < ds; ++i) (*x)[t * ds + i] = (*mean)[i] + normal(rng);
        }
      }
      Store(o.source, *source_rope, xk[j], true, &source.k[j], dtype);
      Store(o.source, *source_rope, xv[j], false, &source.v[j], dtype);
    }
    for (int l = 0; l < o.target.num_layers; ++l) {
      const std::vector<int>& sigma = o.true_sigma[l];
      for (int kind = 0; kind < 2; ++kind) {
        const std::vector<double>& w = (kind == 0 ? family.w_k : family.w_v)[l];
        const std::vector<double>& b = (kind == 0 ? family.b_k : family.b_v)[l];
        // Noise per column so that noise / (signal + noise) = noise_share (x has unit variance).
        std::vector<double> noise_sd(dt);
        for (int64_t c = 0; c < dt; ++c) {
          double signal = 0;
          for (size_t r = 0; r < w.size() / dt; ++r) signal += w[r * dt + c] * w[r * dt + c];
          noise_sd[c] = std::sqrt(signal * o.noise_share / (1 - o.noise_share));
        }
        std::vector<double> y(tokens * dt), y_clean(tokens * dt);
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t c = 0; c < dt; ++c) {
            double value = b[c];
            for (size_t block = 0; block < sigma.size() * o.window; ++block) {
              const int64_t from = t - static_cast<int64_t>(block / sigma.size());
              if (from < 0) continue;
              const std::vector<double>& x = (kind == 0 ? xk : xv)[sigma[block % sigma.size()]];
              for (int64_t i = 0; i < ds; ++i) {
                value += x[from * ds + i] * w[(block * ds + i) * dt + c];
              }
            }
            y_clean[t * dt + c] = value;
            y[t * dt + c] = value + noise_sd[c] * normal(rng);
          }
        }
        Store(o.target, *target_rope, y, kind == 0, &(kind == 0 ? target.k : target.v)[l], dtype);
        Store(o.target, *target_rope, y_clean, kind == 0,
              &(kind == 0 ? target_clean.k : target_clean.v)[l], dtype);
      }
    }
    const std::string name = SequenceFileName(s);
    absl::Status written = WriteCacheFile(JoinPath(JoinPath(dir, "source"), name), source);
    if (written.ok()) {
      written = o.query_group > 0
                    ? WriteWithQueries(o, *target_rope, s, target,
                                       JoinPath(JoinPath(dir, "target"), name), dtype)
                    : WriteCacheFile(JoinPath(JoinPath(dir, "target"), name), target);
    }
    if (written.ok() && clean) {
      written = WriteCacheFile(JoinPath(JoinPath(dir, "target_clean"), name), target_clean);
    }
    if (!written.ok()) return written;
  }
  return absl::OkStatus();
}

std::string HfConfigJson(const ModelSpec& model) {
  std::string scaling = "null";
  const RopeScaling& s = model.rope.scaling;
  switch (s.type) {
    case RopeScalingType::kNone:
      break;
    case RopeScalingType::kLinear:
      scaling = absl::StrFormat(R"({"rope_type": "linear", "factor": %.17g})", s.factor);
      break;
    case RopeScalingType::kLlama3:
      scaling = absl::StrFormat(
          R"({"rope_type": "llama3", "factor": %.17g, "low_freq_factor": %.17g, )"
          R"("high_freq_factor": %.17g, "original_max_position_embeddings": %.17g})",
          s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings);
      break;
    case RopeScalingType::kYarn:
      scaling = absl::StrFormat(
          R"({"rope_type": "yarn", "factor": %.17g, "beta_fast": %.17g, "beta_slow": %.17g, )"
          R"("original_max_position_embeddings": %.17g%s})",
          s.factor, s.beta_fast, s.beta_slow, s.original_max_position_embeddings,
          s.has_attention_factor ? absl::StrFormat(R"(, "attention_factor": %.17g)",
                                                   s.attention_factor)
                                 : "");
      break;
  }
  return absl::StrFormat(
      R"({"_name_or_path": "%s", "architectures": ["LlamaForCausalLM"], "model_type": "llama", )"
      R"("num_hidden_layers": %d, "num_attention_heads": %d, "num_key_value_heads": %d, )"
      R"("head_dim": %d, "hidden_size": %d, "rope_theta": %.17g, "partial_rotary_factor": %.17g, )"
      R"("max_position_embeddings": 4096, "rope_scaling": %s})",
      model.name, model.num_layers, model.num_kv_heads * 2, model.num_kv_heads, model.head_dim,
      model.num_kv_heads * 2 * model.head_dim, model.rope.theta,
      static_cast<double>(model.rope.rotary_dim) / model.head_dim, scaling);
}

}  // namespace testing
}  // namespace fit
}  // namespace kvt
