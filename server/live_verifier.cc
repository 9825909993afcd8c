#include "server/live_verifier.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace kvt {

std::string MapperVersionOf(const std::string& weights_sha256, int64_t generation) {
  return weights_sha256.empty() ? absl::StrCat("generation ", generation) : weights_sha256;
}

absl::StatusOr<std::unique_ptr<LiveVerifier>> LiveVerifier::Create(LiveVerifierOptions options,
                                                                   Measure measure,
                                                                   Metrics* metrics) {
  const double fraction = options.sample_fraction;
  if (!(fraction >= 0 && fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prefix_cache.verify_sample_fraction = ", fraction, " must be in [0, 1] (0: off)"));
  }
  if (options.window < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache.verify_window = ", options.window, " must be >= 1"));
  }
  if (!(options.tolerance >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_cache.verify_tolerance = ", options.tolerance, " must be >= 0"));
  }
  if (options.max_pending < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prefix_cache.verify_max_pending = ",
                                                   options.max_pending, " must be >= 1"));
  }
  if (options.pending_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("prefix_cache.verify_pending_seconds must be > 0");
  }
  if (options.block_tokens < 1) {
    return absl::InvalidArgumentError("prefix_cache.block_tokens must be >= 1");
  }
  if (!measure) return absl::InvalidArgumentError("live verification needs a measure function");
  // Every round(1 / fraction)-th lookup: 0.02 -> every 50th.
  const int64_t period =
      fraction > 0 ? std::max<int64_t>(1, static_cast<int64_t>(std::llround(1.0 / fraction))) : 0;
  return std::unique_ptr<LiveVerifier>(
      new LiveVerifier(std::move(options), period, std::move(measure), metrics));
}

LiveVerifier::LiveVerifier(LiveVerifierOptions options, int64_t period, Measure measure,
                           Metrics* metrics)
    : options_(std::move(options)),
      period_(period),
      measure_(std::move(measure)),
      metrics_(metrics) {}

LiveVerifier::~LiveVerifier() { worker_.Drain(); }

void LiveVerifier::Count(const VerifiedMapper& mapper, const char* result) const {
  if (metrics_ != nullptr) metrics_->RecordLiveVerification(mapper.pair, mapper.id, result);
}

LiveVerifier::MapperRecord& LiveVerifier::RecordFor(const VerifiedMapper& mapper) {
  MapperRecord& record = mappers_[mapper.id];
  if (record.mapper.id.empty() || record.mapper.version != mapper.version) {
    if (record.out_of_service) {
      KVT_LOG(kInfo, "live verification: new mapper version back in service")
          .With("mapper", mapper.id)
          .With("generation", mapper.generation)
          .With("was", record.reason);
    }
    record = MapperRecord{};
    record.mapper = mapper;
    if (metrics_ != nullptr) metrics_->SetMapperOutOfService(mapper.pair, mapper.id, false);
  }
  return record;
}

std::string LiveVerifier::OutOfService(const VerifiedMapper& mapper) {
  MutexLock lock(&mutex_);
  const MapperRecord& record = RecordFor(mapper);
  return record.out_of_service ? record.reason : std::string();
}

bool LiveVerifier::Sample(const VerifiedMapper& mapper) {
  if (period_ == 0) return false;
  MutexLock lock(&mutex_);
  MapperRecord& record = RecordFor(mapper);
  record.mapper.generation = mapper.generation;  // same weights, maybe reloaded
  return ++record.lookups % period_ == 0;
}

void LiveVerifier::ExpireLocked(size_t keep) {
  const absl::Time oldest = Now() - options_.pending_ttl;
  while (!pending_.empty() &&
         (pending_.size() > keep || pending_.front().created < oldest)) {
    Count(pending_.front().mapper, "expired");
    pending_.pop_front();
  }
}

void LiveVerifier::AddPending(const VerifiedMapper& mapper, const PrefixMatch& source) {
  if (source.entry == nullptr || source.tokens < options_.block_tokens) return;
  PendingSample sample;
  sample.mapper = mapper;
  sample.source = source;
  const std::vector<uint32_t>& tokens = source.entry->tokens();
  const int64_t n = std::min<int64_t>(source.tokens, static_cast<int64_t>(tokens.size()));
  const std::vector<BlockHash> hashes = ChainHashes(
      mapper.pair.target(), absl::MakeConstSpan(tokens.data(), static_cast<size_t>(n)),
      options_.block_tokens);
  if (hashes.empty()) return;
  sample.last_block = hashes.back();
  sample.source.tokens = static_cast<int64_t>(hashes.size()) * options_.block_tokens;
  sample.created = Now();
  MutexLock lock(&mutex_);
  ExpireLocked(static_cast<size_t>(options_.max_pending) - 1);
  pending_.push_back(std::move(sample));
}

void LiveVerifier::OnPublish(const std::shared_ptr<const PrefixEntry>& own) {
  if (own == nullptr || period_ == 0) return;
  std::vector<PendingSample> matched;
  {
    MutexLock lock(&mutex_);
    ExpireLocked(static_cast<size_t>(options_.max_pending));
    for (auto it = pending_.begin(); it != pending_.end();) {
      const int64_t blocks = it->source.tokens / options_.block_tokens;
      if (it->mapper.pair.target() == own->model() && blocks >= 1 &&
          blocks <= static_cast<int64_t>(own->block_hashes().size()) &&
          own->block_hashes()[blocks - 1] == it->last_block) {
        matched.push_back(std::move(*it));
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (PendingSample& sample : matched) {
    // Bounded: samples waiting for the worker count against verify_max_pending too.
    if (worker_.queued() >= static_cast<size_t>(options_.max_pending)) {
      Count(sample.mapper, "skipped");
      KVT_LOG(kWarning, "live verification sample skipped: the verifier is behind")
          .With("mapper", sample.mapper.id)
          .With("queued", static_cast<int64_t>(worker_.queued()));
      continue;
    }
    worker_.Submit([this, sample = std::move(sample), own] {
      const absl::Time start = absl::Now();
      absl::StatusOr<double> live = measure_(sample, *own);
      KVT_LOG(kDebug, "live verification measured")
          .With("mapper", sample.mapper.id)
          .With("tokens", sample.source.tokens)
          .With("ok", live.ok())
          .With("ms", absl::ToDoubleMilliseconds(absl::Now() - start));
      Record(sample.mapper, live);
    });
  }
}

void LiveVerifier::Record(const VerifiedMapper& mapper, const absl::StatusOr<double>& live) {
  MutexLock lock(&mutex_);
  auto it = mappers_.find(mapper.id);
  if (it == mappers_.end() || it->second.mapper.version != mapper.version ||
      !live.ok()) {
    // Taken on a version no longer served, or not measurable: no evidence either way.
    Count(mapper, "skipped");
    if (!live.ok()) {
      KVT_LOG(kWarning, "live verification sample skipped")
          .With("mapper", mapper.id)
          .With("error", live.status().message());
    }
    return;
  }
  MapperRecord& record = it->second;
  record.window.push_back(*live);
  while (static_cast<int>(record.window.size()) > options_.window) record.window.pop_front();
  const double mean = std::accumulate(record.window.begin(), record.window.end(), 0.0) /
                      static_cast<double>(record.window.size());
  if (metrics_ != nullptr) metrics_->SetLiveQuality(mapper.pair, mapper.id, mean);
  if (!mapper.recorded.has_value()) {
    // Nothing to compare with: exported and logged, never taken out of service.
    Count(mapper, "no_reference");
    KVT_LOG(kInfo, "live verification sample (mapper records no kv_cosine_heldout)")
        .With("mapper", mapper.id)
        .With("live", *live)
        .With("window_mean", mean);
    return;
  }
  const double floor = *mapper.recorded - options_.tolerance;
  Count(mapper, *live >= floor ? "pass" : "fail");
  KVT_LOG(kInfo, "live verification sample")
      .With("mapper", mapper.id)
      .With("generation", mapper.generation)
      .With("live", *live)
      .With("window_mean", mean)
      .With("samples", static_cast<int64_t>(record.window.size()))
      .With("recorded", *mapper.recorded);
  if (!record.out_of_service && static_cast<int>(record.window.size()) == options_.window &&
      mean < floor) {
    record.out_of_service = true;
    record.reason = absl::StrCat(
        "live_quality: mean K/V cosine ", mean, " of the last ", options_.window,
        " live samples < recorded kv_cosine_heldout ", *mapper.recorded, " - tolerance ",
        options_.tolerance, "; restore with `kvt mappers restore ", mapper.id,
        "` or load a new version");
    if (metrics_ != nullptr) metrics_->SetMapperOutOfService(mapper.pair, mapper.id, true);
    KVT_LOG(kWarning, "live verification: mapper taken out of service")
        .With("mapper", mapper.id)
        .With("generation", mapper.generation)
        .With("source", mapper.pair.source())
        .With("target", mapper.pair.target())
        .With("reason", record.reason);
  }
}

VerificationState LiveVerifier::StateOf(const MapperRecord& record) {
  VerificationState state;
  state.mapper = record.mapper;
  state.samples = static_cast<int>(record.window.size());
  if (!record.window.empty()) {
    state.live = std::accumulate(record.window.begin(), record.window.end(), 0.0) /
                 static_cast<double>(record.window.size());
  }
  state.out_of_service = record.out_of_service;
  state.reason = record.reason;
  return state;
}

absl::StatusOr<std::pair<bool, VerificationState>> LiveVerifier::Restore(
    const std::string& mapper_id) {
  MutexLock lock(&mutex_);
  auto it = mappers_.find(mapper_id);
  if (it == mappers_.end()) {
    return absl::NotFoundError(absl::StrCat("mapper_id '", mapper_id,
                                            "': live verification has no state for it"));
  }
  MapperRecord& record = it->second;
  const bool was_out = record.out_of_service;
  record.out_of_service = false;
  record.reason.clear();
  record.window.clear();
  if (metrics_ != nullptr) {
    metrics_->SetMapperOutOfService(record.mapper.pair, record.mapper.id, false);
  }
  KVT_LOG(kInfo, "live verification: mapper restored")
      .With("mapper", mapper_id)
      .With("generation", record.mapper.generation)
      .With("was_out_of_service", was_out);
  return std::make_pair(was_out, StateOf(record));
}

std::vector<VerificationState> LiveVerifier::List() {
  MutexLock lock(&mutex_);
  std::vector<VerificationState> out;
  for (const auto& [id, record] : mappers_) out.push_back(StateOf(record));
  std::sort(out.begin(), out.end(), [](const VerificationState& a, const VerificationState& b) {
    return a.mapper.id < b.mapper.id;
  });
  return out;
}

int LiveVerifier::pending() {
  MutexLock lock(&mutex_);
  ExpireLocked(static_cast<size_t>(options_.max_pending));
  return static_cast<int>(pending_.size());
}

}  // namespace kvt
