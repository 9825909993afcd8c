#include "server/prefix_cache_service.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "kernels/finite.h"
#include "prefix_cache/prefix_digest.h"
#include "quality/kv_quality.h"
#include "quality/mapper_quality.h"
#include "server/measure_translation.h"
#include "server/translate/request_plan.h"
#include "server/request_checks.h"
#include "transport/kv_chunks.h"
#include "transport/paged.h"
#include "transport/proto_convert.h"
#include "common/echo.h"

namespace kvt {
namespace {

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

// The mappers the store serves (not FAILED).
std::vector<MapperInfo> ServedMappers(const MapperStore& store) {
  std::vector<MapperInfo> served;
  for (MapperInfo& info : store.List()) {
    if (info.state != MapperState::kFailed) served.push_back(std::move(info));
  }
  return served;
}

// The shape every mapper reading `model` expects; NOT_FOUND when none reads it (nothing could
// reuse the cache, and model labels stay bounded by the store).
absl::StatusOr<ModelSpec> SourceSpec(const std::vector<MapperInfo>& served,
                                     const std::string& model) {
  for (const MapperInfo& info : served) {
    if (info.source_model == model) return info.source;
  }
  return absl::NotFoundError(absl::StrCat(
      "header.model='", Echo(model),
      "': no mapper in the store reads this model, so no other model could reuse its cache"));
}

// Copies tokens [start, start + count) of a chunk or packed layer in `layout` ([heads, tokens,
// dim] or [tokens, heads, dim], `total` tokens) into the NHD entry layer.
void CopyTokensToNhd(Layout layout, const char* src, int64_t total, int64_t start,
                     int64_t count, int64_t heads, int64_t head_bytes, char* dst_layer,
                     int64_t dst_start) {
  if (count <= 0) return;
  if (layout == Layout::kNHD) {
    std::memcpy(dst_layer + dst_start * heads * head_bytes, src + start * heads * head_bytes,
                count * heads * head_bytes);
    return;
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < count; ++t) {
      std::memcpy(dst_layer + ((dst_start + t) * heads + h) * head_bytes,
                  src + (h * total + start + t) * head_bytes, head_bytes);
    }
  }
}

std::string PairKey(const std::string& source, const std::string& target) {
  return absl::StrCat(source, "->", target);
}

// The benefit gate, after the quality gate: every text source the mapper records a measured
// benefit for must keep at least the floor of the context benefit at its 95% lower bound (the
// worst text decides); with the floor above 0 a mapper that records none is refused. Fills the
// verdict's benefit fields; returns why it fails, or "".
std::string BenefitGateReason(const KvtdConfig::PrefixCache& gate, const Manifest& manifest,
                              v1::GateVerdict* verdict) {
  const auto pair = gate.pair_min_benefit.find(PairKey(manifest.source.name, manifest.target.name));
  const bool own_floor = pair != gate.pair_min_benefit.end();
  const double floor = own_floor ? pair->second : gate.min_benefit_recovered;
  verdict->set_min_benefit_recovered(floor);
  const std::optional<RecordedBenefit> worst = MapperRecordedBenefit(manifest);
  if (worst.has_value()) {
    verdict->set_benefit_lower95(worst->lower95);
    verdict->set_benefit_text(worst->text);
  }
  if (floor <= 0) return "";
  if (!worst.has_value()) {
    return "the mapper records no measured benefit (quality.benefit): measure it with "
           "`python -m kvt.qualify`";
  }
  if (worst->lower95 >= floor) return "";
  const std::string key =
      own_floor ? absl::StrCat("prefix_cache.pair_min_benefit \"", pair->first, "\"")
                : std::string("prefix_cache.min_benefit_recovered");
  return absl::StrCat("mapper context benefit recovered on text '", worst->text,
                      "' (95% lower bound) ", worst->lower95, " < floor ", floor, " (", key, ")");
}

}  // namespace

PrefixCacheService::PrefixCacheService(const KvtdConfig& config, MapperStore* store,
                                       PrefixCache* cache, SystemMemoryRegistry* system_memory,
                                       InputShiftCache* shift_stats, Metrics* metrics,
                                       const Authenticator* auth)
    : config_(config),
      store_(store),
      cache_(cache),
      system_memory_(system_memory),
      shift_stats_(shift_stats),
      metrics_(metrics),
      auth_(auth) {
  const KvtdConfig::PrefixCache& pc = config_.prefix_cache;
  if (cache_ != nullptr && pc.verify_sample_fraction > 0) {
    LiveVerifierOptions options;
    options.sample_fraction = pc.verify_sample_fraction;
    options.window = static_cast<int>(pc.verify_window);
    options.tolerance = pc.verify_tolerance;
    options.max_pending = static_cast<int>(pc.verify_max_pending);
    options.pending_ttl = absl::Seconds(pc.verify_pending_seconds);
    options.block_tokens = cache_->block_tokens();
    absl::StatusOr<std::unique_ptr<LiveVerifier>> verifier = LiveVerifier::Create(
        std::move(options),
        [this](const PendingSample& sample, const PrefixEntry& own) {
          return MeasureSample(sample, own);
        },
        metrics_);
    if (verifier.ok()) {
      verifier_ = std::move(*verifier);
    } else {  // config validation refuses these first
      KVT_LOG(kError, "live verification off").With("error", verifier.status().message());
    }
  }
  UpdateUsage();
}

absl::StatusOr<double> PrefixCacheService::MeasureSample(const PendingSample& sample,
                                                         const PrefixEntry& own) {
  const absl::Time deadline = absl::Now() + absl::Seconds(config_.prefix_cache.lease_seconds);
  AcquireOptions wait = MapperWait(config_, deadline);
  absl::StatusOr<MapperHandle> handle = store_->Acquire(sample.mapper.id, wait);
  if (!handle.ok()) return handle.status();
  const std::string now =
      MapperVersionOf(handle->mapper().weights_sha256(), handle->generation());
  if (now != sample.mapper.version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "mapper '", sample.mapper.id, "' now has weights ", now,
        ", the sample was taken on ", sample.mapper.version));
  }
  absl::StatusOr<ComputeMapper> compute = PinForCompute(store_, shift_stats_, &*handle, deadline);
  if (!compute.ok()) return compute.status();
  MeasureInputs in;
  in.source = sample.source.entry->View(sample.source.tokens);
  in.truth = own.View(sample.source.tokens);  // canonical: token i at position i in both
  in.options.token_chunk = config_.backend.token_chunk;
  in.cosines_only = true;
  std::vector<LayerQuality> layers;
  if (absl::Status measured =
          MeasureTranslation(*handle, *compute, in, deadline, nullptr, &layers);
      !measured.ok()) {
    return measured;
  }
  return KvCosineOverLayers(layers);
}

grpc::Status PrefixCacheService::Authorize(const grpc::ServerContext* context, Role role) const {
  return auth_ == nullptr ? grpc::Status::OK : auth_->Authorize(*context, role);
}

void PrefixCacheService::UpdateUsage() {
  if (metrics_ == nullptr || cache_ == nullptr) return;
  const PrefixCacheStats stats = cache_->stats();
  metrics_->SetPrefixCacheUsage(stats.bytes_held, cache_->max_bytes(), stats.entries);
  if (const PrefixDigest* digest = cache_->digest(); digest != nullptr) {
    metrics_->SetPrefixDigestUsage(digest->keys(), digest->false_positive_rate());
  }
}

grpc::Status PrefixCacheService::Publish(grpc::ServerContext* context,
                                         grpc::ServerReader<v1::PublishRequest>* reader,
                                         v1::PublishResponse* response) {
  if (grpc::Status auth = Authorize(context, Role::kClient); !auth.ok()) return auth;
  std::string model_label = PairLabels::kUnknown;
  absl::Status status = PublishImpl(reader, response, &model_label);
  if (metrics_ != nullptr) {
    metrics_->RecordPrefixPublish(
        model_label,
        status.ok() ? (response->stored_tokens() > 0 ? "stored" : "empty")
                    : Metrics::CodeLabel(status.code()),
        response->stored_tokens());
  }
  UpdateUsage();
  if (!status.ok()) {
    KVT_LOG(kWarning, "publish failed")
        .With("request_id", response->request_id())
        .With("code", absl::StatusCodeToString(status.code()))
        .With("error", status.message());
    return ToGrpcStatus(status);
  }
  KVT_LOG(kInfo, "publish done")
      .With("request_id", response->request_id())
      .With("model", model_label)
      .With("stored_tokens", response->stored_tokens())
      .With("new_blocks", response->new_blocks())
      .With("reused_blocks", response->reused_blocks());
  return grpc::Status::OK;
}

absl::Status PrefixCacheService::PublishImpl(grpc::ServerReader<v1::PublishRequest>* reader,
                                             v1::PublishResponse* response,
                                             std::string* model_label) {
  if (cache_ == nullptr) {
    return absl::FailedPreconditionError(
        "the prefix cache is disabled on this server (prefix_cache.enabled)");
  }
  v1::PublishRequest message;
  if (!reader->Read(&message) || !message.has_header()) {
    return absl::InvalidArgumentError("first message must be a header (PublishRequest.header)");
  }
  const v1::PublishHeader header = message.header();
  response->set_request_id(header.request_id());
  const std::vector<MapperInfo> served = ServedMappers(*store_);
  absl::StatusOr<ModelSpec> spec = SourceSpec(served, header.model());
  if (!spec.ok()) return spec.status();
  *model_label = header.model();
  absl::StatusOr<DType> dtype = DTypeFromProto(header.dtype(), "header.dtype");
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<Layout> layout = LayoutFromProto(header.layout(), "header.layout");
  if (!layout.ok()) return layout.status();
  const v1::CacheShape& shape = header.shape();
  // Compared as the wire's unsigned values: no narrowing before they are checked.
  if (int64_t{shape.num_layers()} != spec->num_layers ||
      int64_t{shape.num_kv_heads()} != spec->num_kv_heads ||
      int64_t{shape.head_dim()} != spec->head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.shape=", shape.num_layers(), " layers x ", shape.num_kv_heads(), " heads x ",
        shape.head_dim(), " but the mappers reading '", Echo(header.model()), "' expect ",
        spec->num_layers, " x ", spec->num_kv_heads, " x ", spec->head_dim));
  }
  const int64_t num_tokens = header.token_ids_size();
  if (num_tokens == 0) return absl::InvalidArgumentError("header.token_ids is empty");
  if (num_tokens > config_.limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("header.token_ids has ", num_tokens,
                                                     " tokens, over limits.max_tokens=",
                                                     config_.limits.max_tokens));
  }
  const EntryShape entry_shape{spec->num_layers, spec->num_kv_heads, spec->head_dim, *dtype};
  absl::StatusOr<std::unique_ptr<PendingEntry>> pending = cache_->Reserve(
      header.model(), absl::MakeConstSpan(header.token_ids().data(), header.token_ids_size()), entry_shape, absl::Seconds(header.ttl_seconds()));
  if (!pending.ok()) return pending.status();
  const int64_t stored = (*pending)->stored_tokens();
  const LayerGeometry geometry{*layout, spec->num_kv_heads, num_tokens, spec->head_dim,
                               static_cast<int64_t>(DTypeSize(*dtype))};
  const int64_t head_bytes = spec->head_dim * geometry.element_size;
  if (header.input().has_cached()) {
    return absl::InvalidArgumentError("header.input.cached: Publish takes inline or a region");
  }
  if (header.input().has_region()) {
    if (!config_.shared_memory.allow_client_regions) {
      return absl::FailedPreconditionError(
          "header.input.region: client shared memory is disabled on this server "
          "(shared_memory.allow_client_regions); send KV inline");
    }
    const v1::RegionRef& ref = header.input().region();
    PagedLayout pages;
    if (ref.has_paged()) {
      absl::StatusOr<PagedLayout> paged = PagedLayoutFromProto(
          ref, *layout, spec->num_layers, geometry.num_heads, geometry.head_dim,
          geometry.element_size, num_tokens, /*output=*/false, "header.input.region");
      if (!paged.ok()) return paged.status();
      pages = *std::move(paged);
    } else if (const int64_t expected = 2 * spec->num_layers * geometry.layer_bytes();
               ref.byte_size() != static_cast<uint64_t>(expected)) {
      return absl::InvalidArgumentError(absl::StrCat("header.input.region.byte_size=",
                                                     ref.byte_size(), " but the cache is ",
                                                     expected, " bytes"));
    }
    absl::StatusOr<SystemMemoryRegistry::Lease> region = system_memory_->Acquire(
        ref.region(), ref.offset(), ref.byte_size(), "header.input.region");
    if (!region.ok()) return region.status();
    if (stored > 0) {
      const LayerGeometry entry_layer{Layout::kNHD, spec->num_kv_heads, stored, spec->head_dim,
                                      geometry.element_size};
      for (int l = 0; l < spec->num_layers; ++l) {
        for (int kind = 0; kind < 2; ++kind) {
          char* dst = static_cast<char*>(kind == 0 ? (*pending)->k(l) : (*pending)->v(l));
          if (ref.has_paged()) {
            GatherPaged(pages, ref.paged().block_table().data(), kind,
                        region->data() + pages.LayerOffset(l), entry_layer, dst);
          } else {
            const char* src = region->data() + (2 * l + kind) * geometry.layer_bytes();
            CopyTokensToNhd(*layout, src, num_tokens, 0, stored, geometry.num_heads, head_bytes,
                            dst, 0);
          }
        }
      }
    }
    if (absl::Status intact = region->CheckIntact("header.input.region"); !intact.ok()) {
      return intact;
    }
    if (reader->Read(&message)) {
      return absl::InvalidArgumentError(
          "header.input.region is set: the stream must carry no chunks");
    }
  } else {
    CoverageTracker coverage(spec->num_layers, num_tokens);
    const ChunkExpectation expect{"chunk", absl::StrCat("model ", header.model()),
                                  spec->num_layers, geometry, *dtype, /*keys_only=*/false};
    while (reader->Read(&message)) {
      if (!message.has_chunk()) {
        return absl::InvalidArgumentError(
            "after the header a Publish stream carries only chunks (PublishRequest.chunk)");
      }
      const v1::KVChunk& chunk = message.chunk();
      absl::StatusOr<int> kind = CheckChunk(chunk, expect);
      if (!kind.ok()) return kind.status();
      if (absl::Status added =
              coverage.Add(chunk.layer(), *kind, chunk.token_start(), chunk.token_count());
          !added.ok()) {
        return added;
      }
      // Tokens past the last whole block are checked but not kept.
      const int64_t start = chunk.token_start();
      const int64_t keep = std::min<int64_t>(chunk.token_count(), stored - start);
      char* dst = static_cast<char*>(*kind == 0 ? (*pending)->k(chunk.layer())
                                                : (*pending)->v(chunk.layer()));
      CopyTokensToNhd(*layout, chunk.data().data(), chunk.token_count(), 0, keep,
                      geometry.num_heads, head_bytes, dst, start);
    }
    if (!coverage.Complete()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stream ended before every chunk arrived: ", coverage.FirstGap()));
    }
  }
  if (stored == 0) {
    response->set_block_tokens(cache_->block_tokens());
    return absl::OkStatus();  // shorter than one block: nothing to keep
  }
  if (!config_.limits.allow_non_finite) {
    // What would be stored, in the entry's own order: stored, a NaN would spread into every
    // model translated from it.
    CacheView entry{*dtype, Layout::kNHD, spec->num_kv_heads, spec->head_dim, stored, {}, {}};
    for (int l = 0; l < spec->num_layers; ++l) {
      entry.k.push_back((*pending)->k(l));
      entry.v.push_back((*pending)->v(l));
    }
    if (absl::Status finite = CheckFinite(
            entry, header.input().has_region() ? "header.input.region" : "chunk");
        !finite.ok()) {
      return finite;
    }
  }
  absl::StatusOr<PublishResult> result = cache_->Commit(std::move(*pending));
  if (!result.ok()) return result.status();
  // A sampled lookup's own prefill of the prefix: measured off the request path.
  if (verifier_ != nullptr) verifier_->OnPublish(result->entry);
  response->set_stored_tokens(static_cast<uint32_t>(stored));
  response->set_reused_blocks(static_cast<uint32_t>(result->reused_blocks));
  response->set_new_blocks(static_cast<uint32_t>(result->new_blocks));
  response->set_block_tokens(cache_->block_tokens());
  response->set_evicted_entries(static_cast<uint32_t>(result->evicted_entries));
  response->set_entry_bytes(static_cast<uint64_t>(result->entry_bytes));
  return absl::OkStatus();
}

grpc::Status PrefixCacheService::LookupPrefix(grpc::ServerContext* context,
                                              const v1::LookupPrefixRequest* request,
                                              v1::LookupPrefixResponse* response) {
  if (grpc::Status auth = Authorize(context, Role::kClient); !auth.ok()) return auth;
  const absl::Time start = absl::Now();
  absl::Status status = LookupImpl(*request, response);
  response->set_lookup_ms(Ms(absl::Now() - start));
  UpdateUsage();
  if (!status.ok()) {
    KVT_LOG(kWarning, "lookup failed")
        .With("request_id", request->request_id())
        .With("code", absl::StatusCodeToString(status.code()))
        .With("error", status.message());
    return ToGrpcStatus(status);
  }
  KVT_LOG(kInfo, "lookup done")
      .With("request_id", request->request_id())
      .With("target", request->target_model())
      .With("hit", response->hit())
      .With("miss_reason", response->miss_reason())
      .With("source", response->source_model())
      .With("mapper", response->mapper_id())
      .With("matched_tokens", response->matched_tokens());
  return grpc::Status::OK;
}

v1::GateVerdict PrefixCacheService::Gate(const std::shared_ptr<const LoadedMapper>& mapper,
                                         const PrefixMatch& match,
                                         const VerifiedMapper& version) {
  const KvtdConfig::PrefixCache& gate = config_.prefix_cache;
  const Manifest& manifest = mapper->manifest();
  // The recorded held-out quality, by the rule `kvt fit` records it with.
  const RecordedQuality recorded = MapperRecordedQuality(manifest);
  const std::optional<double>& quality = recorded.value;
  // A pair's own floor applies to whatever its mapper records; else the metric's default floor.
  auto floor = gate.pair_min_quality.find(PairKey(manifest.source.name, manifest.target.name));
  const bool cosine = absl::StartsWith(recorded.metric, "attention_cosine");
  const double min_quality = floor != gate.pair_min_quality.end()
                                 ? floor->second
                                 : (cosine ? gate.min_mapper_quality : gate.min_r2_heldout);
  v1::GateVerdict verdict;
  verdict.set_mapper_quality_metric(recorded.metric);
  verdict.set_mapper_quality(quality.value_or(0));
  verdict.set_min_mapper_quality(min_quality);
  verdict.set_max_input_shift(gate.max_input_shift);
  std::string reason;
  if (min_quality > 0 && !quality.has_value()) {
    reason = recorded.missing;
  } else if (quality.has_value() && *quality < min_quality) {
    reason = absl::StrCat("mapper ", recorded.description, " ", *quality, " < floor ",
                          min_quality);
  }
  const std::string benefit = BenefitGateReason(gate, manifest, &verdict);
  if (reason.empty()) reason = benefit;
  if (reason.empty() && gate.max_input_shift > 0) {
    std::shared_ptr<const InputShiftStats> stats = shift_stats_->Get(mapper);
    if (stats != nullptr) {
      const double score = stats->Score(match.entry->View(match.tokens), Positions{});
      verdict.set_input_shift_score(score);
      if (score > gate.max_input_shift) {
        reason = absl::StrCat("input-shift score ", score, " > prefix_cache.max_input_shift ",
                              gate.max_input_shift);
      }
    }
  }
  if (reason.empty() && verifier_ != nullptr) reason = verifier_->OutOfService(version);
  verdict.set_passed(reason.empty());
  verdict.set_reason(reason);
  return verdict;
}

absl::Status PrefixCacheService::LookupImpl(const v1::LookupPrefixRequest& request,
                                            v1::LookupPrefixResponse* response) {
  response->set_request_id(request.request_id());
  auto miss = [&](const char* reason, std::string detail) {
    response->set_hit(false);
    response->set_miss_reason(reason);
    response->set_detail(std::move(detail));
    return absl::OkStatus();
  };
  const std::vector<MapperInfo> served = ServedMappers(*store_);
  const std::string& target = request.target_model();
  const bool target_known = std::any_of(served.begin(), served.end(), [&](const MapperInfo& m) {
    return m.target_model == target;
  });
  // Labels stay bounded by the store: an unknown target is recorded as "unknown".
  const std::string target_label = target_known ? target : PairLabels::kUnknown;
  auto record = [&](const std::string& result) {
    if (metrics_ != nullptr) metrics_->RecordPrefixLookup(target_label, result);
  };
  if (target.empty()) return absl::InvalidArgumentError("target_model is empty");
  if (!v1::ReusePolicy_IsValid(request.policy())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy must be REUSE_POLICY_UNSPECIFIED, _AUTO, _FORBID or _FORCE, got ",
        static_cast<int>(request.policy())));
  }
  if (request.token_ids_size() == 0) return absl::InvalidArgumentError("token_ids is empty");
  if (cache_ == nullptr) {
    record("disabled");
    return miss("disabled", "the prefix cache is disabled on this server (prefix_cache.enabled)");
  }
  if (request.policy() == v1::REUSE_POLICY_FORBID) {
    record("forbidden");
    return miss("forbidden", "policy REUSE_POLICY_FORBID");
  }
  const int64_t max_tokens = request.max_tokens() == 0
                                 ? request.token_ids_size()
                                 : std::min<int64_t>(request.max_tokens(), request.token_ids_size());
  const int64_t min_tokens = std::max<int64_t>(request.min_tokens(), cache_->block_tokens());

  struct Candidate {
    const MapperInfo* mapper;
    PrefixMatch match;
  };
  std::vector<Candidate> found;
  for (const std::string& model : cache_->Models()) {
    if (model == target) continue;
    const MapperInfo* mapper = nullptr;
    for (const MapperInfo& info : served) {
      if (info.source_model != model || info.target_model != target) continue;
      if (!request.mapper_id().empty() && info.id != request.mapper_id()) continue;
      mapper = &info;
      break;
    }
    std::optional<PrefixMatch> match =
        cache_->Longest(model, absl::MakeConstSpan(request.token_ids().data(), request.token_ids_size()), max_tokens);
    if (!match.has_value()) continue;
    v1::PrefixCandidate* candidate = response->add_candidates();
    candidate->set_source_model(model);
    candidate->set_matched_tokens(static_cast<uint32_t>(match->tokens));
    if (mapper == nullptr) {
      candidate->set_rejected(request.mapper_id().empty()
                                  ? "no served mapper into the target"
                                  : "not the source of the requested mapper_id");
      continue;
    }
    candidate->set_mapper_id(mapper->id);
    if (match->tokens < min_tokens) {
      candidate->set_rejected(absl::StrCat("fewer than min_tokens=", min_tokens));
      continue;
    }
    found.push_back({mapper, std::move(*match)});
  }
  if (found.empty()) {
    bool any_prefix = response->candidates_size() > 0;
    bool any_mapper = false;
    for (const v1::PrefixCandidate& c : response->candidates()) any_mapper |= !c.mapper_id().empty();
    const char* reason = !any_prefix ? "no_prefix" : (any_mapper ? "too_short" : "no_mapper");
    record(reason);
    return miss(reason, !any_prefix
                            ? "no other model's stored cache shares a whole block with the prompt"
                            : "no stored prefix has a served mapper into the target of enough "
                              "tokens (see candidates)");
  }
  // Longest first; the gate decides among them.
  std::stable_sort(found.begin(), found.end(), [](const Candidate& a, const Candidate& b) {
    return a.match.tokens > b.match.tokens;
  });
  v1::GateVerdict first_verdict;
  for (Candidate& candidate : found) {
    absl::StatusOr<std::shared_ptr<const LoadedMapper>> mapper = store_->Get(candidate.mapper->id);
    if (!mapper.ok()) continue;  // unloaded or failed since the listing
    VerifiedMapper version;
    version.id = candidate.mapper->id;
    version.generation = candidate.mapper->generation;
    version.version = MapperVersionOf((*mapper)->weights_sha256(), version.generation);
    version.pair = PairLabels::Of((*mapper)->view());
    version.recorded = (*mapper)->manifest().quality.kv_cosine_heldout;
    const v1::GateVerdict verdict = Gate(*mapper, candidate.match, version);
    const std::string& reason = verdict.reason();
    if (&candidate == &found.front()) first_verdict = verdict;
    for (v1::PrefixCandidate& c : *response->mutable_candidates()) {
      if (c.source_model() == candidate.mapper->source_model && !reason.empty()) {
        c.set_rejected(absl::StrCat("gate: ", reason));
      }
    }
    const bool forced = request.policy() == v1::REUSE_POLICY_FORCE;
    if (!verdict.passed() && !forced) continue;
    const int64_t tokens = candidate.match.tokens;
    if (verdict.passed() && !forced && verifier_ != nullptr && verifier_->Sample(version)) {
      // A live verification sample: no lease; the engine prefills and publishes its own cache.
      verifier_->AddPending(version, candidate.match);
      response->set_hit(false);
      response->set_verify(true);
      response->set_miss_reason("verification_sample");
      response->set_detail(absl::StrCat(
          "live verification sample (one in ", verifier_->period(), " applicable lookups of "
          "mapper ", candidate.mapper->id, "): prefill and publish; kvtd compares the publish "
          "with its translation of the stored prefix"));
      response->set_source_model(candidate.mapper->source_model);
      response->set_mapper_id(candidate.mapper->id);
      response->set_matched_tokens(static_cast<uint32_t>(tokens));
      *response->mutable_gate() = verdict;
      record("verification_sample");
      return absl::OkStatus();
    }
    response->set_hit(true);
    response->set_source_model(candidate.mapper->source_model);
    response->set_mapper_id(candidate.mapper->id);
    response->set_matched_tokens(static_cast<uint32_t>(tokens));
    response->set_dtype(DTypeToProto(candidate.match.entry->shape().dtype));
    response->set_layout(v1::LAYOUT_NHD);
    response->set_lease_id(cache_->Lease(
        candidate.match, LeaseBinding{target, candidate.mapper->id, verdict.passed(), forced}));
    response->set_lease_seconds(config_.prefix_cache.lease_seconds);
    *response->mutable_gate() = verdict;
    if (forced && !verdict.passed()) {
      response->set_detail(absl::StrCat("gate failed but policy REUSE_POLICY_FORCE: ", reason));
    }
    record("hit");
    if (metrics_ != nullptr) {
      metrics_->RecordPrefixReuse(PairLabels::Of((*mapper)->view()), tokens);
    }
    return absl::OkStatus();
  }
  *response->mutable_gate() = first_verdict;
  const char* reason =
      absl::StartsWith(first_verdict.reason(), "live_quality") ? "live_quality" : "gate";
  record(reason);
  return miss(reason, absl::StrCat("quality gate: ", first_verdict.reason()));
}

grpc::Status PrefixCacheService::ListPrefixes(grpc::ServerContext* context,
                                              const v1::ListPrefixesRequest* request,
                                              v1::ListPrefixesResponse* response) {
  if (grpc::Status auth = Authorize(context, Role::kAdmin); !auth.ok()) return auth;
  if (cache_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "the prefix cache is disabled on this server (prefix_cache.enabled)");
  }
  for (const EntryInfo& info : cache_->List(request->model())) {
    v1::PrefixEntryInfo* out = response->add_entries();
    out->set_entry_id(info.id);
    out->set_model(info.model);
    out->set_num_tokens(static_cast<uint32_t>(info.num_tokens));
    out->set_dtype(DTypeToProto(info.dtype));
    out->set_bytes(static_cast<uint64_t>(info.bytes));
    out->set_created_unix_ms(absl::ToUnixMillis(info.created));
    out->set_last_used_unix_ms(absl::ToUnixMillis(info.last_used));
    out->set_expires_unix_ms(absl::ToUnixMillis(info.expires));
    out->set_hits(info.hits);
    out->set_leases(static_cast<uint32_t>(info.leases));
    out->set_first_block_hash(info.first_block_hash);
  }
  response->set_bytes_held(static_cast<uint64_t>(cache_->stats().bytes_held));
  response->set_max_bytes(static_cast<uint64_t>(cache_->max_bytes()));
  response->set_block_tokens(static_cast<uint32_t>(cache_->block_tokens()));
  return grpc::Status::OK;
}

grpc::Status PrefixCacheService::EvictPrefixes(grpc::ServerContext* context,
                                               const v1::EvictPrefixesRequest* request,
                                               v1::EvictPrefixesResponse* response) {
  if (grpc::Status auth = Authorize(context, Role::kAdmin); !auth.ok()) return auth;
  if (cache_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "the prefix cache is disabled on this server (prefix_cache.enabled)");
  }
  const EvictResult result = cache_->Evict(request->model(), request->entry_id());
  response->set_evicted_entries(static_cast<uint32_t>(result.evicted_entries));
  response->set_evicted_bytes(static_cast<uint64_t>(result.evicted_bytes));
  UpdateUsage();
  KVT_LOG(kInfo, "prefixes evicted")
      .With("model", request->model())
      .With("entry_id", request->entry_id())
      .With("entries", result.evicted_entries)
      .With("bytes", result.evicted_bytes);
  return grpc::Status::OK;
}

namespace {

void FillVerification(const VerificationState& state, double tolerance,
                      v1::MapperVerification* out) {
  out->set_mapper_id(state.mapper.id);
  out->set_generation(state.mapper.generation);
  out->set_version(state.mapper.version);
  out->set_source_model(state.mapper.pair.source());
  out->set_target_model(state.mapper.pair.target());
  if (state.mapper.recorded) out->set_recorded(*state.mapper.recorded);
  out->set_tolerance(tolerance);
  out->set_samples(static_cast<uint32_t>(state.samples));
  if (state.live) out->set_live(*state.live);
  out->set_out_of_service(state.out_of_service);
  out->set_reason(state.reason);
}

constexpr char kVerifyOff[] =
    "live verification is off on this server (prefix_cache.enabled, "
    "prefix_cache.verify_sample_fraction)";

}  // namespace

grpc::Status PrefixCacheService::ListVerifications(grpc::ServerContext* context,
                                                   const v1::ListVerificationsRequest*,
                                                   v1::ListVerificationsResponse* response) {
  if (grpc::Status auth = Authorize(context, Role::kAdmin); !auth.ok()) return auth;
  if (verifier_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, kVerifyOff);
  }
  for (const VerificationState& state : verifier_->List()) {
    FillVerification(state, config_.prefix_cache.verify_tolerance, response->add_mappers());
  }
  response->set_pending(static_cast<uint32_t>(verifier_->pending()));
  return grpc::Status::OK;
}

grpc::Status PrefixCacheService::RestoreMapper(grpc::ServerContext* context,
                                               const v1::RestoreMapperRequest* request,
                                               v1::RestoreMapperResponse* response) {
  if (grpc::Status auth = Authorize(context, Role::kAdmin); !auth.ok()) return auth;
  if (verifier_ == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, kVerifyOff);
  }
  if (request->mapper_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "mapper_id is required");
  }
  absl::StatusOr<std::pair<bool, VerificationState>> restored =
      verifier_->Restore(request->mapper_id());
  if (!restored.ok()) return ToGrpcStatus(restored.status());
  response->set_restored(restored->first);
  FillVerification(restored->second, config_.prefix_cache.verify_tolerance,
                   response->mutable_verification());
  return grpc::Status::OK;
}

}  // namespace kvt
