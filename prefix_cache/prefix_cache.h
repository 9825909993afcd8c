// The prefix cache: host memory holding KV caches that serving engines publish under (model,
// token ids), found again by longest whole-block prefix, within a byte budget (LRU) and a TTL,
// and leased single-use to the translation that reads them.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/host_buffer.h"
#include "common/mutex.h"
#include "kernels/backend.h"
#include "kernels/types.h"
#include "prefix_cache/chain_hash.h"
#include "prefix_cache/prefix_digest.h"

namespace kvt {

class PrefixCache;

struct PrefixCacheOptions {
  int64_t max_bytes = 0;                // host budget of all entries (committed + reserved)
  absl::Duration ttl = absl::Hours(1);  // default and cap for an entry's lifetime
  int block_tokens = 16;
  absl::Duration lease_duration = absl::Seconds(30);  // how long a lookup's lease stays valid
  std::function<absl::Time()> now;  // clock; default absl::Now (tests inject a fake)
  // Called once per entry removed (reasons "lru", "ttl", "subsumed", "admin"), after the cache's
  // lock is released, so it may do anything except block on the caller's own locks.
  std::function<void(absl::string_view model, absl::string_view reason, int64_t bytes)> on_evict;
  // Allocates entry buffers; default HostBuffer::Allocate. A CUDA build passes pinned memory so
  // that uploads of a leased prefix to the GPU run at full speed.
  HostAllocator allocator;
  // Optional; must outlive the cache. Holds the first block of every committed entry while it
  // is stored, so engines can tell a certain miss without asking (prefix_digest.h).
  PrefixDigest* digest = nullptr;
};

// One model's cache shape. Every entry of a model (committed or reserved) has the same shape,
// dtype included: one model has one cache format, and a mismatch means a misconfigured engine.
struct EntryShape {
  int num_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kFP16;
};

// One published sequence. Immutable once committed; shared so a lease keeps its data alive even
// after the cache dropped it.
class PrefixEntry {
 public:
  const std::string& id() const { return id_; }
  const std::string& model() const { return model_; }
  // The stored tokens: whole blocks only.
  const std::vector<uint32_t>& tokens() const { return tokens_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  const EntryShape& shape() const { return shape_; }
  // Chain hash of each stored block (chain_hash.h).
  const std::vector<BlockHash>& block_hashes() const { return hashes_; }
  // Bytes accounted against prefix_cache.max_bytes: K and V of every layer.
  int64_t bytes() const { return bytes_; }
  absl::Time created() const { return created_; }

  // Layer `layer`'s K or V, NHD [num_tokens, num_kv_heads, head_dim] of dtype.
  const void* k(int layer) const { return buffer_.data() + Offset(layer, 0); }
  const void* v(int layer) const { return buffer_.data() + Offset(layer, 1); }
  // The first `prefix_tokens` tokens (clamped to [0, num_tokens()]): NHD keeps any prefix of a
  // layer contiguous, so this is just the layer bases with a shorter token count.
  CacheView View(int64_t prefix_tokens) const;

 private:
  friend class PrefixCache;
  friend class PendingEntry;
  friend class PrefixLease;
  PrefixEntry() = default;
  size_t Offset(int layer, int kind) const { return (2 * layer + kind) * segment_stride_; }

  std::string id_;
  std::string model_;
  std::vector<uint32_t> tokens_;
  EntryShape shape_;
  std::vector<BlockHash> hashes_;
  HostBuffer buffer_;
  int64_t bytes_ = 0;
  size_t segment_stride_ = 0;  // bytes from one layer's K to its V (64-byte aligned)
  absl::Time created_;
  // Untaken leases plus live PrefixLease objects. Raised only under the cache's lock, lowered
  // by a PrefixLease's destructor without it (an entry only ever becomes more evictable that
  // way), so a lease may outlive the cache.
  mutable std::atomic<int> pins_{0};
};

// A reservation made by PrefixCache::Reserve: the caller writes the cache into it, then Commits.
// Destroying it uncommitted returns the reservation. Must not outlive the cache.
class PendingEntry {
 public:
  ~PendingEntry();
  PendingEntry(const PendingEntry&) = delete;
  PendingEntry& operator=(const PendingEntry&) = delete;

  // Tokens this entry will hold: the published tokens cut down to whole blocks. 0 means the
  // sequence was shorter than one block: nothing to copy, and Commit stores nothing.
  int64_t stored_tokens() const { return entry_->num_tokens(); }
  int64_t bytes() const { return entry_->bytes(); }
  const EntryShape& shape() const { return entry_->shape_; }
  // Layer `layer`'s K / V to fill: NHD [stored_tokens, num_kv_heads, head_dim] of dtype.
  void* k(int layer) { return entry_->buffer_.data() + entry_->Offset(layer, 0); }
  void* v(int layer) { return entry_->buffer_.data() + entry_->Offset(layer, 1); }
  MutableCacheView MutableView();
  // Entries evicted (LRU) to make room for this reservation.
  int evicted_entries() const { return evicted_entries_; }

 private:
  friend class PrefixCache;
  PendingEntry() = default;

  PrefixCache* cache_ = nullptr;
  std::shared_ptr<PrefixEntry> entry_;
  absl::Duration ttl_;  // effective: already defaulted and capped
  int evicted_entries_ = 0;
  bool reserved_ = false;  // holds bytes and a model reference until committed or dropped
};

struct PublishResult {
  std::string entry_id;  // the entry now holding the sequence (empty when stored_tokens is 0)
  int64_t stored_tokens = 0;
  // Leading blocks of this sequence the model already held, and the rest.
  int64_t reused_blocks = 0;
  int64_t new_blocks = 0;
  int evicted_entries = 0;   // LRU evictions made for the reservation
  int subsumed_entries = 0;  // shorter turns of this sequence dropped
  // True when an existing entry already held the whole sequence: the new copy was dropped and
  // that entry refreshed (last use, expiry) instead.
  bool deduplicated = false;
  int64_t entry_bytes = 0;
  // The entry now holding the sequence (null when stored_tokens is 0), e.g. for live
  // verification to read the published cache after the commit.
  std::shared_ptr<const PrefixEntry> entry;
};

struct PrefixMatch {
  std::shared_ptr<const PrefixEntry> entry;
  int64_t tokens = 0;  // tokens [0, tokens) of the request, a multiple of block_tokens
};

// What a lookup checked before it issued a lease; the lease is good for exactly this (the
// source model is the entry's).
struct LeaseBinding {
  std::string target_model;
  std::string mapper_id;
  bool gate_passed = false;  // the quality gate's verdict for this mapper and prefix
  bool forced = false;       // issued under REUSE_POLICY_FORCE although the gate refused
};

// A taken lease: keeps its entry pinned (never evicted) until destroyed.
class PrefixLease {
 public:
  PrefixLease() = default;
  PrefixLease(PrefixLease&& other) noexcept;
  PrefixLease& operator=(PrefixLease&& other) noexcept;
  ~PrefixLease();

  const std::string& id() const { return id_; }
  const PrefixMatch& match() const { return match_; }
  const LeaseBinding& binding() const { return binding_; }
  CacheView View() const { return match_.entry->View(match_.tokens); }

 private:
  friend class PrefixCache;
  PrefixLease(std::string id, PrefixMatch match, LeaseBinding binding)
      : id_(std::move(id)), match_(std::move(match)), binding_(std::move(binding)) {}
  void Unpin();

  std::string id_;
  PrefixMatch match_;
  LeaseBinding binding_;
};

struct EntryInfo {
  std::string id;
  std::string model;
  int64_t num_tokens = 0;
  DType dtype = DType::kFP16;
  int64_t bytes = 0;
  absl::Time created, last_used, expires;
  int64_t hits = 0;
  int leases = 0;                // untaken leases plus translations holding it now
  std::string first_block_hash;  // hex
};

struct EvictResult {
  int evicted_entries = 0;
  int64_t evicted_bytes = 0;
  int skipped_leased = 0;  // matched but leased: left to age out
};

struct PrefixCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions_lru = 0;
  int64_t evictions_ttl = 0;
  int64_t evictions_subsumed = 0;
  int64_t evictions_admin = 0;
  int64_t publishes = 0;  // commits that stored tokens, deduplicated ones included
  int64_t deduplicated = 0;
  int64_t leases_issued = 0;
  int64_t leases_taken = 0;
  int64_t leases_expired = 0;
  int64_t entries = 0;
  int64_t bytes_held = 0;
  int64_t bytes_reserved = 0;
};

class PrefixCache {
 public:
  // INVALID_ARGUMENT naming the option unless block_tokens, ttl and lease_duration are > 0 and
  // max_bytes >= 0.
  static absl::StatusOr<std::unique_ptr<PrefixCache>> Create(PrefixCacheOptions options);
  explicit PrefixCache(PrefixCacheOptions options);  // assumes valid options
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // Phase one of a publish: reserves room for the whole blocks of `tokens`, evicting least
  // recently used unleased entries if needed. `ttl` 0 = options.ttl; larger is capped to it.
  // Fewer tokens than one block: OK with stored_tokens() == 0 (nothing to copy or store).
  // INVALID_ARGUMENT naming the field for a bad shape or one differing from the model's other
  // entries; RESOURCE_EXHAUSTED naming prefix_cache.max_bytes when even evicting every unleased
  // entry would not make room.
  absl::StatusOr<std::unique_ptr<PendingEntry>> Reserve(absl::string_view model,
                                                        absl::Span<const uint32_t> tokens,
                                                        const EntryShape& shape,
                                                        absl::Duration ttl = absl::ZeroDuration())
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Phase two: makes the filled entry visible. Entries of the model whose whole sequence is a
  // prefix of this one (earlier turns of the conversation) are dropped unless leased; if an
  // entry already holds this whole sequence the new copy is dropped and that entry refreshed.
  absl::StatusOr<PublishResult> Commit(std::unique_ptr<PendingEntry> pending)
      ABSL_LOCKS_EXCLUDED(mutex_);

  // The longest whole-block prefix of `tokens`, at most `max_tokens` (rounded down to blocks),
  // held for `model` and not expired; every token verified against the entry. Counts a hit or a
  // miss and touches the entry's LRU position.
  std::optional<PrefixMatch> Longest(absl::string_view model, absl::Span<const uint32_t> tokens,
                                     int64_t max_tokens = std::numeric_limits<int64_t>::max())
      ABSL_LOCKS_EXCLUDED(mutex_);

  // Pins match.entry for one Take within options.lease_duration; returns an unguessable id
  // (128 random bits, hex). An empty string for a match without an entry. The taken lease
  // carries `binding`, for its user to check against.
  std::string Lease(const PrefixMatch& match, LeaseBinding binding = {})
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Single use. NOT_FOUND "lease ... unknown or already used"; FAILED_PRECONDITION naming the
  // lease and its age once it has expired.
  absl::StatusOr<PrefixLease> Take(absl::string_view lease_id) ABSL_LOCKS_EXCLUDED(mutex_);

  // Models with at least one entry now, sorted.
  std::vector<std::string> Models() ABSL_LOCKS_EXCLUDED(mutex_);
  // Entries of `model` (empty = all), oldest first.
  std::vector<EntryInfo> List(absl::string_view model) ABSL_LOCKS_EXCLUDED(mutex_);
  // By entry id (when given, and only if it belongs to `model` when that is given too); else
  // every entry of `model`; both empty = every entry. Leased entries are never evicted.
  EvictResult Evict(absl::string_view model, absl::string_view entry_id)
      ABSL_LOCKS_EXCLUDED(mutex_);
  // Removes expired unleased entries and expired leases now (every call also does it lazily).
  void SweepExpired() ABSL_LOCKS_EXCLUDED(mutex_);

  int64_t bytes_held() const ABSL_LOCKS_EXCLUDED(mutex_);  // committed entries
  int64_t max_bytes() const { return options_.max_bytes; }
  int block_tokens() const { return options_.block_tokens; }
  const PrefixDigest* digest() const { return options_.digest; }
  absl::Duration lease_duration() const { return options_.lease_duration; }
  PrefixCacheStats stats() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  friend class PendingEntry;
  struct Slot;
  struct LeaseRecord;
  struct Removed {
    std::shared_ptr<const PrefixEntry> entry;
    const char* reason;
  };
  // A model's shape lives as long as the model has entries or reservations.
  struct ModelState {
    EntryShape shape;
    int64_t entries = 0;
    int64_t reservations = 0;
  };

  absl::Time Now() const { return options_.now(); }
  absl::Status CheckShape(absl::string_view model, const EntryShape& shape)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::Status MakeRoom(int64_t bytes, std::vector<Removed>* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void ReleaseReservation(const PrefixEntry& entry);
  void UnreserveLocked(const PrefixEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void ForgetModelIfUnused(const std::string& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The verified longest match among live entries of `model` for a sequence with `hashes`.
  std::pair<Slot*, int64_t> BestMatchLocked(absl::string_view model,
                                            absl::Span<const uint32_t> tokens,
                                            const std::vector<BlockHash>& hashes, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  Slot* Insert(std::shared_ptr<PrefixEntry> entry, absl::Time expires, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  int DropSubsumed(const PrefixEntry& entry, std::vector<Removed>* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Remove(Slot* slot, const char* reason, std::vector<Removed>* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Adds or removes the entry's first block in options_.digest (if any).
  void UpdateDigest(const PrefixEntry& entry, bool add) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Touch(Slot* slot, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void SetExpiry(Slot* slot, absl::Time expires) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void SweepLocked(absl::Time now, std::vector<Removed>* removed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void SweepLeasesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  std::string NewLeaseId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Frees removed entries' memory and calls on_evict, outside the lock.
  void Notify(std::vector<Removed> removed);

  const PrefixCacheOptions options_;
  // kvt::Mutex, not absl::Mutex: Debian's absl is not TSan-instrumented (common/mutex.h).
  mutable Mutex mutex_;
  uint64_t next_id_ ABSL_GUARDED_BY(mutex_) = 1;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mutex_);
  // Chain hash of block j -> entries holding it at block j. The chain is seeded with the model
  // name, so the hash alone keys (model, prefix); candidates are still checked by model and
  // token by token.
  absl::flat_hash_map<BlockHash, std::vector<uint64_t>, BlockHashHash> index_
      ABSL_GUARDED_BY(mutex_);
  std::list<uint64_t> lru_ ABSL_GUARDED_BY(mutex_);  // most recently used first
  std::set<std::pair<absl::Time, uint64_t>> expiry_ ABSL_GUARDED_BY(mutex_);
  absl::flat_hash_map<std::string, ModelState> models_ ABSL_GUARDED_BY(mutex_);
  absl::flat_hash_map<std::string, std::unique_ptr<LeaseRecord>> leases_ ABSL_GUARDED_BY(mutex_);
  // (time of the lease's next state change, lease id): expiry, then forgetting it.
  std::set<std::pair<absl::Time, std::string>> lease_timeline_ ABSL_GUARDED_BY(mutex_);
  absl::BitGen bitgen_ ABSL_GUARDED_BY(mutex_);  // lease ids only if RAND_bytes fails
  int64_t bytes_held_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t bytes_reserved_ ABSL_GUARDED_BY(mutex_) = 0;
  PrefixCacheStats stats_ ABSL_GUARDED_BY(mutex_);
};

}  // namespace kvt
