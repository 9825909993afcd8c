// The published-prefix digest: a counting Bloom filter over the first block of every stored
// prefix, in a POSIX shared-memory object that kvtd writes and same-host engines map read-only,
// so a prompt that no stored prefix can match is known to miss without a LookupPrefix call.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/mutex.h"
#include "prefix_cache/chain_hash.h"

namespace kvt {

// The shared object's layout, fixed (readers in other languages mirror it; all little-endian):
//   [0, 8)    magic "kvtdgst1"
//   [8, 12)   u32 hashes: counters per key (kPrefixDigestHashes)
//   [12, 16)  u32 block_tokens: tokens of the first block a key covers
//   [16, 24)  u64 slots: counters, a power of two
//   [24, 32)  u64 instance: random, one per digest (a restarted kvtd makes a new one)
//   [32, 40)  u64 heartbeat: Unix time in ms, rewritten every second while kvtd lives; 0 once
//             the digest is destroyed
//   [40, 48)  u64 keys: additions minus removals (informational)
//   [48, 64)  reserved, zero
//   [64, 64 + 2 * slots)  u16 counters; 0xffff is sticky (never decremented)
// A key is the chain hash (chain_hash.h) of the first block under the seed kPrefixDigestSeed,
// whatever model stored it; its counters are the slots (u32le of key bytes [4i, 4i + 4)) &
// (slots - 1) for i < hashes. A key can be stored only if all its counters are non-zero, so "no"
// is exact while the heartbeat is fresh; "maybe" is a false positive at a rate set by slots.
inline constexpr char kPrefixDigestMagic[] = "kvtdgst1";
inline constexpr char kPrefixDigestSeed[] = "kvt.prefix_digest";
inline constexpr int kPrefixDigestHashes = 3;
inline constexpr int64_t kPrefixDigestHeaderBytes = 64;
inline constexpr int64_t kPrefixDigestMinSlots = 1 << 10;
inline constexpr int64_t kPrefixDigestMaxSlots = int64_t{1} << 28;

struct PrefixDigestOptions {
  // shm_open name ("/name"); empty: "/kvt-prefix-digest-<pid>-<16 random hex digits>".
  std::string shm_name;
  int64_t slots = 1 << 20;  // a power of two in [kPrefixDigestMinSlots, kPrefixDigestMaxSlots]
  int block_tokens = 16;
  mode_t mode = 0644;  // readers open it read-only
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // Create first unlinks digests of kvtds that died without unlinking theirs (killed): objects
  // named kvt-prefix-digest-* in shm_dir whose heartbeat is 0 or older than this. 0: never.
  absl::Duration remove_stale_after = absl::Seconds(60);
  std::string shm_dir = "/dev/shm";  // where shm_open's objects are files (Linux)
};

class PrefixDigest {
 public:
  // Creates the object exclusively (an existing name is ALREADY_EXISTS) and starts the
  // heartbeat. INVALID_ARGUMENT naming the option for bad slots / block_tokens / name.
  static absl::StatusOr<std::unique_ptr<PrefixDigest>> Create(PrefixDigestOptions options);
  // Stops the heartbeat (writing 0 there), unmaps and unlinks the object; a reader's mapping
  // stays valid and shows the zero.
  ~PrefixDigest();
  PrefixDigest(const PrefixDigest&) = delete;
  PrefixDigest& operator=(const PrefixDigest&) = delete;

  // Unlinks the stale digests in `shm_dir` (see remove_stale_after); returns how many.
  static int RemoveStale(const std::string& shm_dir, absl::Duration older_than);

  // The key of `tokens`' first block; nullopt when shorter than one block.
  static std::optional<BlockHash> KeyOf(absl::Span<const uint32_t> tokens, int block_tokens);

  void Add(const BlockHash& key) ABSL_LOCKS_EXCLUDED(mutex_);
  // Each Remove undoes one Add of the same key.
  void Remove(const BlockHash& key) ABSL_LOCKS_EXCLUDED(mutex_);
  // What a reader concludes: false only if no key added and not removed is `key`.
  bool MightHold(const BlockHash& key) const;

  const std::string& shm_name() const { return options_.shm_name; }
  int64_t slots() const { return options_.slots; }
  int block_tokens() const { return options_.block_tokens; }
  uint64_t instance() const { return instance_; }
  int stale_removed() const { return stale_removed_; }  // by Create
  int64_t keys() const;
  // Counters that are not zero. A prompt's first block that no stored key has reads "maybe"
  // (costing the engine a LookupPrefix) with probability (occupied / slots) ^ hashes.
  int64_t occupied_slots() const ABSL_LOCKS_EXCLUDED(mutex_);
  double false_positive_rate() const ABSL_LOCKS_EXCLUDED(mutex_);

 private:
  PrefixDigest(PrefixDigestOptions options, uint8_t* base, uint64_t instance);
  uint16_t* Counters() const;
  void Count(const BlockHash& key, int delta) ABSL_LOCKS_EXCLUDED(mutex_);
  void Positions(const BlockHash& key, uint64_t out[kPrefixDigestHashes]) const;
  void Beat();
  void HeartbeatLoop() ABSL_LOCKS_EXCLUDED(stop_mutex_);

  const PrefixDigestOptions options_;
  uint8_t* const base_;  // the mapping, kPrefixDigestHeaderBytes + 2 * slots bytes
  const uint64_t instance_;
  int stale_removed_ = 0;
  mutable Mutex mutex_;  // serialises writers (readers are lock-free, in other processes)
  int64_t occupied_ ABSL_GUARDED_BY(mutex_) = 0;
  Mutex stop_mutex_;
  CondVar stop_cv_;
  bool stop_ ABSL_GUARDED_BY(stop_mutex_) = false;
  std::thread heartbeat_;
};

}  // namespace kvt
