// The calibration set of `kvt fit`: which (source dump, target dump) pairs, the held-out split
// by sequence, shards, and turning one pair into feature rows (RoPE-stripped K, V, as float64).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "host_cache/cache_file.h"  // HostCache
#include "kernels/mapper_view.h"

namespace kvt {
namespace fit {

// One calibration sequence run through both models.
struct SequencePair {
  std::string name;  // the dump's file name: identifies the sequence in splits and shards
  std::string source_path;
  std::string target_path;
  bool heldout = false;
};

// Every *.safetensors file of `source_dir` paired with the file of the same name in
// `target_dir`, sorted by name. A file present on one side only is an error naming it.
absl::StatusOr<std::vector<SequencePair>> PairsFromDirs(const std::string& source_dir,
                                                        const std::string& target_dir);
// A list file: one pair per line, "SOURCE_DUMP TARGET_DUMP" (whitespace-separated; relative paths
// are relative to the list file's directory; '#' starts a comment). Errors name file and line.
absl::StatusOr<std::vector<SequencePair>> PairsFromListFile(const std::string& path);

// How AssignHeldout picks the held-out sequences.
enum class HeldoutSplit {
  // A hash of (seed, name) below `fraction`. Depending on the name alone (not the position in a
  // list) makes the split the same whether the set is fitted in one run or in shards, and stable
  // when sequences are added; but the held-out sequences come from the same documents as the
  // training ones.
  kHash,
  // The last round(fraction x n) sequences of the list (at least one when fraction > 0). Dumps
  // cut in corpus order (dump_kv.py) then hold out the corpus's last documents, so the held-out
  // figures see text the fit did not train on, as a user's traffic is (docs/FIT.md).
  kTail,
};

// Parses "hash" / "tail" (the --heldout_split values); anything else is an error naming them.
absl::StatusOr<HeldoutSplit> ParseHeldoutSplit(const std::string& name);
const char* HeldoutSplitName(HeldoutSplit split);

// Marks the held-out sequences of the whole list (before SelectShard, so shards agree).
void AssignHeldout(double fraction, uint64_t seed, std::vector<SequencePair>* pairs,
                   HeldoutSplit split = HeldoutSplit::kHash);

// Shard `index` of `count`: the pairs at positions index, index + count, ... of the list.
std::vector<SequencePair> SelectShard(const std::vector<SequencePair>& pairs, int index,
                                      int count);

// Feature rows of one or more sequences: row-major float64 matrices with one row per kept token.
// Source columns are layer-major then head-major ([layer][head][dim], so source layer j is the
// column block [j n_s d_s, (j+1) n_s d_s), the row block order of a mapper's W); the same for
// the target. Keys are in content space (RoPE stripped) on both sides.
struct FeatureRows {
  int64_t rows = 0;
  int64_t source_cols = 0;  // L_s n_s d_s
  int64_t target_cols = 0;  // L_t n_t d_t
  std::vector<double> source_k, source_v, target_k, target_v;

  // Sets the column counts and drops every row (the memory is kept for the next rows).
  void Reset(int64_t source_cols, int64_t target_cols);
  // Grows the matrices to `rows` rows (new rows zeroed).
  void Resize(int64_t rows);
};

// Tokens kept from a sequence of `tokens` with `stride`: positions 0, stride, 2 stride, ...
inline int64_t KeptTokens(int64_t tokens, int stride) { return (tokens + stride - 1) / stride; }

// Reads one pair and appends its kept tokens to `rows` (column counts set by Reset). Checks, each error naming the file: the dump's shape against its model
// (layers, KV heads, head_dim), equal token counts on both sides, metadata `rope` is `post`
// (default: keys as a cache holds them, stripped here) or `pre` (already content space).
// Token t of a dump sits at position position_offset + t * position_stride (metadata, defaults
// 0 and 1; both dumps must agree); metadata tokens_sha256, when both have it, must be equal.
// Returns the sequence's token count in the dump (before the stride).
// `window` > 1 (a window mapper's fit, FitShape::window): the source columns hold `window`
// blocks of L_s n_s d_s, block o the source at token t - o (zero before token 0), each key
// stripped at its own token's position; rows->source_cols must be window L_s n_s d_s.
absl::StatusOr<int64_t> AppendSequence(const SequencePair& pair, const ModelSpec& source,
                                       const ModelSpec& target, int stride, FeatureRows* rows,
                                       int window = 1);

// One pair as kvtd would be handed it: both caches with post-RoPE keys (a `rope: pre` dump gets
// its model's RoPE applied and becomes fp32; a post-RoPE dump keeps its dtype and bytes), HND,
// and the tokens' positions. The same checks as AppendSequence.
struct PairCaches {
  HostCache source, target;
  std::vector<uint64_t> positions;
};
absl::StatusOr<PairCaches> ReadPairCaches(const SequencePair& pair, const ModelSpec& source,
                                          const ModelSpec& target);

// The target's post-RoPE queries of one dump (tools/dump_kv.py --queries): tensors
// `queries.{j}` [num_query_heads, T, head_dim] beside the K/V (the name keeps them out of the
// `layers.*` a cache reader checks), for the held-out attention-output cosine of `kvt fit --kind
// both`. `layers[j]` is token-major float [token][query head][dim]; `positions` are the tokens'
// positions (position_offset + t * position_stride).
struct DumpQueries {
  int num_query_heads = 0;
  int64_t num_tokens = 0;
  std::vector<std::vector<float>> layers;
  std::vector<uint64_t> positions;
};
// NOT_FOUND when the dump has no `queries.0`; INVALID_ARGUMENT naming file and tensor for a
// missing layer, a shape that disagrees with `target` (head_dim, a multiple of its KV heads,
// the dump's token count) or a dtype kvt does not read.
absl::StatusOr<DumpQueries> ReadDumpQueries(const std::string& path, const ModelSpec& target);

// CacheBridge's token weights (`--per_head_objective=attention_weighted`): for each target layer
// l and KV head h, the attention mass token t receives from the target's own queries of that
// head's query group, causal, scores q . k / sqrt(d) on the dump's post-RoPE keys, summed over
// the queries and query heads; at the kept tokens (0, stride, ...), scaled to mean 1 per (l, h)
// over them. [L_t][n_t][kept tokens], flat. NOT_FOUND when the target dump has no queries.
absl::StatusOr<std::vector<double>> AttentionMass(const SequencePair& pair, const ModelSpec& source,
                                                  const ModelSpec& target, int stride);

}  // namespace fit
}  // namespace kvt
