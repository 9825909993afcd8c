#include "fit/calibration.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "host_cache/cache_file.h"
#include "kernels/dtype.h"
#include "kernels/rope.h"
#include "safetensors/safetensors.h"

namespace kvt {
namespace fit {
namespace {

absl::StatusOr<std::set<std::string>> DumpNames(const std::string& dir) {
  std::error_code error;
  std::filesystem::directory_iterator it(dir, error);
  if (error) {
    return absl::NotFoundError(absl::StrCat(dir, ": cannot list the directory: ", error.message()));
  }
  std::set<std::string> names;
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && absl::EndsWith(name, ".safetensors")) names.insert(name);
  }
  return names;
}

// SplitMix64: a fixed, well-mixed hash so the split is the same on every machine and build.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

absl::Status CheckShape(const HostCache& cache, const ModelSpec& model, const std::string& path,
                        const char* side) {
  if (cache.num_layers != model.num_layers || cache.num_kv_heads != model.num_kv_heads ||
      cache.head_dim != model.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": dump has ", cache.num_layers, " layers x ", cache.num_kv_heads, " KV heads x ",
        cache.head_dim, " dims but the ", side, " model ", model.name, " has ", model.num_layers,
        " x ", model.num_kv_heads, " x ", model.head_dim));
  }
  return absl::OkStatus();
}

// "post" (default) -> true, "pre" -> false.
absl::StatusOr<bool> KeysArePostRope(const std::map<std::string, std::string>& metadata,
                                     const std::string& path) {
  auto it = metadata.find("rope");
  if (it == metadata.end() || it->second == "post") return true;
  if (it->second == "pre") return false;
  return absl::InvalidArgumentError(absl::StrCat(path, ": metadata rope = '", it->second,
                                                 "', expected 'post' or 'pre'"));
}

// Metadata `key` as a non-negative integer, `fallback` when absent.
absl::StatusOr<uint64_t> MetadataInt(const std::map<std::string, std::string>& metadata,
                                     const std::string& key, uint64_t fallback,
                                     const std::string& path) {
  auto it = metadata.find(key);
  if (it == metadata.end()) return fallback;
  uint64_t value = 0;
  if (!absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": metadata ", key, " = '", it->second,
                                                   "' is not a non-negative integer"));
  }
  return value;
}

// Where token t of a dump sits: offset + t * step (dump_kv.py --keep_every stores every
// step-th position only).
struct Placement {
  uint64_t offset = 0;
  uint64_t step = 1;
  bool operator==(const Placement& o) const { return offset == o.offset && step == o.step; }
};

absl::StatusOr<Placement> PlacementOf(const std::map<std::string, std::string>& metadata,
                                      const std::string& path) {
  absl::StatusOr<uint64_t> offset = MetadataInt(metadata, "position_offset", 0, path);
  if (!offset.ok()) return offset.status();
  absl::StatusOr<uint64_t> step = MetadataInt(metadata, "position_stride", 1, path);
  if (!step.ok()) return step.status();
  if (*step == 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": metadata position_stride is 0"));
  }
  return Placement{*offset, *step};
}

// Writes the kept tokens of one cache into columns of `out` (row stride `cols`) starting at
// `first_row`: K stripped of RoPE when `post_rope`, V as is.
void Extract(const HostCache& cache, const Rope& rope, bool post_rope, Placement placement,
             int stride, int64_t first_row, int64_t cols, double* out_k, double* out_v) {
  const int64_t tokens = cache.num_tokens;
  const int d = cache.head_dim;
  const int64_t kept = KeptTokens(tokens, stride);
  const int half = rope.rotary_dim() / 2;
  std::vector<float> cos(static_cast<size_t>(kept) * half), sin(cos.size());
  for (int64_t r = 0; r < kept; ++r) {
    rope.CosSin(placement.offset + static_cast<uint64_t>(r) * stride * placement.step,
                cos.data() + r * half, sin.data() + r * half);
  }
  const int64_t layer_elements = static_cast<int64_t>(cache.num_kv_heads) * tokens * d;
  std::vector<float> layer(layer_elements);
  std::vector<float> head(d);
  for (int kind = 0; kind < 2; ++kind) {
    for (int j = 0; j < cache.num_layers; ++j) {
      ToFloat(cache.dtype, (kind == 0 ? cache.k : cache.v)[j].data(), layer.data(),
              layer_elements);
      double* out = kind == 0 ? out_k : out_v;
      for (int h = 0; h < cache.num_kv_heads; ++h) {
        for (int64_t r = 0; r < kept; ++r) {
          const float* src = layer.data() + (static_cast<int64_t>(h) * tokens + r * stride) * d;
          const float* x = src;
          if (kind == 0 && post_rope) {
            std::copy(src, src + d, head.begin());
            rope.StripHead(cos.data() + r * half, sin.data() + r * half, head.data());
            x = head.data();
          }
          double* dst = out + (first_row + r) * cols + (static_cast<int64_t>(j) *
                                                            cache.num_kv_heads + h) * d;
          for (int i = 0; i < d; ++i) dst[i] = x[i];
        }
      }
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<SequencePair>> PairsFromDirs(const std::string& source_dir,
                                                        const std::string& target_dir) {
  absl::StatusOr<std::set<std::string>> source = DumpNames(source_dir);
  if (!source.ok()) return source.status();
  absl::StatusOr<std::set<std::string>> target = DumpNames(target_dir);
  if (!target.ok()) return target.status();
  for (const std::string& name : *source) {
    if (target->count(name) == 0) {
      return absl::NotFoundError(absl::StrCat(JoinPath(source_dir, name), " has no counterpart ",
                                              JoinPath(target_dir, name)));
    }
  }
  for (const std::string& name : *target) {
    if (source->count(name) == 0) {
      return absl::NotFoundError(absl::StrCat(JoinPath(target_dir, name), " has no counterpart ",
                                              JoinPath(source_dir, name)));
    }
  }
  if (source->empty()) {
    return absl::NotFoundError(absl::StrCat(source_dir, ": no *.safetensors dumps"));
  }
  std::vector<SequencePair> pairs;
  for (const std::string& name : *source) {
    pairs.push_back({name, JoinPath(source_dir, name), JoinPath(target_dir, name), false});
  }
  return pairs;
}

absl::StatusOr<std::vector<SequencePair>> PairsFromListFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  const std::string base = Dirname(path);
  std::vector<SequencePair> pairs;
  std::set<std::string> names;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_number;
    line = line.substr(0, line.find('#'));
    std::vector<std::string> fields = absl::StrSplit(line, absl::ByAnyChar(" \t\r"),
                                                     absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " line ", line_number, ": expected 'SOURCE_DUMP TARGET_DUMP', got ",
          fields.size(), " fields"));
    }
    for (std::string& field : fields) {
      if (field[0] != '/') field = JoinPath(base, field);
    }
    const std::string name = Basename(fields[0]);
    if (!names.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " line ", line_number, ": sequence name '", name,
          "' (the source dump's file name) appears twice; names identify sequences in the "
          "held-out split and in shards"));
    }
    pairs.push_back({name, fields[0], fields[1], false});
  }
  if (pairs.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no pairs"));
  return pairs;
}

absl::StatusOr<HeldoutSplit> ParseHeldoutSplit(const std::string& name) {
  if (name == "hash") return HeldoutSplit::kHash;
  if (name == "tail") return HeldoutSplit::kTail;
  return absl::InvalidArgumentError(
      absl::StrCat("--heldout_split must be 'hash' or 'tail', got '", name, "'"));
}

const char* HeldoutSplitName(HeldoutSplit split) {
  return split == HeldoutSplit::kTail ? "tail" : "hash";
}

void AssignHeldout(double fraction, uint64_t seed, std::vector<SequencePair>* pairs,
                   HeldoutSplit split) {
  if (split == HeldoutSplit::kTail) {
    const size_t n = pairs->size();
    size_t held = static_cast<size_t>(std::llround(fraction * static_cast<double>(n)));
    if (fraction > 0 && held == 0 && n > 0) held = 1;
    for (size_t i = 0; i < n; ++i) (*pairs)[i].heldout = i + held >= n;
    return;
  }
  for (SequencePair& pair : *pairs) {
    uint64_t hash = Mix(seed);
    for (unsigned char c : pair.name) hash = Mix(hash ^ c);
    pair.heldout = static_cast<double>(hash >> 11) * 0x1.0p-53 < fraction;
  }
}

std::vector<SequencePair> SelectShard(const std::vector<SequencePair>& pairs, int index,
                                      int count) {
  std::vector<SequencePair> shard;
  for (size_t i = index; i < pairs.size(); i += count) shard.push_back(pairs[i]);
  return shard;
}

void FeatureRows::Reset(int64_t source, int64_t target) {
  rows = 0;
  source_cols = source;
  target_cols = target;
  for (std::vector<double>* m : {&source_k, &source_v, &target_k, &target_v}) m->clear();
}

void FeatureRows::Resize(int64_t new_rows) {
  rows = new_rows;
  source_k.resize(rows * source_cols);
  source_v.resize(rows * source_cols);
  target_k.resize(rows * target_cols);
  target_v.resize(rows * target_cols);
}

namespace {

// Both dumps of a pair, read and checked against each other and their models.
struct CheckedPair {
  HostCache source, target;
  bool source_post = true, target_post = true;
  Placement placement;
};

absl::StatusOr<CheckedPair> ReadCheckedPair(const SequencePair& pair, const ModelSpec& source,
                                            const ModelSpec& target) {
  CheckedPair out;
  std::map<std::string, std::string> source_meta, target_meta;
  absl::StatusOr<HostCache> source_cache = ReadCacheFile(pair.source_path, &source_meta);
  if (!source_cache.ok()) return source_cache.status();
  absl::StatusOr<HostCache> target_cache = ReadCacheFile(pair.target_path, &target_meta);
  if (!target_cache.ok()) return target_cache.status();
  absl::Status status = CheckShape(*source_cache, source, pair.source_path, "source");
  if (status.ok()) status = CheckShape(*target_cache, target, pair.target_path, "target");
  if (!status.ok()) return status;
  if (source_cache->num_tokens != target_cache->num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        pair.target_path, ": ", target_cache->num_tokens, " tokens but the source dump ",
        pair.source_path, " has ", source_cache->num_tokens,
        " (both models must see the same token sequence)"));
  }
  if (source_cache->num_tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat(pair.source_path, ": no tokens"));
  }
  absl::StatusOr<bool> source_post = KeysArePostRope(source_meta, pair.source_path);
  absl::StatusOr<bool> target_post = KeysArePostRope(target_meta, pair.target_path);
  absl::StatusOr<Placement> source_place = PlacementOf(source_meta, pair.source_path);
  absl::StatusOr<Placement> target_place = PlacementOf(target_meta, pair.target_path);
  for (const absl::Status& s : {source_post.status(), target_post.status(),
                                source_place.status(), target_place.status()}) {
    if (!s.ok()) return s;
  }
  if (!(*source_place == *target_place)) {
    return absl::InvalidArgumentError(absl::StrCat(
        pair.target_path, ": position_offset/position_stride ", target_place->offset, "/",
        target_place->step, " but the source dump has ", source_place->offset, "/",
        source_place->step));
  }
  // Written by tools/dump_kv.py: both models must have read the same token ids.
  auto source_ids = source_meta.find("tokens_sha256");
  auto target_ids = target_meta.find("tokens_sha256");
  if (source_ids != source_meta.end() && target_ids != target_meta.end() &&
      source_ids->second != target_ids->second) {
    return absl::InvalidArgumentError(absl::StrCat(
        pair.target_path, ": tokens_sha256 differs from the source dump ", pair.source_path,
        " (the two models read different token sequences: same corpus, tokenizer and --tokens?)"));
  }
  out.source = *std::move(source_cache);
  out.target = *std::move(target_cache);
  out.source_post = *source_post;
  out.target_post = *target_post;
  out.placement = *source_place;
  return out;
}

// A `rope: pre` cache (content-space keys) as a model holds it: fp32 with `rope` applied to
// the keys at `positions`. A post-RoPE cache is left as it is.
void ToPostRope(const Rope& rope, const std::vector<uint64_t>& positions, HostCache* cache) {
  HostCache post = HostCache::Zeros(DType::kFP32, Layout::kHND, cache->num_layers,
                                    cache->num_kv_heads, cache->head_dim, cache->num_tokens);
  const int64_t T = cache->num_tokens, count = int64_t{cache->num_kv_heads} * T * cache->head_dim;
  const int d = cache->head_dim, half = rope.rotary_dim() / 2;
  std::vector<float> cos(T * half), sin(T * half);
  for (int64_t t = 0; t < T; ++t) rope.CosSin(positions[t], &cos[t * half], &sin[t * half]);
  for (int j = 0; j < cache->num_layers; ++j) {
    float* k = reinterpret_cast<float*>(post.k[j].data());
    ToFloat(cache->dtype, cache->k[j].data(), k, count);
    ToFloat(cache->dtype, cache->v[j].data(), reinterpret_cast<float*>(post.v[j].data()), count);
    for (int h = 0; h < cache->num_kv_heads; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        rope.ApplyHead(&cos[t * half], &sin[t * half], k + (h * T + t) * d);
      }
    }
  }
  *cache = std::move(post);
}

}  // namespace

absl::StatusOr<int64_t> AppendSequence(const SequencePair& pair, const ModelSpec& source,
                                       const ModelSpec& target, int stride, FeatureRows* rows,
                                       int window) {
  const int64_t layer_cols = int64_t{source.num_layers} * source.num_kv_heads * source.head_dim;
  if (window < 1 || rows->source_cols != window * layer_cols) {
    return absl::InternalError(absl::StrCat("AppendSequence: source_cols ", rows->source_cols,
                                            " is not window ", window, " x ", layer_cols));
  }
  absl::StatusOr<CheckedPair> read = ReadCheckedPair(pair, source, target);
  if (!read.ok()) return read.status();
  absl::StatusOr<Rope> source_rope = Rope::Create(source.rope, source.head_dim);
  absl::StatusOr<Rope> target_rope = Rope::Create(target.rope, target.head_dim);
  if (!source_rope.ok()) return source_rope.status();
  if (!target_rope.ok()) return target_rope.status();
  const int64_t first = rows->rows;
  const int64_t tokens = read->source.num_tokens;
  rows->Resize(first + KeptTokens(tokens, stride));
  if (window == 1) {
    Extract(read->source, *source_rope, read->source_post, read->placement, stride, first,
            rows->source_cols, rows->source_k.data(), rows->source_v.data());
  } else {
    // Every token once (stride 1, stripped at its own position), then each kept token's row
    // from its window of earlier tokens; Resize left the blocks before token 0 zero.
    std::vector<double> all_k(tokens * layer_cols), all_v(tokens * layer_cols);
    Extract(read->source, *source_rope, read->source_post, read->placement, /*stride=*/1, 0,
            layer_cols, all_k.data(), all_v.data());
    for (int64_t r = 0; r < KeptTokens(tokens, stride); ++r) {
      for (int64_t o = 0; o < window && o <= r * stride; ++o) {
        const int64_t from = (r * stride - o) * layer_cols;
        const int64_t to = (first + r) * rows->source_cols + o * layer_cols;
        std::copy(all_k.begin() + from, all_k.begin() + from + layer_cols,
                  rows->source_k.begin() + to);
        std::copy(all_v.begin() + from, all_v.begin() + from + layer_cols,
                  rows->source_v.begin() + to);
      }
    }
  }
  Extract(read->target, *target_rope, read->target_post, read->placement, stride, first,
          rows->target_cols, rows->target_k.data(), rows->target_v.data());
  return read->source.num_tokens;
}

absl::StatusOr<PairCaches> ReadPairCaches(const SequencePair& pair, const ModelSpec& source,
                                          const ModelSpec& target) {
  absl::StatusOr<CheckedPair> read = ReadCheckedPair(pair, source, target);
  if (!read.ok()) return read.status();
  PairCaches out;
  for (int64_t t = 0; t < read->source.num_tokens; ++t) {
    out.positions.push_back(read->placement.offset +
                            static_cast<uint64_t>(t) * read->placement.step);
  }
  for (auto [post, model, cache] :
       {std::tuple<bool, const ModelSpec*, HostCache*>{read->source_post, &source, &read->source},
        {read->target_post, &target, &read->target}}) {
    if (post) continue;
    absl::StatusOr<Rope> rope = Rope::Create(model->rope, model->head_dim);
    if (!rope.ok()) return rope.status();
    ToPostRope(*rope, out.positions, cache);
  }
  out.source = std::move(read->source);
  out.target = std::move(read->target);
  return out;
}

absl::StatusOr<DumpQueries> ReadDumpQueries(const std::string& path, const ModelSpec& target) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  if (!file.ok()) return file.status();
  const TensorInfo* k0 = (*file)->Find("layers.0.k");
  const TensorInfo* q0 = (*file)->Find("queries.0");
  if (q0 == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        path, ": no tensor 'queries.0' (dump the target with tools/dump_kv.py --queries)"));
  }
  if (k0 == nullptr || k0->spec.shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no well-shaped 'layers.0.k'"));
  }
  absl::StatusOr<Placement> placement = PlacementOf((*file)->metadata(), path);
  if (!placement.ok()) return placement.status();
  DumpQueries queries;
  queries.num_tokens = k0->spec.shape[1];
  const int d = target.head_dim;
  for (int j = 0; j < target.num_layers; ++j) {
    const std::string name = absl::StrCat("queries.", j);
    const TensorInfo* q = (*file)->Find(name);
    if (q == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": missing tensor '", name, "'"));
    }
    const std::vector<int64_t>& shape = q->spec.shape;
    if (shape.size() != 3 || shape[1] != queries.num_tokens || shape[2] != d || shape[0] < 1 ||
        shape[0] % target.num_kv_heads != 0 || (j > 0 && shape[0] != queries.num_query_heads)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", name, "' has shape ", FormatShape(shape), ", expected [H_q, ",
          queries.num_tokens, ", ", d, "] with H_q a multiple of the ", target.num_kv_heads,
          " KV heads (the same for every layer)"));
    }
    queries.num_query_heads = static_cast<int>(shape[0]);
    const int64_t count = shape[0] * shape[1] * shape[2];
    std::vector<float> hnd(count);
    ToFloat(q->spec.dtype, (*file)->data(*q).data(), hnd.data(), count);
    std::vector<float> token_major(count);
    for (int64_t h = 0; h < shape[0]; ++h) {
      for (int64_t t = 0; t < shape[1]; ++t) {
        std::copy(&hnd[(h * shape[1] + t) * d], &hnd[(h * shape[1] + t) * d] + d,
                  &token_major[(t * shape[0] + h) * d]);
      }
    }
    queries.layers.push_back(std::move(token_major));
  }
  for (int64_t t = 0; t < queries.num_tokens; ++t) {
    queries.positions.push_back(placement->offset + static_cast<uint64_t>(t) * placement->step);
  }
  return queries;
}

namespace {

// Adds to `mass` [T] what each key receives from the query rows q (head of `d` values at row
// stride q_stride) over keys k [T, d]: causal softmax of q . k / sqrt(d), scores by one dgemm.
void AddAttentionMass(int64_t T, int d, const float* q, int64_t q_stride, const double* k,
                      double* mass) {
  std::vector<double> queries(T * d), p(T * T);
  for (int64_t i = 0; i < T; ++i) {
    for (int e = 0; e < d; ++e) queries[i * d + e] = q[i * q_stride + e];
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, d,
              1.0 / std::sqrt(static_cast<double>(d)), queries.data(), d, k, d, 0.0, p.data(), T);
  for (int64_t i = 0; i < T; ++i) {
    double* row = p.data() + i * T;
    const double top = *std::max_element(row, row + i + 1);
    double sum = 0;
    for (int64_t j = 0; j <= i; ++j) sum += (row[j] = std::exp(row[j] - top));
    for (int64_t j = 0; j <= i; ++j) mass[j] += row[j] / sum;
  }
}

}  // namespace

absl::StatusOr<std::vector<double>> AttentionMass(const SequencePair& pair, const ModelSpec& source,
                                                  const ModelSpec& target, int stride) {
  absl::StatusOr<DumpQueries> queries = ReadDumpQueries(pair.target_path, target);
  if (!queries.ok()) return queries.status();
  absl::StatusOr<PairCaches> caches = ReadPairCaches(pair, source, target);
  if (!caches.ok()) return caches.status();
  const HostCache& cache = caches->target;
  const int64_t T = cache.num_tokens, kept = KeptTokens(T, stride);
  const int n = target.num_kv_heads, d = target.head_dim, nq = queries->num_query_heads;
  const int group = nq / n;
  std::vector<double> weights;
  weights.reserve(target.num_layers * n * kept);
  std::vector<double> keys(T * d), mass(T);
  std::vector<float> row(d);
  for (int l = 0; l < target.num_layers; ++l) {
    for (int h = 0; h < n; ++h) {
      for (int64_t t = 0; t < T; ++t) {  // HND: head h's rows are contiguous
        ToFloat(cache.dtype, cache.k[l].data() + (h * T + t) * d * DTypeSize(cache.dtype),
                row.data(), d);
        std::copy(row.begin(), row.end(), keys.begin() + t * d);
      }
      std::fill(mass.begin(), mass.end(), 0.0);
      for (int g = 0; g < group; ++g) {
        const float* q = queries->layers[l].data() + (h * group + g) * d;  // [T][nq][d]
        AddAttentionMass(T, d, q, int64_t{nq} * d, keys.data(), mass.data());
      }
      double mean = 0;
      for (int64_t t = 0; t < T; t += stride) mean += mass[t] / kept;
      for (int64_t t = 0; t < T; t += stride) weights.push_back(mean > 0 ? mass[t] / mean : 1.0);
    }
  }
  return weights;
}

}  // namespace fit
}  // namespace kvt
