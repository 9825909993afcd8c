"""KvtConnector: a vLLM V1 KV connector that publishes each engine's KV to kvtd and reuses a prefix
that another member of the model family published, translated by kvtd (docs/VLLM.md).

A thin facade over the two roles vLLM instantiates it in, each readable on its own:

  scheduler side (kvt/vllm/scheduler_side.py, engine core process): the reuse decision per
    request (LookupPrefix on a thread of its own), the cache salt, the per-step metadata and the
    outcome every request ends with;
  worker side (kvt/vllm/worker_side.py, model runner process): translated loads on a pool
    (kvt/vllm/loads.py) and publishes on a thread (kvt/vllm/publisher.py), both reading and
    writing the engine's own blocks in place when its cache is shared with kvtd.

They talk through typed metadata (kvt/vllm/metadata.py). Nothing waits on kvtd inside an engine
step: a request the connector does not help costs what it costs without it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                 KVConnectorMetadata,
                                                                 KVConnectorRole,
                                                                 KVConnectorTransferResults,
                                                                 KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvt.vllm.engine_kv import TORCH_DTYPE_NAMES
from kvt.vllm.metadata import KvtConnectorMetadata, KvtWorkerMetadata
from kvt.vllm.options import (ConnectorConfig, parse_kv_transfer_params,
                              validate_kv_transfer_params)
from kvt.vllm.scheduler_side import KvtScheduler
from kvt.vllm.stats import KvtConnectorStats, KvtPromMetrics
from kvt.vllm.worker_side import KvtWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvtConnector", "KvtConnectorMetadata", "KvtConnectorStats", "KvtWorkerMetadata",
           "parse_kv_transfer_params", "validate_kv_transfer_params"]

logger = logging.getLogger("vllm.kvt")


class KvtdLink:
    """The process's connection to kvtd (kvt.Client and its PrefixCache), made on first use."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._lock = threading.Lock()
        self.client: Any = None
        self._prefix: Any = None

    def __call__(self) -> Tuple[Any, Any]:
        with self._lock:
            if self.client is None:
                import kvt
                from kvt.prefix import PrefixCache
                self.client = kvt.Client(self._address, timeout=None, channel_options=[
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)])
                self._prefix = PrefixCache(self.client)
            return self.client, self._prefix

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class KvtConnector(KVConnectorBase_V1):
    """See the module docstring and docs/VLLM.md."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._link = KvtdLink(self.config.kvtd_address)
        self._stats = KvtConnectorStats()
        self._stats_lock = threading.Lock()
        self._stats_counted = False  # vLLM asks for stats twice a step; most steps count nothing
        self._scheduler: Optional[KvtScheduler] = None
        self._worker: Optional[KvtWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            # A failed load must never fail a request: vLLM then recomputes (0.32's default
            # policy is "fail").
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.info("kvt: setting kv_load_failure_policy=recompute (a failed "
                            "translation falls back to prefill)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
        model = vllm_config.model_config
        dtype = (TORCH_DTYPE_NAMES.get(model.dtype, "fp32") if isinstance(model.dtype, torch.dtype)
                 else "fp32")
        if role == KVConnectorRole.SCHEDULER:
            cluster = None
            if self.config.cluster is not None:
                # Only with a cluster section: kvt.cluster (and Mooncake) are never imported
                # otherwise.
                from kvt.vllm.cluster_tier import ClusterLookup
                cluster = ClusterLookup(self.config.cluster, self.config.model_name, dtype,
                                        self.config.block_tokens, self._link, self._count)
            self._scheduler = KvtScheduler(self.config, vllm_config.cache_config.block_size,
                                           self._link, self._count, cluster)
        else:
            self._worker = KvtWorker(
                self.config, model.get_num_kv_heads(vllm_config.parallel_config),
                model.get_head_size(), dtype, model.max_model_len, self._link, self._count)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # publishing is best effort: a dropped publish is a future miss

    # -- counters ------------------------------------------------------------------------------

    def _count(self, name: str, value: int = 1) -> None:
        with self._stats_lock:
            self._stats.add(name, value)
            self._stats_counted = True

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if not self._stats_counted:  # read without the lock: a count racing it goes next step
            return None
        with self._stats_lock:
            self._stats_counted = False
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvtConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> Optional[KVConnectorStats]:
        return KvtConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]) -> KvtPromMetrics:
        return KvtPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        self._link.close()

    # -- scheduler side ------------------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output, self._block_ids)

    def _block_ids(self, req_id: str) -> List[int]:
        manager = self._kv_cache_manager
        return list(manager.get_block_ids(req_id)[0]) if manager is not None else []

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: "Request", block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------------------

    def _meta(self) -> Optional[KvtConnectorMetadata]:
        meta = self._connector_metadata
        return meta if isinstance(meta, KvtConnectorMetadata) else None

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None and self._worker is not None:
            self._worker.start_load_kv(meta)

    def has_connector_metadata(self) -> bool:
        # vLLM asks this for every attention layer of every step, and calls the two per-layer
        # hooks below when it is true; this connector has no per-layer work, so it skips them.
        return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM does not schedule a request before they finish

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # publishes read the blocks after the step, on the publisher thread

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None and self._worker is not None:
            self._worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.get_transfer_results(self._meta())

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        return self._worker.build_worker_meta() if self._worker is not None else None
