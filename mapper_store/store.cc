#include "mapper_store/store.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "mapper_store/file_util.h"

namespace kvt {
namespace {

void FillFromManifest(const Manifest& m, MapperInfo* info) {
  info->source_model = m.source.name;
  info->target_model = m.target.name;
  info->kind = MapperKindName(m.kind);
  info->k = m.k;
  info->synthetic = m.synthetic;
  info->weight_dtype = m.weights_dtype;
  info->source = m.source;
  info->target = m.target;
}

}  // namespace

const char* MapperStateName(MapperState state) {
  switch (state) {
    case MapperState::kDiscovered:
      return "DISCOVERED";
    case MapperState::kLoading:
      return "LOADING";
    case MapperState::kHostResident:
      return "HOST_RESIDENT";
    case MapperState::kDeviceResident:
      return "DEVICE_RESIDENT";
    case MapperState::kFailed:
      return "FAILED";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<MapperStore>> MapperStore::Open(const std::string& root,
                                                               const StoreOptions& options) {
  auto store = std::make_unique<MapperStore>(root, options);
  if (absl::Status s = store->Scan(); !s.ok()) return s;
  return store;
}

MapperStore::MapperStore(std::string root, StoreOptions options)
    : root_(std::move(root)), options_(std::move(options)) {}

MapperStore::Entry MapperStore::LoadEntry(const std::string& id) const {
  Entry entry;
  entry.info.id = id;
  entry.info.path = JoinPath(root_, id);
  absl::StatusOr<std::unique_ptr<LoadedMapper>> loaded =
      LoadMapperDir(entry.info.path, options_.load);
  if (loaded.ok()) {
    FillFromManifest((*loaded)->manifest(), &entry.info);
    entry.info.state = MapperState::kHostResident;
    entry.info.weight_bytes = (*loaded)->weight_bytes();
    entry.info.num_params = (*loaded)->num_params();
    entry.info.devices = {"host"};
    entry.mapper = std::shared_ptr<const LoadedMapper>(std::move(*loaded));
    return entry;
  }
  entry.info.state = MapperState::kFailed;
  entry.info.state_reason = std::string(loaded.status().message());
  // Best effort, for the listing: which pair was this meant to serve?
  absl::StatusOr<Manifest> manifest = ReadManifestFile(JoinPath(entry.info.path, kManifestFileName));
  if (manifest.ok()) FillFromManifest(*manifest, &entry.info);
  return entry;
}

absl::Status MapperStore::Scan() {
  std::lock_guard<std::mutex> scan_lock(scan_mu_);
  if (!IsDirectory(root_)) {
    return absl::NotFoundError(
        absl::StrCat("mapper store directory ", root_, " does not exist or is not a directory"));
  }
  absl::StatusOr<std::vector<std::string>> names = ListSubdirectories(root_);
  if (!names.ok()) return names.status();
  std::set<std::string> present;
  for (const std::string& name : *names) {
    if (name.empty() || name[0] == '.') continue;
    if (!PathExists(JoinPath(JoinPath(root_, name), kManifestFileName))) continue;
    present.insert(name);
  }

  std::vector<std::string> to_load;
  {
    std::unique_lock<std::shared_mutex> lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      // Requests holding the shared_ptr keep a dropped mapper alive until they finish.
      it = present.count(it->first) == 0 ? entries_.erase(it) : std::next(it);
    }
    for (const std::string& id : present) {
      auto it = entries_.find(id);
      if (it == entries_.end() || it->second.info.state == MapperState::kFailed) {
        to_load.push_back(id);
      }
    }
  }
  for (const std::string& id : to_load) {
    Entry entry = LoadEntry(id);
    std::unique_lock<std::shared_mutex> lock(mu_);
    auto it = entries_.find(id);
    if (it != entries_.end()) {  // a retried FAILED entry keeps its usage counters
      entry.info.hits = it->second.info.hits;
      entry.info.last_used_unix_ms = it->second.info.last_used_unix_ms;
    }
    entries_[id] = std::move(entry);
  }
  return absl::OkStatus();
}

std::vector<MapperInfo> MapperStore::List() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  std::vector<MapperInfo> infos;
  infos.reserve(entries_.size());
  for (const auto& [id, entry] : entries_) infos.push_back(entry.info);
  return infos;
}

absl::StatusOr<MapperInfo> MapperStore::Info(const std::string& mapper_id) const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  auto it = entries_.find(mapper_id);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("no mapper with id '", mapper_id, "' in ", root_));
  }
  return it->second.info;
}

void MapperStore::RecordUse(Entry& entry) {
  ++entry.info.hits;
  entry.info.last_used_unix_ms = absl::ToUnixMillis(absl::Now());
}

absl::StatusOr<std::shared_ptr<const LoadedMapper>> MapperStore::Get(const std::string& mapper_id) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  auto it = entries_.find(mapper_id);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("no mapper with id '", mapper_id, "' in ", root_));
  }
  Entry& entry = it->second;
  if (entry.info.state == MapperState::kFailed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "mapper '", mapper_id, "' failed to load and cannot serve: ", entry.info.state_reason));
  }
  if (entry.mapper == nullptr) {  // future states (DISCOVERED, LOADING) hold no weights yet
    return absl::UnavailableError(absl::StrCat("mapper '", mapper_id, "' is ",
                                               MapperStateName(entry.info.state),
                                               ", not ready to serve yet"));
  }
  RecordUse(entry);
  return entry.mapper;
}

absl::StatusOr<std::shared_ptr<const LoadedMapper>> MapperStore::Find(
    const std::string& source_model, const std::string& target_model) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  std::vector<Entry*> serving;
  std::vector<const Entry*> failed;
  for (auto& [id, entry] : entries_) {
    if (entry.info.source_model != source_model || entry.info.target_model != target_model) {
      continue;
    }
    if (entry.info.state == MapperState::kFailed) {
      failed.push_back(&entry);
    } else if (entry.mapper != nullptr) {
      serving.push_back(&entry);
    }
  }
  if (serving.size() == 1) {
    RecordUse(*serving[0]);
    return serving[0]->mapper;
  }
  if (serving.empty()) {
    std::string message = absl::StrCat("no mapper for ", source_model, " -> ", target_model);
    for (const Entry* entry : failed) {
      absl::StrAppend(&message, "; mapper '", entry->info.id, "' for this pair FAILED: ",
                      entry->info.state_reason);
    }
    return absl::NotFoundError(message);
  }
  std::vector<std::string> ids;
  for (const Entry* entry : serving) ids.push_back(entry->info.id);
  return absl::FailedPreconditionError(absl::StrCat(
      "ambiguous: ", serving.size(), " mappers serve ", source_model, " -> ", target_model, " (",
      absl::StrJoin(ids, ", "), "); request one by mapper id or remove the others"));
}

}  // namespace kvt
