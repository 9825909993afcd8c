"""The connector's counters: KvtConnectorStats (vLLM's connector stats, summed over the scheduler
and the workers) and their Prometheus counters vllm:kvt_<name>_total on vLLM's /metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                    KVConnectorStats)

_COUNTERS = ("requests", "lookups", "digest_misses", "lookup_errors", "hits", "applied",
             "fallback_reprefill", "unsupported", "tokens_reused", "load_failures", "publishes",
             "publish_dropped", "publish_coalesced", "publish_failed", "publish_skipped",
             "publish_bytes", "publishes_in_place",
             "publishes_shm", "publish_region_full", "verification_samples",
             # The cluster tier (kv_connector_extra_config.cluster; docs/CLUSTER_TIER.md).
             # lookups / hits above are kvtd's (the node-local tier).
             "cluster_lookups", "cluster_hits", "cluster_misses", "cluster_fetches",
             "cluster_fetch_bytes", "cluster_fetch_us", "applied_cluster", "cluster_puts",
             "cluster_put_objects", "cluster_put_failed", "cluster_put_skipped") + tuple(
                 f"cluster_error_{reason}" for reason in (
                     # kvt.cluster.REASONS (not imported: the tier may be off), and the
                     # connector's own recently_failed is not an error of the store.
                     "store_unavailable", "segment_unavailable", "store_timeout", "evicted",
                     "version_mismatch", "store_full", "store_error"))


@dataclass
class KvtConnectorStats(KVConnectorStats):
    """Counters since the last interval (sums across workers and the scheduler)."""

    def __post_init__(self) -> None:
        for name in _COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = {name: 0 for name in _COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "KvtConnectorStats":
        for name, value in (other.data or {}).items():
            if isinstance(value, (int, float)):
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> Dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in _COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in _COUNTERS)

    def add(self, name: str, value: int = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value


_COUNTER_HELP = {
    "requests": "Requests the KvtConnector saw.",
    "lookups": "LookupPrefix calls to kvtd.",
    "digest_misses": "Requests kvtd's prefix digest showed to be misses (no LookupPrefix sent).",
    "lookup_errors": "LookupPrefix calls that failed (kvtd down, deadline, any error).",
    "hits": "Lookups that found a translatable prefix.",
    "applied": "Requests that finished with outcome applied.",
    "fallback_reprefill": "Requests that finished with outcome fallback_reprefill.",
    "unsupported": "Requests that finished with outcome unsupported.",
    "tokens_reused": "Prompt tokens loaded from translated prefixes.",
    "load_failures": "Translated loads that failed (vLLM recomputed the request).",
    "publishes": "Caches published to kvtd.",
    "publish_dropped": "Publishes dropped because the publish queue was full.",
    "publish_coalesced": "Prompt publishes still queued when their request's final publish "
                         "came, which took their place (one publish instead of two).",
    "publish_failed": "Publishes that failed.",
    "publish_skipped": "Publishes not sent because kvtd said lately that no mapper reads this "
                       "model.",
    "publish_bytes": "Bytes of KV published to kvtd.",
    "publishes_in_place": "Publishes kvtd read straight out of the engine's own shared KV "
                          "cache (nothing copied in the engine).",
    "publishes_shm": "Publishes kvtd read from the worker's shared-memory region (no inline "
                     "chunks).",
    "publish_region_full": "Publishes sent inline because the publish region had no room.",
    "verification_samples": "Lookups kvtd answered with a live verification sample (the "
                            "request prefilled itself; outcome fallback_reprefill, reason "
                            "verification_sample).",
    "cluster_lookups": "Store lookups (longest_prefix) after kvtd missed or matched less.",
    "cluster_hits": "Store lookups that found a longer prefix than kvtd (a fetch followed).",
    "cluster_misses": "Store lookups that found nothing longer than kvtd.",
    "cluster_fetches": "Prefixes fetched from the store into kvtd.",
    "cluster_fetch_bytes": "Bytes of source KV fetched from the store.",
    "cluster_fetch_us": "Microseconds spent in store fetches (divide by cluster_fetches).",
    "applied_cluster": "Requests applied with a prefix fetched from the store.",
    "cluster_puts": "Published prefixes put into the store.",
    "cluster_put_objects": "Store objects written by puts (objects already held are not).",
    "cluster_put_failed": "Puts into the store that failed.",
    "cluster_put_skipped": "Puts not tried (store client not set up, or a put past its "
                           "deadline still running).",
}
for _reason in ("store_unavailable", "segment_unavailable", "store_timeout", "evicted",
                "version_mismatch", "store_full", "store_error"):
    _COUNTER_HELP[f"cluster_error_{_reason}"] = f"Cluster-tier calls that failed: {_reason}."


class KvtPromMetrics(KVConnectorPromMetrics):
    """vllm:kvt_<counter>_total on vLLM's /metrics, one per KvtConnectorStats counter."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: Dict[str, Dict[int, Any]] = {}
        for name in _COUNTERS:
            counter = self._counter_cls(name=f"vllm:kvt_{name}_total",
                                        documentation=_COUNTER_HELP[name],
                                        labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
