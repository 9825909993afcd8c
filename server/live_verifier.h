// Live verification of applied handoffs (docs/OPERATIONS.md, "Live verification"): a sample of
// the lookups the quality gate would apply is answered "verify" instead; the engine prefills
// that request itself and publishes its own cache, and when that publish arrives the stored
// source prefix is translated through the same mapper version (off the request path, on a
// worker of its own) and compared with it: one K/V cosine per sample. A mapper version whose
// last `window` samples average below its recorded quality.kv_cosine_heldout - tolerance is
// out of service until an operator restores it or a new version of the mapper is loaded.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/mutex.h"
#include "common/work_queue.h"
#include "prefix_cache/chain_hash.h"
#include "prefix_cache/prefix_cache.h"
#include "server/metrics.h"

namespace kvt {

struct LiveVerifierOptions {
  // Every round(1 / sample_fraction)-th gate-passing lookup per mapper version is a sample
  // (deterministic: the first is never one); 0 = off.
  double sample_fraction = 0;
  int window = 8;           // samples per mapper version the decision uses
  double tolerance = 0.05;  // how far below the recorded figure the window mean may fall
  int max_pending = 64;     // samples awaiting their own publish; the oldest expire first
  absl::Duration pending_ttl = absl::Seconds(120);
  int block_tokens = 16;                // the prefix cache's chain-hash block
  std::function<absl::Time()> now;      // default absl::Now
};

// A mapper version's identity: `weights_sha256` (LoadedMapper::weights_sha256), or
// "generation N" when the store does not verify checksums (empty hash).
std::string MapperVersionOf(const std::string& weights_sha256, int64_t generation);

// One version of one mapper, as the store served it to a lookup.
struct VerifiedMapper {
  std::string id;
  // MapperVersionOf: a different value is a new version (its state starts clean); a reload of
  // the same weights is not.
  std::string version;
  int64_t generation = 0;  // MapperInfo::generation, for reports
  PairLabels pair = PairLabels::Unknown();
  std::optional<double> recorded;  // manifest quality.kv_cosine_heldout
};

// A lookup answered "verify": the source prefix it would have leased, awaiting the target's own
// publish of the same tokens.
struct PendingSample {
  VerifiedMapper mapper;
  PrefixMatch source;
  BlockHash last_block{};  // chain hash, under the target model, of the last matched block
  absl::Time created;
};

// Live verification's view of one mapper (its current version).
struct VerificationState {
  VerifiedMapper mapper;
  int samples = 0;
  std::optional<double> live;  // mean of the window
  bool out_of_service = false;
  std::string reason;
};

class LiveVerifier {
 public:
  // The K/V cosine (quality/kv_quality.h KvCosineOverLayers) of sample.source translated
  // through sample.mapper, exactly that version, against `own`: the target's cache holding at
  // least the same tokens. An error counts the sample "skipped" (e.g. the version is gone).
  using Measure =
      std::function<absl::StatusOr<double>(const PendingSample& sample, const PrefixEntry& own)>;

  // `metrics` may be null. INVALID_ARGUMENT naming the option for a bad one.
  static absl::StatusOr<std::unique_ptr<LiveVerifier>> Create(LiveVerifierOptions options,
                                                              Measure measure, Metrics* metrics);
  // Measures every queued sample first.
  ~LiveVerifier();
  LiveVerifier(const LiveVerifier&) = delete;
  LiveVerifier& operator=(const LiveVerifier&) = delete;

  bool enabled() const { return period_ > 0; }
  int64_t period() const { return period_; }

  // Lookup side, for a mapper version the gate would apply. The reason it is out of service
  // ("live_quality: ..."), or empty. A version other than the one the state was kept for clears
  // the state (a new version of the mapper is back in service).
  std::string OutOfService(const VerifiedMapper& mapper) ABSL_LOCKS_EXCLUDED(mutex_);
  // Counts one applicable lookup of `mapper`; true when it is a sample: the caller answers
  // "verify" and passes the match to AddPending.
  bool Sample(const VerifiedMapper& mapper) ABSL_LOCKS_EXCLUDED(mutex_);
  void AddPending(const VerifiedMapper& mapper, const PrefixMatch& source)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Publish side: `own` was just committed. Pending samples of its model whose prefix it holds
  // (same chain hash of the last matched block) are measured on the worker; with
  // max_pending samples already waiting for it, a matched sample is counted "skipped".
  void OnPublish(const std::shared_ptr<const PrefixEntry>& own) ABSL_LOCKS_EXCLUDED(mutex_);
  // One measured sample (the worker calls this; tests may too).
  void Record(const VerifiedMapper& mapper, const absl::StatusOr<double>& live)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Puts `mapper_id` back in service, its window cleared. NOT_FOUND naming mapper_id when
  // live verification has never seen it. The bool: it was out of service.
  absl::StatusOr<std::pair<bool, VerificationState>> Restore(const std::string& mapper_id)
      ABSL_LOCKS_EXCLUDED(mutex_);
  std::vector<VerificationState> List() ABSL_LOCKS_EXCLUDED(mutex_);
  int pending() ABSL_LOCKS_EXCLUDED(mutex_);
  // Returns when every sample handed to the worker so far has been recorded.
  void Drain() { worker_.Drain(); }

 private:
  struct MapperRecord {
    VerifiedMapper mapper;
    int64_t lookups = 0;
    std::deque<double> window;
    bool out_of_service = false;
    std::string reason;
  };
  LiveVerifier(LiveVerifierOptions options, int64_t period, Measure measure, Metrics* metrics);
  absl::Time Now() const { return options_.now ? options_.now() : absl::Now(); }
  // The record of mapper.id for exactly mapper.generation (a new version starts a fresh one).
  MapperRecord& RecordFor(const VerifiedMapper& mapper) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Drops pending samples past their age, and the oldest beyond `keep`; counted "expired".
  void ExpireLocked(size_t keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  static VerificationState StateOf(const MapperRecord& record);
  void Count(const VerifiedMapper& mapper, const char* result) const;

  const LiveVerifierOptions options_;
  const int64_t period_;
  const Measure measure_;
  Metrics* const metrics_;
  Mutex mutex_;
  absl::flat_hash_map<std::string, MapperRecord> mappers_ ABSL_GUARDED_BY(mutex_);
  std::list<PendingSample> pending_ ABSL_GUARDED_BY(mutex_);  // oldest first
  WorkQueue worker_{WorkQueue::Options{}};  // last: its queued tasks use the fields above
};

}  // namespace kvt
