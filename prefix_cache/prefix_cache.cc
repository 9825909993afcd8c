#include "prefix_cache/prefix_cache.h"

#include <openssl/rand.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/echo.h"

namespace kvt {
namespace {

constexpr size_t kSegmentAlignment = 64;  // cache lines and AVX-512 loads

PrefixCacheOptions WithDefaults(PrefixCacheOptions options) {
  if (!options.now) options.now = [] { return absl::Now(); };
  if (!options.allocator) {
    options.allocator = [](size_t size) { return HostBuffer::Allocate(size, kSegmentAlignment); };
  }
  return options;
}

std::string Hex(const uint8_t* bytes, size_t size) {
  static const char kHex[] = "0123456789abcdef";
  std::string hex(2 * size, '0');
  for (size_t i = 0; i < size; ++i) {
    hex[2 * i] = kHex[bytes[i] >> 4];
    hex[2 * i + 1] = kHex[bytes[i] & 15];
  }
  return hex;
}

bool SamePrefix(const std::vector<uint32_t>& held, absl::Span<const uint32_t> tokens,
                int64_t count) {
  return static_cast<int64_t>(held.size()) >= count &&
         static_cast<int64_t>(tokens.size()) >= count &&
         std::equal(held.begin(), held.begin() + count, tokens.begin());
}

absl::Status CheckShapeFields(const EntryShape& shape) {
  auto positive = [](const char* field, int value) {
    return value > 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError(
                           absl::StrCat("shape.", field, "=", value, " must be > 0"));
  };
  absl::Status status = positive("num_layers", shape.num_layers);
  if (status.ok()) status = positive("num_kv_heads", shape.num_kv_heads);
  if (status.ok()) status = positive("head_dim", shape.head_dim);
  return status;
}

}  // namespace

// ---------------------------------------------------------------- entries, pending, leases

CacheView PrefixEntry::View(int64_t prefix_tokens) const {
  CacheView view;
  view.dtype = shape_.dtype;
  view.layout = Layout::kNHD;
  view.num_kv_heads = shape_.num_kv_heads;
  view.head_dim = shape_.head_dim;
  view.num_tokens = std::clamp<int64_t>(prefix_tokens, 0, num_tokens());
  for (int layer = 0; layer < shape_.num_layers; ++layer) {
    view.k.push_back(k(layer));
    view.v.push_back(v(layer));
  }
  return view;
}

PendingEntry::~PendingEntry() {
  if (reserved_) cache_->ReleaseReservation(*entry_);
}

MutableCacheView PendingEntry::MutableView() {
  MutableCacheView view;
  view.dtype = entry_->shape_.dtype;
  view.layout = Layout::kNHD;
  view.num_kv_heads = entry_->shape_.num_kv_heads;
  view.head_dim = entry_->shape_.head_dim;
  view.num_tokens = stored_tokens();
  if (stored_tokens() == 0) return view;  // nothing allocated
  for (int layer = 0; layer < entry_->shape_.num_layers; ++layer) {
    view.k.push_back(k(layer));
    view.v.push_back(v(layer));
  }
  return view;
}

PrefixLease::PrefixLease(PrefixLease&& other) noexcept
    : id_(std::move(other.id_)),
      match_(std::move(other.match_)),
      binding_(std::move(other.binding_)) {
  other.match_.entry = nullptr;
}

PrefixLease& PrefixLease::operator=(PrefixLease&& other) noexcept {
  if (this != &other) {
    Unpin();
    id_ = std::move(other.id_);
    match_ = std::move(other.match_);
    binding_ = std::move(other.binding_);
    other.match_.entry = nullptr;
  }
  return *this;
}

PrefixLease::~PrefixLease() { Unpin(); }

void PrefixLease::Unpin() {
  if (match_.entry != nullptr) match_.entry->pins_.fetch_sub(1, std::memory_order_acq_rel);
  match_.entry = nullptr;
}

// ---------------------------------------------------------------- cache bookkeeping

struct PrefixCache::Slot {
  uint64_t seq = 0;
  std::shared_ptr<PrefixEntry> entry;
  absl::Time last_used;
  absl::Time expires;
  int64_t hits = 0;
  std::list<uint64_t>::iterator lru;

  bool pinned() const { return entry->pins_.load(std::memory_order_acquire) > 0; }
  bool live(absl::Time now) const { return now < expires; }
};

struct PrefixCache::LeaseRecord {
  // Null once expired: the record stays a while as a tombstone so a late Take says "expired"
  // (with the age) rather than "unknown".
  std::shared_ptr<const PrefixEntry> entry;
  int64_t tokens = 0;
  LeaseBinding binding;
  absl::Time issued;
  absl::Time expires;
};

absl::StatusOr<std::unique_ptr<PrefixCache>> PrefixCache::Create(PrefixCacheOptions options) {
  if (options.block_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache.block_tokens=", options.block_tokens, " must be > 0"));
  }
  if (options.max_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache.max_bytes=", options.max_bytes, " must be >= 0"));
  }
  if (options.ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache.ttl=", absl::FormatDuration(options.ttl), " must be > 0"));
  }
  if (options.lease_duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache.lease_duration=", absl::FormatDuration(options.lease_duration),
                     " must be > 0"));
  }
  if (options.digest != nullptr && options.digest->block_tokens() != options.block_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache.block_tokens=", options.block_tokens, " differs from the "
                     "digest's block_tokens=", options.digest->block_tokens()));
  }
  return std::make_unique<PrefixCache>(std::move(options));
}

PrefixCache::PrefixCache(PrefixCacheOptions options) : options_(WithDefaults(std::move(options))) {}

PrefixCache::~PrefixCache() = default;

absl::Status PrefixCache::CheckShape(absl::string_view model, const EntryShape& shape) {
  auto it = models_.find(model);
  if (it == models_.end()) return absl::OkStatus();
  const EntryShape& held = it->second.shape;
  auto differs = [&](const char* field, auto value, auto expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, "=", value, " differs from ", expected, ", the ", field, " model '",
                     model, "' is held with (every entry of one model has the same shape)"));
  };
  if (shape.num_layers != held.num_layers) {
    return differs("shape.num_layers", shape.num_layers, held.num_layers);
  }
  if (shape.num_kv_heads != held.num_kv_heads) {
    return differs("shape.num_kv_heads", shape.num_kv_heads, held.num_kv_heads);
  }
  if (shape.head_dim != held.head_dim) {
    return differs("shape.head_dim", shape.head_dim, held.head_dim);
  }
  if (shape.dtype != held.dtype) {
    return differs("dtype", DTypeName(shape.dtype), DTypeName(held.dtype));
  }
  return absl::OkStatus();
}

absl::Status PrefixCache::MakeRoom(int64_t bytes, std::vector<Removed>* removed) {
  const int64_t need = bytes_held_ + bytes_reserved_ + bytes - options_.max_bytes;
  if (need <= 0) return absl::OkStatus();
  // Pick victims first and evict only if they suffice: a publish that fails anyway must not
  // empty the cache on its way out.
  std::vector<Slot*> victims;
  int64_t freed = 0;
  for (auto it = lru_.rbegin(); it != lru_.rend() && freed < need; ++it) {
    Slot* slot = slots_.at(*it).get();
    if (slot->pinned()) continue;
    victims.push_back(slot);
    freed += slot->entry->bytes();
  }
  if (freed < need) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prefix_cache.max_bytes=", options_.max_bytes, " cannot fit an entry of ",
                     bytes, " bytes: ", bytes_held_, " bytes held (", bytes_held_ - freed,
                     " of them leased or otherwise unevictable) and ", bytes_reserved_,
                     " reserved by publishes in progress; retry later"));
  }
  for (Slot* slot : victims) Remove(slot, "lru", removed);
  return absl::OkStatus();
}

void PrefixCache::ReleaseReservation(const PrefixEntry& entry) {
  MutexLock lock(&mutex_);
  UnreserveLocked(entry);
}

void PrefixCache::UnreserveLocked(const PrefixEntry& entry) {
  bytes_reserved_ -= entry.bytes();
  auto it = models_.find(entry.model());
  if (it != models_.end()) --it->second.reservations;
  ForgetModelIfUnused(entry.model());
}

void PrefixCache::ForgetModelIfUnused(const std::string& model) {
  auto it = models_.find(model);
  if (it != models_.end() && it->second.entries == 0 && it->second.reservations == 0) {
    models_.erase(it);
  }
}

std::pair<PrefixCache::Slot*, int64_t> PrefixCache::BestMatchLocked(
    absl::string_view model, absl::Span<const uint32_t> tokens,
    const std::vector<BlockHash>& hashes, absl::Time now) {
  auto usable = [&](uint64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    const Slot& slot = *slots_.at(seq);
    return slot.live(now) && slot.entry->model() == model;
  };
  // Deepest block any live entry of the model holds: O(blocks) lookups. A chain hash at block j
  // implies the whole prefix up to j (short of a 2^-128 collision, which verification catches).
  int64_t deepest = -1;
  for (size_t j = 0; j < hashes.size(); ++j) {
    auto it = index_.find(hashes[j]);
    if (it == index_.end() || std::none_of(it->second.begin(), it->second.end(), usable)) break;
    deepest = static_cast<int64_t>(j);
  }
  for (int64_t j = deepest; j >= 0; --j) {
    const int64_t count = (j + 1) * options_.block_tokens;
    Slot* best = nullptr;
    for (uint64_t seq : index_.at(hashes[j])) {
      Slot* slot = slots_.at(seq).get();
      // Newest first among equals: it lives longest and is the freshest publish.
      if (!usable(seq) || (best != nullptr && best->seq > seq)) continue;
      if (SamePrefix(slot->entry->tokens(), tokens, count)) best = slot;
    }
    if (best != nullptr) return {best, j + 1};
  }
  return {nullptr, 0};
}

PrefixCache::Slot* PrefixCache::Insert(std::shared_ptr<PrefixEntry> entry, absl::Time expires,
                                       absl::Time now) {
  auto slot = std::make_unique<Slot>();
  slot->seq = next_id_++;
  entry->id_ = absl::StrCat(slot->seq);
  entry->created_ = now;
  slot->entry = std::move(entry);
  slot->last_used = now;
  slot->expires = expires;
  lru_.push_front(slot->seq);
  slot->lru = lru_.begin();
  expiry_.insert({expires, slot->seq});
  for (const BlockHash& hash : slot->entry->block_hashes()) index_[hash].push_back(slot->seq);
  UpdateDigest(*slot->entry, /*add=*/true);
  bytes_held_ += slot->entry->bytes();
  ++models_[slot->entry->model()].entries;
  Slot* raw = slot.get();
  slots_.emplace(raw->seq, std::move(slot));
  return raw;
}

int PrefixCache::DropSubsumed(const PrefixEntry& entry, std::vector<Removed>* removed) {
  int dropped = 0;
  const std::vector<BlockHash>& hashes = entry.block_hashes();
  for (size_t j = 0; j < hashes.size(); ++j) {
    const int64_t count = static_cast<int64_t>(j + 1) * options_.block_tokens;
    const std::vector<uint64_t> candidates = index_.at(hashes[j]);  // copy: Remove edits it
    for (uint64_t seq : candidates) {
      Slot* slot = slots_.at(seq).get();
      const PrefixEntry& other = *slot->entry;
      if (&other == &entry || other.num_tokens() != count || other.model() != entry.model() ||
          !SamePrefix(entry.tokens(), other.tokens(), count)) {
        continue;
      }
      // A leased earlier turn stays until its lease ends and it ages out (LRU or TTL).
      if (slot->pinned()) continue;
      Remove(slot, "subsumed", removed);
      ++dropped;
    }
  }
  return dropped;
}

void PrefixCache::Remove(Slot* slot, const char* reason, std::vector<Removed>* removed) {
  const uint64_t seq = slot->seq;
  for (const BlockHash& hash : slot->entry->block_hashes()) {
    auto it = index_.find(hash);
    if (it == index_.end()) continue;
    std::vector<uint64_t>& seqs = it->second;
    seqs.erase(std::remove(seqs.begin(), seqs.end(), seq), seqs.end());
    if (seqs.empty()) index_.erase(it);
  }
  UpdateDigest(*slot->entry, /*add=*/false);
  lru_.erase(slot->lru);
  expiry_.erase({slot->expires, seq});
  bytes_held_ -= slot->entry->bytes();
  const absl::string_view why = reason;
  if (why == "lru") ++stats_.evictions_lru;
  if (why == "ttl") ++stats_.evictions_ttl;
  if (why == "subsumed") ++stats_.evictions_subsumed;
  if (why == "admin") ++stats_.evictions_admin;
  auto model = models_.find(slot->entry->model());
  if (model != models_.end()) --model->second.entries;
  ForgetModelIfUnused(slot->entry->model());
  removed->push_back({std::move(slot->entry), reason});
  slots_.erase(seq);
}

void PrefixCache::UpdateDigest(const PrefixEntry& entry, bool add) {
  if (options_.digest == nullptr) return;
  const std::optional<BlockHash> key =
      PrefixDigest::KeyOf(entry.tokens(), options_.digest->block_tokens());
  if (!key.has_value()) return;
  if (add) {
    options_.digest->Add(*key);
  } else {
    options_.digest->Remove(*key);
  }
}

void PrefixCache::Touch(Slot* slot, absl::Time now) {
  slot->last_used = now;
  lru_.splice(lru_.begin(), lru_, slot->lru);
}

void PrefixCache::SetExpiry(Slot* slot, absl::Time expires) {
  expiry_.erase({slot->expires, slot->seq});
  slot->expires = expires;
  expiry_.insert({expires, slot->seq});
}

void PrefixCache::SweepLeasesLocked(absl::Time now) {
  while (!lease_timeline_.empty() && lease_timeline_.begin()->first <= now) {
    const std::string id = lease_timeline_.begin()->second;
    lease_timeline_.erase(lease_timeline_.begin());
    auto it = leases_.find(id);
    if (it == leases_.end()) continue;
    LeaseRecord& record = *it->second;
    if (record.entry == nullptr) {  // tombstone's grace is over
      leases_.erase(it);
      continue;
    }
    record.entry->pins_.fetch_sub(1, std::memory_order_acq_rel);
    record.entry = nullptr;
    ++stats_.leases_expired;
    lease_timeline_.insert({record.expires + options_.lease_duration, id});
  }
}

void PrefixCache::SweepLocked(absl::Time now, std::vector<Removed>* removed) {
  SweepLeasesLocked(now);
  for (auto it = expiry_.begin(); it != expiry_.end() && it->first <= now;) {
    Slot* slot = slots_.at(it->second).get();
    ++it;  // Remove erases the current element
    // An expired entry still leased is no longer found, and goes once the lease ends.
    if (!slot->pinned()) Remove(slot, "ttl", removed);
  }
}

void PrefixCache::Notify(std::vector<Removed> removed) {
  if (options_.on_evict) {
    for (const Removed& r : removed) {
      options_.on_evict(r.entry->model(), r.reason, r.entry->bytes());
    }
  }
  // `removed` goes out of scope here, outside the lock: freeing GBs must not stall lookups.
}

std::string PrefixCache::NewLeaseId() {
  uint8_t bytes[16];
  std::string id;
  do {
    if (RAND_bytes(bytes, sizeof(bytes)) != 1) {
      // OpenSSL's DRBG failing is near impossible; BitGen is OS-seeded and still unpredictable
      // enough that a guessed id is not a practical attack.
      for (uint8_t& b : bytes) b = absl::Uniform<uint8_t>(bitgen_);
    }
    id = Hex(bytes, sizeof(bytes));
  } while (leases_.contains(id));
  return id;
}

// ---------------------------------------------------------------- public API

absl::StatusOr<std::unique_ptr<PendingEntry>> PrefixCache::Reserve(
    absl::string_view model, absl::Span<const uint32_t> tokens, const EntryShape& shape,
    absl::Duration ttl) {
  if (model.empty()) return absl::InvalidArgumentError("model is empty");
  if (absl::Status status = CheckShapeFields(shape); !status.ok()) return status;
  if (ttl < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ttl=", absl::FormatDuration(ttl), " must be >= 0 (0 = prefix_cache.ttl)"));
  }
  const int64_t block = options_.block_tokens;
  const int64_t stored = static_cast<int64_t>(tokens.size()) / block * block;
  // Element counts fit easily; bytes are computed in 128 bits so absurd shapes cannot wrap.
  const __int128 segment = static_cast<__int128>(stored) * shape.num_kv_heads * shape.head_dim *
                           static_cast<int64_t>(DTypeSize(shape.dtype));
  const __int128 stride = (segment + kSegmentAlignment - 1) / kSegmentAlignment * kSegmentAlignment;
  const __int128 total = 2 * stride * shape.num_layers;
  if (total > options_.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "an entry of ", stored, " tokens x ", shape.num_layers, " layers x ", shape.num_kv_heads,
        " kv heads x ", shape.head_dim, " ", DTypeName(shape.dtype), " is ",
        static_cast<int64_t>(std::min<__int128>(total, std::numeric_limits<int64_t>::max())),
        " bytes, more than prefix_cache.max_bytes=", options_.max_bytes));
  }

  auto entry = std::shared_ptr<PrefixEntry>(new PrefixEntry());
  entry->model_ = std::string(model);
  entry->tokens_.assign(tokens.begin(), tokens.begin() + stored);
  entry->shape_ = shape;
  entry->bytes_ = static_cast<int64_t>(total);
  entry->segment_stride_ = static_cast<size_t>(stride);
  entry->hashes_ = ChainHashes(model, entry->tokens_, options_.block_tokens);

  auto pending = std::unique_ptr<PendingEntry>(new PendingEntry());
  pending->cache_ = this;
  pending->ttl_ = ttl == absl::ZeroDuration() ? options_.ttl : std::min(ttl, options_.ttl);
  std::vector<Removed> removed;
  absl::Status status;
  {
    MutexLock lock(&mutex_);
    SweepLocked(Now(), &removed);
    const size_t swept = removed.size();
    status = CheckShape(model, shape);
    if (status.ok() && stored > 0) status = MakeRoom(entry->bytes_, &removed);
    if (status.ok() && stored > 0) {
      bytes_reserved_ += entry->bytes_;
      ModelState& state = models_[entry->model_];
      if (state.entries == 0 && state.reservations == 0) state.shape = shape;
      ++state.reservations;
      pending->reserved_ = true;
    }
    pending->evicted_entries_ = static_cast<int>(removed.size() - swept);
  }
  pending->entry_ = std::move(entry);
  Notify(std::move(removed));
  if (!status.ok()) return status;
  if (stored == 0) return pending;
  // Allocate outside the lock: a multi-GB allocation must not stall every lookup.
  absl::StatusOr<HostBuffer> buffer = options_.allocator(static_cast<size_t>(total));
  if (!buffer.ok()) return buffer.status();  // ~PendingEntry returns the reservation
  pending->entry_->buffer_ = std::move(*buffer);
  return pending;
}

absl::StatusOr<PublishResult> PrefixCache::Commit(std::unique_ptr<PendingEntry> pending) {
  if (pending == nullptr) return absl::InvalidArgumentError("pending entry is null");
  if (pending->cache_ != this) {
    return absl::InvalidArgumentError("pending entry was reserved from another PrefixCache");
  }
  PublishResult result;
  result.evicted_entries = pending->evicted_entries_;
  if (pending->stored_tokens() == 0) return result;
  std::shared_ptr<PrefixEntry> entry = pending->entry_;
  const int64_t blocks = static_cast<int64_t>(entry->hashes_.size());
  result.stored_tokens = entry->num_tokens();
  std::vector<Removed> removed;
  {
    MutexLock lock(&mutex_);
    const absl::Time now = Now();
    SweepLocked(now, &removed);
    auto [best, reused] = BestMatchLocked(entry->model_, entry->tokens_, entry->hashes_, now);
    result.reused_blocks = reused;
    result.new_blocks = blocks - reused;
    ++stats_.publishes;
    if (reused == blocks) {
      // Held in full already (the same turn again, or a prefix of a longer one): keep the old
      // copy, which leases may be reading, and give it this publish's lifetime.
      ++stats_.deduplicated;
      Touch(best, now);
      SetExpiry(best, std::max(best->expires, now + pending->ttl_));
      result.deduplicated = true;
      result.entry_id = best->entry->id();
      result.entry_bytes = best->entry->bytes();
      result.entry = best->entry;
    } else {
      Slot* slot = Insert(entry, now + pending->ttl_, now);
      result.entry_id = slot->entry->id();
      result.entry_bytes = slot->entry->bytes();
      result.entry = slot->entry;
      result.subsumed_entries = DropSubsumed(*slot->entry, &removed);
    }
    // After Insert counted the entry, so the model's shape record never lapses in between.
    UnreserveLocked(*entry);
    pending->reserved_ = false;
  }
  Notify(std::move(removed));
  return result;
}

std::optional<PrefixMatch> PrefixCache::Longest(absl::string_view model,
                                                absl::Span<const uint32_t> tokens,
                                                int64_t max_tokens) {
  const int64_t limit = std::clamp<int64_t>(max_tokens, 0, static_cast<int64_t>(tokens.size()));
  const std::vector<BlockHash> hashes =
      ChainHashes(model, tokens.subspan(0, static_cast<size_t>(limit)), options_.block_tokens);
  std::optional<PrefixMatch> match;
  std::vector<Removed> removed;
  {
    MutexLock lock(&mutex_);
    const absl::Time now = Now();
    SweepLocked(now, &removed);
    auto [best, blocks] = BestMatchLocked(model, tokens, hashes, now);
    if (best == nullptr) {
      ++stats_.misses;
    } else {
      ++stats_.hits;
      ++best->hits;
      Touch(best, now);
      match = PrefixMatch{best->entry, blocks * options_.block_tokens};
    }
  }
  Notify(std::move(removed));
  return match;
}

std::string PrefixCache::Lease(const PrefixMatch& match, LeaseBinding binding) {
  if (match.entry == nullptr) return "";
  MutexLock lock(&mutex_);
  const absl::Time now = Now();
  SweepLeasesLocked(now);
  auto record = std::make_unique<LeaseRecord>();
  record->entry = match.entry;
  record->tokens = std::clamp<int64_t>(match.tokens, 0, match.entry->num_tokens());
  record->binding = std::move(binding);
  record->issued = now;
  record->expires = now + options_.lease_duration;
  match.entry->pins_.fetch_add(1, std::memory_order_acq_rel);
  std::string id = NewLeaseId();
  lease_timeline_.insert({record->expires, id});
  leases_.emplace(id, std::move(record));
  ++stats_.leases_issued;
  return id;
}

absl::StatusOr<PrefixLease> PrefixCache::Take(absl::string_view lease_id) {
  MutexLock lock(&mutex_);
  const absl::Time now = Now();
  SweepLeasesLocked(now);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return absl::NotFoundError(absl::StrCat("lease '", Echo(lease_id), "' unknown or already used"));
  }
  std::unique_ptr<LeaseRecord> record = std::move(it->second);
  leases_.erase(it);
  if (record->entry == nullptr) {
    lease_timeline_.erase({record->expires + options_.lease_duration, std::string(lease_id)});
    return absl::FailedPreconditionError(absl::StrCat(
        "lease '", Echo(lease_id), "' expired: issued ", absl::FormatDuration(now - record->issued),
        " ago, valid for prefix_cache.lease_duration=",
        absl::FormatDuration(options_.lease_duration), "; look the prefix up again"));
  }
  lease_timeline_.erase({record->expires, std::string(lease_id)});
  ++stats_.leases_taken;
  // The lease's pin moves into the PrefixLease.
  return PrefixLease(std::string(lease_id), PrefixMatch{std::move(record->entry), record->tokens},
                     std::move(record->binding));
}

std::vector<std::string> PrefixCache::Models() {
  std::vector<std::string> models;
  std::vector<Removed> removed;
  {
    MutexLock lock(&mutex_);
    SweepLocked(Now(), &removed);
    for (const auto& [model, state] : models_) {
      if (state.entries > 0) models.push_back(model);
    }
  }
  Notify(std::move(removed));
  std::sort(models.begin(), models.end());
  return models;
}

std::vector<EntryInfo> PrefixCache::List(absl::string_view model) {
  std::vector<EntryInfo> infos;
  std::vector<Removed> removed;
  {
    MutexLock lock(&mutex_);
    SweepLocked(Now(), &removed);
    std::vector<const Slot*> slots;
    for (const auto& [seq, slot] : slots_) {
      if (model.empty() || slot->entry->model() == model) slots.push_back(slot.get());
    }
    std::sort(slots.begin(), slots.end(),
              [](const Slot* a, const Slot* b) { return a->seq < b->seq; });
    for (const Slot* slot : slots) {
      const PrefixEntry& entry = *slot->entry;
      EntryInfo info;
      info.id = entry.id();
      info.model = entry.model();
      info.num_tokens = entry.num_tokens();
      info.dtype = entry.shape().dtype;
      info.bytes = entry.bytes();
      info.created = entry.created();
      info.last_used = slot->last_used;
      info.expires = slot->expires;
      info.hits = slot->hits;
      info.leases = entry.pins_.load(std::memory_order_acquire);
      info.first_block_hash = BlockHashHex(entry.block_hashes().front());
      infos.push_back(std::move(info));
    }
  }
  Notify(std::move(removed));
  return infos;
}

EvictResult PrefixCache::Evict(absl::string_view model, absl::string_view entry_id) {
  EvictResult result;
  std::vector<Removed> removed;
  {
    MutexLock lock(&mutex_);
    SweepLocked(Now(), &removed);
    const size_t swept = removed.size();
    std::vector<Slot*> targets;
    uint64_t seq = 0;
    if (!entry_id.empty()) {
      auto it = absl::SimpleAtoi(entry_id, &seq) ? slots_.find(seq) : slots_.end();
      if (it != slots_.end() && (model.empty() || it->second->entry->model() == model)) {
        targets.push_back(it->second.get());
      }
    } else {
      for (const auto& [s, slot] : slots_) {
        if (model.empty() || slot->entry->model() == model) targets.push_back(slot.get());
      }
    }
    for (Slot* slot : targets) {
      if (slot->pinned()) {
        ++result.skipped_leased;
        continue;
      }
      result.evicted_bytes += slot->entry->bytes();
      Remove(slot, "admin", &removed);
    }
    result.evicted_entries = static_cast<int>(removed.size() - swept);
  }
  Notify(std::move(removed));
  return result;
}

void PrefixCache::SweepExpired() {
  std::vector<Removed> removed;
  {
    MutexLock lock(&mutex_);
    SweepLocked(Now(), &removed);
  }
  Notify(std::move(removed));
}

int64_t PrefixCache::bytes_held() const {
  MutexLock lock(&mutex_);
  return bytes_held_;
}

PrefixCacheStats PrefixCache::stats() const {
  MutexLock lock(&mutex_);
  PrefixCacheStats stats = stats_;
  stats.entries = static_cast<int64_t>(slots_.size());
  stats.bytes_held = bytes_held_;
  stats.bytes_reserved = bytes_reserved_;
  return stats;
}

}  // namespace kvt
