#include "prefix_cache/prefix_digest.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/rand.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/echo.h"

namespace kvt {
namespace {

// Counters and header words are stored natively and read as little-endian by other processes.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the digest layout is little-endian");

constexpr uint16_t kSticky = 0xffff;
constexpr char kDefaultNamePrefix[] = "kvt-prefix-digest-";
constexpr int64_t kHeartbeatOffset = 32;
constexpr int64_t kKeysOffset = 40;

int64_t MappingBytes(int64_t slots) { return kPrefixDigestHeaderBytes + 2 * slots; }

template <typename T>
void PutLittleEndian(uint8_t* at, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) at[i] = static_cast<uint8_t>(value >> (8 * i));
}

uint64_t* Word(uint8_t* base, int64_t offset) {
  return reinterpret_cast<uint64_t*>(base + offset);
}

uint64_t RandomInstance() {
  uint64_t value = 0;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&value), sizeof(value)) != 1) {
    value = std::random_device{}();
    value = (value << 32) ^ std::random_device{}();
  }
  return value == 0 ? 1 : value;
}

absl::Status CheckOptions(const PrefixDigestOptions& options) {
  const int64_t slots = options.slots;
  if (slots < kPrefixDigestMinSlots || slots > kPrefixDigestMaxSlots || (slots & (slots - 1))) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix digest slots: ", slots, " is not a power of two in [",
                     kPrefixDigestMinSlots, ", ", kPrefixDigestMaxSlots, "]"));
  }
  if (options.block_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix digest block_tokens: ", options.block_tokens, " is not > 0"));
  }
  const std::string& name = options.shm_name;
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
      name.size() > 250) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix digest shm_name: '", Echo(name), "' is not \"/name\" (no other '/')"));
  }
  if (options.heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("prefix digest heartbeat_interval: not > 0");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PrefixDigest>> PrefixDigest::Create(PrefixDigestOptions options) {
  const uint64_t instance = RandomInstance();
  if (options.shm_name.empty()) {
    options.shm_name = absl::StrFormat("/%s%d-%016x", kDefaultNamePrefix, getpid(), instance);
  }
  if (absl::Status status = CheckOptions(options); !status.ok()) return status;
  const int stale = options.remove_stale_after > absl::ZeroDuration()
                        ? RemoveStale(options.shm_dir, options.remove_stale_after)
                        : 0;
  const int fd = shm_open(options.shm_name.c_str(), O_CREAT | O_EXCL | O_RDWR, options.mode);
  if (fd < 0) {
    const int error = errno;
    const std::string why = absl::StrCat("prefix digest: shm_open('", Echo(options.shm_name),
                                         "') failed: ", std::strerror(error));
    return error == EEXIST ? absl::AlreadyExistsError(why) : absl::InternalError(why);
  }
  // The umask must not narrow what readers of another user need; fchmod sets it exactly.
  const int64_t bytes = MappingBytes(options.slots);
  void* mapping = MAP_FAILED;
  if (fchmod(fd, options.mode) == 0 && ftruncate(fd, bytes) == 0) {
    mapping = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int error = errno;
  close(fd);
  if (mapping == MAP_FAILED) {
    shm_unlink(options.shm_name.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("prefix digest: ", bytes,
                                                     " bytes of shared memory for '",
                                                     Echo(options.shm_name),
                                                     "': ", std::strerror(error)));
  }
  auto digest = std::unique_ptr<PrefixDigest>(
      new PrefixDigest(std::move(options), static_cast<uint8_t*>(mapping), instance));
  digest->stale_removed_ = stale;
  return digest;
}

int PrefixDigest::RemoveStale(const std::string& shm_dir, absl::Duration older_than) {
  DIR* dir = opendir(shm_dir.c_str());
  if (dir == nullptr) return 0;
  const uint64_t now_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  const uint64_t max_age_ms = static_cast<uint64_t>(absl::ToInt64Milliseconds(older_than));
  int removed = 0;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind(kDefaultNamePrefix, 0) != 0) continue;
    const int fd = openat(dirfd(dir), name.c_str(), O_RDONLY | O_NOFOLLOW);
    if (fd < 0) continue;
    uint8_t header[kPrefixDigestHeaderBytes];
    const bool read_whole = pread(fd, header, sizeof(header), 0) == sizeof(header);
    close(fd);
    if (!read_whole || std::memcmp(header, kPrefixDigestMagic, 8) != 0) continue;
    uint64_t beat = 0;
    for (int b = 0; b < 8; ++b) beat |= uint64_t{header[kHeartbeatOffset + b]} << (8 * b);
    // A clock step backwards makes a live beat look young, never old.
    if (beat != 0 && beat + max_age_ms > now_ms) continue;
    if (shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  closedir(dir);
  return removed;
}

PrefixDigest::PrefixDigest(PrefixDigestOptions options, uint8_t* base, uint64_t instance)
    : options_(std::move(options)), base_(base), instance_(instance) {
  // ftruncate zero-filled the counters; the header is written before any reader can know the
  // name (ServerMetadata names it only after Create returns).
  std::memcpy(base_, kPrefixDigestMagic, 8);
  PutLittleEndian<uint32_t>(base_ + 8, kPrefixDigestHashes);
  PutLittleEndian<uint32_t>(base_ + 12, static_cast<uint32_t>(options_.block_tokens));
  PutLittleEndian<uint64_t>(base_ + 16, static_cast<uint64_t>(options_.slots));
  PutLittleEndian<uint64_t>(base_ + 24, instance_);
  Beat();
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
}

PrefixDigest::~PrefixDigest() {
  {
    MutexLock lock(&stop_mutex_);
    stop_ = true;
  }
  stop_cv_.SignalAll();
  heartbeat_.join();
  // Readers that still map it must not trust it for the seconds a stale heartbeat would last.
  __atomic_store_n(Word(base_, kHeartbeatOffset), uint64_t{0}, __ATOMIC_RELEASE);
  munmap(base_, MappingBytes(options_.slots));
  shm_unlink(options_.shm_name.c_str());
}

std::optional<BlockHash> PrefixDigest::KeyOf(absl::Span<const uint32_t> tokens,
                                             int block_tokens) {
  if (block_tokens <= 0 || tokens.size() < static_cast<size_t>(block_tokens)) return std::nullopt;
  return ChainHashes(kPrefixDigestSeed, tokens.first(block_tokens), block_tokens).front();
}

uint16_t* PrefixDigest::Counters() const {
  return reinterpret_cast<uint16_t*>(base_ + kPrefixDigestHeaderBytes);
}

void PrefixDigest::Positions(const BlockHash& key, uint64_t out[kPrefixDigestHashes]) const {
  for (int i = 0; i < kPrefixDigestHashes; ++i) {
    const uint8_t* b = key.data() + 4 * i;
    const uint32_t word = uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 |
                          uint32_t{b[3]} << 24;
    out[i] = word & static_cast<uint64_t>(options_.slots - 1);
  }
}

void PrefixDigest::Add(const BlockHash& key) { Count(key, +1); }

void PrefixDigest::Remove(const BlockHash& key) { Count(key, -1); }

// Counters are written with atomic stores (readers in other processes load them without a
// lock); the writer lock keeps each read-modify-write whole.
void PrefixDigest::Count(const BlockHash& key, int delta) {
  uint64_t positions[kPrefixDigestHashes];
  Positions(key, positions);
  MutexLock lock(&mutex_);
  for (uint64_t p : positions) {
    uint16_t* counter = Counters() + p;
    const uint16_t value = __atomic_load_n(counter, __ATOMIC_RELAXED);
    // A saturated counter has lost count of its keys: it stays "maybe" for good. A zero one
    // cannot be decremented (a Remove without its Add) without wrapping to sticky.
    if (value == kSticky || (delta < 0 && value == 0)) continue;
    const uint16_t updated = static_cast<uint16_t>(value + delta);
    occupied_ += (value == 0) - (updated == 0);
    __atomic_store_n(counter, updated, __ATOMIC_RELEASE);
  }
  __atomic_fetch_add(Word(base_, kKeysOffset), static_cast<uint64_t>(int64_t{delta}),
                     __ATOMIC_RELAXED);
}

bool PrefixDigest::MightHold(const BlockHash& key) const {
  uint64_t positions[kPrefixDigestHashes];
  Positions(key, positions);
  for (uint64_t p : positions) {
    if (__atomic_load_n(Counters() + p, __ATOMIC_ACQUIRE) == 0) return false;
  }
  return true;
}

int64_t PrefixDigest::keys() const {
  return static_cast<int64_t>(__atomic_load_n(Word(base_, kKeysOffset), __ATOMIC_RELAXED));
}

int64_t PrefixDigest::occupied_slots() const {
  MutexLock lock(&mutex_);
  return occupied_;
}

double PrefixDigest::false_positive_rate() const {
  const double fill = static_cast<double>(occupied_slots()) / static_cast<double>(slots());
  return std::pow(fill, kPrefixDigestHashes);
}

void PrefixDigest::Beat() {
  const uint64_t now_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  __atomic_store_n(Word(base_, kHeartbeatOffset), now_ms, __ATOMIC_RELEASE);
}

void PrefixDigest::HeartbeatLoop() {
  MutexLock lock(&stop_mutex_);
  while (!stop_) {
    stop_cv_.WaitWithTimeout(&stop_mutex_, options_.heartbeat_interval);
    if (!stop_) Beat();
  }
}

}  // namespace kvt
