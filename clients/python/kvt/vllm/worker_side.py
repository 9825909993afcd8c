"""The connector's worker side (model runner process): translated loads into the request's blocks,
publishes of the engine's KV, and the shared-memory regions both use. Nothing here waits on kvtd
inside an engine step: loads run on a pool, publishes on the publisher thread."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Set

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvt.vllm.engine_cache import engine_block_order, share_in_place
from kvt.vllm.engine_kv import EngineKv
from kvt.vllm.loads import TranslatedLoad
from kvt.vllm.metadata import KvtConnectorMetadata, KvtWorkerMetadata, LoadResult, LoadSpec
from kvt.vllm.options import ConnectorConfig
from kvt.vllm.publisher import Publisher
from kvt.vllm.regions import PublishRing, WorkerRegion

logger = logging.getLogger("vllm.kvt")

# How long a fence (a preempted request's blocks about to be reused) waits for that request's
# publishes; kvtd reads a publish in milliseconds, so only a stuck kvtd reaches it.
_FENCE_TIMEOUT_S = 10.0


class KvtWorker:
    """`kvt()`: the connection to kvtd (client, PrefixCache); `count(name, value)`: counters."""

    def __init__(self, config: ConnectorConfig, num_kv_heads: int, head_dim: int, dtype: str,
                 max_model_len: int, kvt: Callable[[], Any], count: Callable[..., None]) -> None:
        self.config = config
        self.kvt = kvt
        self._count = count
        self._num_kv_heads = num_kv_heads
        self._head_dim = head_dim
        self._dtype = dtype
        self._max_model_len = max_model_len
        self.kv: Optional[EngineKv] = None
        # Shared memory (kvt/vllm/regions.py), made in register_kv_caches; None: not used.
        self.load_region: Optional[WorkerRegion] = None
        self.publish_region: Optional[WorkerRegion] = None
        self.publish_ring: Optional[PublishRing] = None
        # The engine's cache shared in place, and its EngineBlockOrder fields.
        self.engine_region: Optional[WorkerRegion] = None
        self.engine_order: Optional[Dict[str, Any]] = None
        self._lock = threading.Lock()
        self._load_done = threading.Condition(self._lock)
        self._loads_running: Set[str] = set()    # guarded by _lock
        self._loads_done: Dict[str, LoadResult] = {}  # guarded by _lock
        self._load_pool = ThreadPoolExecutor(max_workers=config.load_threads,
                                             thread_name_prefix="kvt-load")
        # The cluster tier's puts (kvt/vllm/cluster_tier.py), made only when configured.
        self.cluster_put: Any = None
        if config.cluster is not None and config.cluster.put:
            from kvt.vllm.cluster_tier import ClusterPut
            self.cluster_put = ClusterPut(config.cluster, config.model_name, count)
        self.publisher = Publisher(self, config.publish_queue_size, count,
                                   delay_s=config.publish_delay_ms / 1e3)
        self._releases: Set[str] = set()  # finished requests whose blocks vLLM holds for us
        self._failed_this_step: Set[str] = set()
        self._reported: Dict[str, LoadResult] = {}

    # -- set-up --------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        self.kv = kv = EngineKv(kv_caches, self._num_kv_heads, self._head_dim, self._dtype)
        first = kv.paged[0]
        logger.info("kvt: %d attention layers, paged layout %s (ISA %s), block size %d, %s "
                    "copies", kv.num_layers, first.kind, first.isa or "-", first.block_size,
                    "block" if kv.block_views[0] is not None else "indexed")
        if self.config.transport == "inline":
            return
        request_bytes = kv.cache_bytes(self._max_model_len)
        warn = self.config.transport == "shm"
        client_fn = lambda: self.kvt()[0]  # noqa: E731
        self.load_region = WorkerRegion(client_fn, request_bytes, "translated loads", warn)
        ring = self.config.publish_region_bytes or min(4 * request_bytes, 256 << 20)
        self.publish_region = WorkerRegion(client_fn, ring, "publishes", warn)
        self.publish_ring = PublishRing(ring)
        if self.config.load_in_place and kv.host is not None:
            self._share_engine_cache(client_fn, warn)

    def _share_engine_cache(self, client_fn: Callable[[], Any], warn: bool) -> None:
        """Makes the engine's KV cache a shared-memory region kvtd writes loads into and reads
        publishes out of (before the engine's first step); on any refusal the regions above
        serve instead."""
        kv = self.kv
        assert kv is not None
        first = kv.paged[0]
        try:
            if any(layout.affine_kv != first.affine_kv for layout in kv.paged):
                raise ValueError("the layers' block orders differ")
            if None in first.affine_kv:  # refused before the cache moves, not after
                raise ValueError(f"the kernel's order within a block (ISA {first.isa}) is not "
                                 "affine")
            memory = share_in_place(kv.tensors)
            try:
                order = engine_block_order(memory, kv.tensors, first.affine_kv,
                                           first.block_elems)
            except BaseException:
                memory.close()
                raise
        except Exception as error:
            (logger.warning if warn else logger.info)(
                "kvt: the engine's KV cache stays private (%s); loads and publishes go through "
                "regions of their own", error)
            return
        self.engine_order = order
        # An older kvtd would ignore engine_order and the token range: never registered with
        # one (the extension is asked after each registration).
        self.engine_region = WorkerRegion(client_fn, memory.byte_size, "in-place loads and "
                                          "publishes", warn, memory=memory,
                                          requires="paged_engine_order")
        logger.info("kvt: the engine's KV cache (%d bytes) is shared with kvtd (%s): loads "
                    "and publishes use its blocks in place", memory.byte_size, memory.key)

    def fill_paged_ref(self, paged: Any, block_ids: List[int], start: int, end: int,
                       output: bool) -> None:
        """RegionRef.paged for tokens [start, end) of a request's blocks in the engine's
        shared cache (the kernels' own order); `output`: a load's token range."""
        kv = self.kv
        assert kv is not None and self.engine_order is not None
        layout = kv.paged[0]
        paged.num_blocks, paged.block_size = layout.num_blocks, layout.block_size
        paged.block_table.extend(block_ids[:-(-end // layout.block_size)])
        if output:
            paged.first_token, paged.end_token = start, end
        order = self.engine_order
        paged.engine_order.layer_offsets.extend(order["layer_offsets"])
        paged.engine_order.block_stride = order["block_stride"]
        for kind in ("k", "v"):
            for name, value in order[kind].items():
                setattr(getattr(paged.engine_order, kind), name, value)

    # -- the engine step -----------------------------------------------------------------------

    def start_load_kv(self, meta: KvtConnectorMetadata) -> None:
        """Before the step's forward: fence, releases, and the loads to start."""
        if not (meta.fence or meta.releases or meta.loads):
            return
        if meta.fence and not self.publisher.wait_for(meta.fence, _FENCE_TIMEOUT_S, hurry=True):
            logger.error("kvt: publishes of preempted requests %s still read their blocks "
                         "after %.0f s", sorted(meta.fence), _FENCE_TIMEOUT_S)
        self._releases.update(meta.releases)
        for spec in meta.loads:
            with self._lock:
                self._loads_running.add(spec.req_id)
            self._load_pool.submit(self._run_load, spec)

    def wait_for_save(self, meta: KvtConnectorMetadata) -> None:
        """After the step's forward: queue its publishes (the publisher thread reads them)."""
        for spec in meta.publishes:
            if not spec.final and spec.req_id in self._failed_this_step:
                continue  # its blocks hold a failed load; the final publish covers it
            self.publisher.submit(spec)

    def get_transfer_results(self, meta: Optional[KvtConnectorMetadata]
                             ) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        # Most steps have nothing to report: read without the lock (a load that ends meanwhile
        # is reported next step; _run_load fills _loads_done before it empties _loads_running).
        if not (self._loads_running or self._loads_done or self._releases
                or self._failed_this_step):
            return results
        idle_wait_s = self.config.idle_wait_ms / 1e3
        with self._lock:
            if (idle_wait_s > 0 and meta is not None and meta.idle and self._loads_running
                    and not self._loads_done):
                # Releases the GIL until a load ends (notified in _run_load) or the bound.
                self._load_done.wait(timeout=idle_wait_s)
            loads_pending = bool(self._loads_running)
            done, self._loads_done = self._loads_done, {}
        if (idle_wait_s > 0 and meta is not None and meta.idle and not done
                and not loads_pending and self._releases):
            # An empty step that only waits for held blocks: let the publisher finish instead
            # of spinning the engine loop beside it.
            self.publisher.wait_for(self._releases, idle_wait_s)
        self._failed_this_step = {r for r, result in done.items() if not result.ok}
        results.finished_recving = set(done)
        results.failed_recving = set(self._failed_this_step)
        self._reported.update(done)
        released = {r for r in self._releases if not self.publisher.busy(r)}
        self._releases -= released
        results.finished_sending = released
        return results

    def build_worker_meta(self) -> Optional[KvtWorkerMetadata]:
        if not self._reported:
            return None
        reported, self._reported = self._reported, {}
        return KvtWorkerMetadata(loads=reported)

    def _run_load(self, spec: LoadSpec) -> None:
        result = TranslatedLoad(self, spec).run()
        with self._lock:
            self._loads_done[spec.req_id] = result
            self._loads_running.discard(spec.req_id)
            self._load_done.notify_all()
        if not result.ok:
            logger.warning("kvt: load of %s failed, vLLM recomputes it: %s", spec.req_id,
                           result.error)

    def shutdown(self) -> None:
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self.publisher.close()
        for region in (self.load_region, self.publish_region, self.engine_region):
            if region is not None:
                region.close()
