// The mapper store: every mapper directory under one root, loaded into host memory, listed with
// its state, and handed out by id or by (source, target) pair under shared ownership.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/mapper_view.h"
#include "kernels/types.h"
#include "mapper_store/mapper.h"

namespace kvt {

// Mirrors kvt.v1.MapperState. This build uses kHostResident and kFailed; the others are for the
// device pager and lazy loading that come later.
enum class MapperState { kDiscovered, kLoading, kHostResident, kDeviceResident, kFailed };
const char* MapperStateName(MapperState state);  // "HOST_RESIDENT", "FAILED", ...

// What ListMappers reports for one directory (mirrors kvt.v1.MapperInfo).
struct MapperInfo {
  std::string id;    // directory name
  std::string path;  // directory path
  MapperState state = MapperState::kDiscovered;
  std::string state_reason;  // why FAILED; empty otherwise
  // From the manifest. For a FAILED mapper these are filled when its manifest still parses,
  // else left empty / zero.
  std::string source_model;
  std::string target_model;
  std::string kind;  // "ridge"
  int k = 0;
  bool synthetic = false;
  DType weight_dtype = DType::kBF16;
  ModelSpec source;  // shapes and RoPE of both models
  ModelSpec target;
  // Host bytes held (0 unless resident).
  uint64_t weight_bytes = 0;
  int64_t num_params = 0;
  std::vector<std::string> devices;  // {"host"} when host resident
  // Usage: Get/Find calls that returned this mapper, and when the last one happened.
  uint64_t hits = 0;
  int64_t last_used_unix_ms = 0;  // 0 = never
  uint64_t page_ins = 0;          // device copies (always 0 until the device pager lands)
};

struct StoreOptions {
  LoadOptions load;
};

// Thread-safe. Loading happens outside the lock, so lookups keep working while a scan reads
// gigabytes. A mapper handed out stays alive while any request holds its shared_ptr, even if a
// rescan drops it from the store.
//
// Design room for later issues: entries carry a state machine (MapperState), loading goes
// through LoadOptions (pinned allocator), and Get/Find are the single place usage is recorded,
// which is where device pinning and LRU accounting will hook in.
class MapperStore {
 public:
  // A store over `root` after a first Scan(). NOT_FOUND if `root` is not a directory; mappers
  // that fail to load do not fail Open (they are listed as FAILED).
  static absl::StatusOr<std::unique_ptr<MapperStore>> Open(const std::string& root,
                                                           const StoreOptions& options = {});

  // An empty store; call Scan() to fill it.
  explicit MapperStore(std::string root, StoreOptions options = {});
  MapperStore(const MapperStore&) = delete;
  MapperStore& operator=(const MapperStore&) = delete;

  const std::string& root() const { return root_; }

  // Reads the root directory. Every subdirectory holding a manifest.yaml is a mapper (names
  // starting with '.' are skipped: WriteMapperDir's temporaries). New directories are loaded,
  // FAILED ones are retried, ones that disappeared are dropped, loaded ones are left alone
  // (reloading changed directories is the hot-reload issue). Errors only if the root cannot be
  // listed; per-mapper failures become FAILED entries with the loader's message as reason.
  absl::Status Scan() ABSL_LOCKS_EXCLUDED(scan_mu_, mu_);

  // Every mapper, sorted by id, FAILED ones included.
  std::vector<MapperInfo> List() const ABSL_LOCKS_EXCLUDED(mu_);
  // One mapper's info; NOT_FOUND if unknown.
  absl::StatusOr<MapperInfo> Info(const std::string& mapper_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // A servable mapper by id. NOT_FOUND "no mapper with id 'x'"; FAILED_PRECONDITION for a FAILED
  // mapper (with its reason). Counts a hit.
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> Get(const std::string& mapper_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The one servable mapper for a directed pair. NOT_FOUND "no mapper for A -> B" (mentioning a
  // FAILED mapper for the pair, if any); FAILED_PRECONDITION if several serve the pair (ask by
  // id). Counts a hit.
  absl::StatusOr<std::shared_ptr<const LoadedMapper>> Find(const std::string& source_model,
                                                           const std::string& target_model)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    MapperInfo info;
    std::shared_ptr<const LoadedMapper> mapper;  // set iff info.state == kHostResident
  };

  // Loads one directory into a fresh entry (no locks held: may take seconds).
  Entry LoadEntry(const std::string& id) const;
  void RecordUse(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string root_;
  const StoreOptions options_;
  // std mutexes rather than absl::Mutex: the system's absl is not built with ThreadSanitizer, so
  // TSan cannot see absl::Mutex handoffs and reports false races (same choice as
  // kernels/thread_pool.h). The annotations still document which lock guards what.
  // Serialises scans, so two concurrent Scan() calls never load one directory twice.
  std::mutex scan_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // Shared for List/Info, exclusive for Get/Find (they count hits) and for scan updates.
  mutable std::shared_mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvt
