"""KvtConnector: a vLLM V1 KV connector that publishes each engine's KV to kvtd and reuses a prefix
that another member of the model family published, translated by kvtd (issue 19; docs/VLLM.md).

Scheduler side (engine core process):
  * on_new_request parses kv_transfer_params["kvt"] ({"reuse": "auto"|"forbid"|"force",
    "mapper_id": ..., "min_tokens": ...}); a bad key or value makes the request's outcome
    "unsupported" with the key named (it is then served as a plain request; raising here would
    kill the engine core).
  * get_num_new_matched_tokens runs LookupPrefix on a thread of its own (the scheduler loop never
    waits on kvtd: it answers None, "ask again", until the lookup is back or its deadline
    passed), never counting the prompt's last token and only whole vLLM blocks beyond the local
    prefix-cache hit. A hit is loaded asynchronously (the request waits in
    WAITING_FOR_REMOTE_KVS while other requests keep decoding).
  * request_finished returns kv_transfer_params {"kvt": {"outcome": ...}} (the request output
    carries it), logs one JSON line, and holds the blocks until the worker has copied the
    request's prompt + generated KV for the final publish.

Worker side (model runner process):
  * start_load_kv starts TranslateKV on the lease; target chunks are written into the request's
    blocks layer by layer as they arrive; get_transfer_results reports the load done or failed
    (vLLM's recompute policy then prefills the request as if nothing had been loaded).
  * wait_for_save copies the prompt blocks of requests whose prefill ended this step (and the
    final blocks of finished requests) out of the paged cache and queues them for a publisher
    thread (bounded queue: a full queue drops the publish and counts it).

Translated blocks never serve as exact prefix-cache hits of a plain request unless
allow_translated_prefix_cache is set: a request that applies a translated prefix gets a cache
salt ("kvt-translated:<mapper>") before its blocks are cached, so its block hashes (and those of
everything it computes after the prefix) differ from a plain request's.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                 KVConnectorMetadata,
                                                                 KVConnectorRole,
                                                                 KVConnectorTransferResults,
                                                                 KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                    KVConnectorStats)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvt.vllm.engine_cache import engine_block_order, share_in_place
from kvt.vllm.paged import PagedLayout, gather_rows, gather_tokens, layer_order, scatter_rows
from kvt.vllm.regions import PublishRing, WorkerRegion
from kvt.vllm.regions import describe_error as _describe

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvt")

_TORCH_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# kv_connector_extra_config keys and their defaults (docs/VLLM.md lists them).
DEFAULTS: Dict[str, Any] = {
    "kvtd_address": None,               # required: "host:port" or "unix:/path"
    "model_name": None,                 # required: the model's name in mapper manifests
    "lookup_timeout_s": 0.5,            # LookupPrefix deadline
    "lookup_wait_s": 0.005,             # how long the scheduler waits for a lookup in line
    "translate_timeout_s": 10.0,        # TranslateKV deadline (whole stream)
    # Translated KV back from kvtd: "auto" (a shared-memory region when kvtd accepts one, else
    # inline chunks), "shm" (the same, with a warning when it cannot), "inline".
    "transport": "auto",
    "publish_timeout_s": 30.0,          # Publish deadline
    "publish": True,                    # publish after prefill
    "publish_final": True,              # publish prompt + generated when a request ends
    "publish_queue_size": 8,            # pending publishes; beyond it they are dropped
    # Bytes of the shared-memory region publishes are copied into for kvtd to read (transport
    # auto/shm); a publish that does not fit in what is free goes inline. 0: four requests of
    # max_model_len tokens, at most 256 MiB.
    "publish_region_bytes": 0,
    "block_tokens": 16,                 # kvtd's prefix_cache.block_tokens
    "min_reuse_tokens": 0,              # 0 = one vLLM block
    "reuse": "auto",                    # default policy of requests without kvt params
    "allow_translated_prefix_cache": False,  # the hazard opt-in (docs/VLLM.md)
    "log_outcomes": True,               # one JSON log line per request
    # In an engine step with no tokens to compute while translated loads are in flight, the
    # worker waits up to this long for one to finish instead of returning at once: vLLM's engine
    # loop otherwise spins on empty steps, holding the GIL the load thread needs and a core
    # kvtd's translation needs (docs/VLLM.md, "Time to first token"). Bounds the delay a newly
    # arriving request can see in such a step; 0 turns the wait off.
    "idle_wait_ms": 5.0,
    "load_threads": 2,                  # concurrent translated loads per worker
    # With a shared-memory load, ask kvtd for a notice per layer and kind as it lands in the
    # region and copy each into the blocks while kvtd computes the next; off: one copy of all
    # layers after the trailer (fewer messages through gRPC and the GIL; docs/VLLM.md).
    "layer_notices": True,
    # Transport auto/shm on a CPU engine: share the engine's own KV cache with kvtd, in place
    # (kvt/vllm/engine_cache.py), so kvtd writes translated prefixes straight into the
    # request's blocks and the worker copies nothing; falls back to the region above when the
    # cache cannot be shared. Used only with a kvtd that lists "paged_engine_order" in
    # ServerMetadata (RegionRef.paged.engine_order); with an older one loads take the load region.
    "load_in_place": True,
}

_PARAM_KEYS = {"reuse", "mapper_id", "min_tokens", "load"}
_POLICIES = ("auto", "forbid", "force")
# How a request's translated prefix reaches its blocks: "auto" (in place when the engine's
# cache is shared, else the load region, else inline), "region" (never in place), "inline".
_LOADS = ("auto", "region", "inline")


# -- kv_transfer_params -----------------------------------------------------------------------

def parse_kv_transfer_params(params: Any, default_reuse: str = "auto") -> Dict[str, Any]:
    """The kvt options of a request's kv_transfer_params ({"kvt": {...}}): reuse, mapper_id,
    min_tokens, load. Raises ValueError naming the offending key."""
    out = {"reuse": default_reuse, "mapper_id": "", "min_tokens": 0, "load": "auto"}
    if params is None:
        return out
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params: expected an object, got {type(params).__name__}")
    kvt = params.get("kvt")
    if kvt is None:
        return out
    if not isinstance(kvt, dict):
        raise ValueError(f"kv_transfer_params.kvt: expected an object, got {type(kvt).__name__}")
    for key in kvt:
        if key not in _PARAM_KEYS:
            raise ValueError(f"kv_transfer_params.kvt.{key}: unknown key (known: "
                             f"{', '.join(sorted(_PARAM_KEYS))})")
    if "reuse" in kvt:
        reuse = kvt["reuse"]
        if not isinstance(reuse, str) or reuse not in _POLICIES:
            raise ValueError(f"kv_transfer_params.kvt.reuse: {reuse!r} is not one of "
                             f"{', '.join(_POLICIES)}")
        out["reuse"] = reuse
    if "mapper_id" in kvt:
        mapper_id = kvt["mapper_id"]
        if not isinstance(mapper_id, str) or not mapper_id:
            raise ValueError(f"kv_transfer_params.kvt.mapper_id: {mapper_id!r} is not a "
                             "non-empty string")
        out["mapper_id"] = mapper_id
    if "min_tokens" in kvt:
        value = kvt["min_tokens"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"kv_transfer_params.kvt.min_tokens: {value!r} is not an "
                             "integer >= 0")
        out["min_tokens"] = value
    if "load" in kvt:
        load = kvt["load"]
        if not isinstance(load, str) or load not in _LOADS:
            raise ValueError(f"kv_transfer_params.kvt.load: {load!r} is not one of "
                             f"{', '.join(_LOADS)}")
        out["load"] = load
    return out


def validate_kv_transfer_params(params: Any) -> None:
    """Client-side check before submitting a request (raises ValueError naming the key)."""
    parse_kv_transfer_params(params)


# -- stats ------------------------------------------------------------------------------------

_COUNTERS = ("requests", "lookups", "lookup_errors", "hits", "applied", "fallback_reprefill",
             "unsupported", "tokens_reused", "load_failures", "publishes", "publish_dropped",
             "publish_failed", "publish_bytes", "publishes_shm", "publish_region_full")


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
    "lookup_errors": "LookupPrefix calls that failed (kvtd down, deadline, any error).",
    "hits": "Lookups that found a translatable prefix.",
    "applied": "Requests that finished with outcome applied.",
    "fallback_reprefill": "Requests that finished with outcome fallback_reprefill.",
    "unsupported": "Requests that finished with outcome unsupported.",
    "tokens_reused": "Prompt tokens loaded from translated prefixes.",
    "load_failures": "Translated loads that failed (vLLM recomputed the request).",
    "publishes": "Caches published to kvtd.",
    "publish_dropped": "Publishes dropped because the publish queue was full.",
    "publish_failed": "Publishes that failed.",
    "publish_bytes": "Bytes of KV published to kvtd.",
    "publishes_shm": "Publishes kvtd read from the worker's shared-memory region (no inline "
                     "chunks).",
    "publish_region_full": "Publishes sent inline because the publish region had no room.",
}


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


# -- metadata ---------------------------------------------------------------------------------

@dataclass
class KvtConnectorMetadata(KVConnectorMetadata):
    # Loads to start: {req_id, lease_id, mapper_id, matched_tokens, dtype, start, end, block_ids}
    loads: List[Dict[str, Any]] = field(default_factory=list)
    # Copies to publish: {req_id, kind "prompt"|"final", token_ids, block_ids}
    publishes: List[Dict[str, Any]] = field(default_factory=list)
    # The step computes no tokens (only connector work): the worker may wait for loads.
    idle: bool = False


@dataclass
class KvtWorkerMetadata(KVConnectorWorkerMetadata):
    # req_id -> {"ok": bool, "error": str, "translate_ms", "load_ms", "kvtd": {...}}
    loads: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvtWorkerMetadata":
        assert isinstance(other, KvtWorkerMetadata)
        for req_id, result in other.loads.items():
            mine = self.loads.get(req_id)
            if mine is None or (mine.get("ok") and not result.get("ok")):
                self.loads[req_id] = result  # a failure on any worker fails the load
        return self


@dataclass
class _Request:
    """Scheduler-side state of one request."""
    request: Any
    options: Dict[str, Any]
    outcome: Dict[str, Any]
    lookup: Optional[Future] = None
    lookup_started: float = 0.0
    lookup_ms: float = 0.0
    decided: bool = False        # the reuse decision is made (ext tokens fixed)
    ext_tokens: int = 0          # tokens this connector loads
    load: Optional[Dict[str, Any]] = None
    load_sent: bool = False
    prompt_published: bool = False
    salted: bool = False
    orig_salt: Optional[str] = None
    orig_hashes: Optional[list] = None


class _LookupClock:
    """Done-callback of a lookup future: records its round trip on the request's state."""

    def __init__(self, st: _Request) -> None:
        self.st = st

    def __call__(self, _future: "Future[Any]") -> None:
        self.st.lookup_ms = (time.monotonic() - self.st.lookup_started) * 1e3


class KvtConnector(KVConnectorBase_V1):
    """See the module docstring and docs/VLLM.md."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(DEFAULTS))})")
        self.config = {**DEFAULTS, **extra}
        for key in ("kvtd_address", "model_name"):
            if not self.config[key]:
                raise ValueError(f"kv_connector_extra_config.{key} is required")
        if self.config["transport"] not in ("auto", "shm", "inline"):
            raise ValueError(f"kv_connector_extra_config.transport: "
                             f"{self.config['transport']!r} is not auto, shm or inline")
        if self.config["reuse"] not in _POLICIES:
            raise ValueError(f"kv_connector_extra_config.reuse: {self.config['reuse']!r} is not "
                             f"one of {', '.join(_POLICIES)}")
        for key, low in (("idle_wait_ms", 0.0), ("load_threads", 1)):
            value = self.config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
                raise ValueError(f"kv_connector_extra_config.{key}: {value!r} is not a number "
                                 f">= {low}")
        self.model_name: str = self.config["model_name"]
        self.block_size: int = vllm_config.cache_config.block_size
        self.block_tokens: int = int(self.config["block_tokens"])
        self.allow_translated = bool(self.config["allow_translated_prefix_cache"])
        model_config = vllm_config.model_config
        dtype = model_config.dtype
        self.engine_dtype = (_TORCH_DTYPE_NAMES.get(dtype, "fp32")
                             if isinstance(dtype, torch.dtype) else "fp32")
        self.num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
        self.head_dim = model_config.get_head_size()
        self.num_layers = model_config.get_num_layers(vllm_config.parallel_config)
        self.max_model_len = model_config.max_model_len
        self._client: Any = None
        self._prefix: Any = None
        self._client_lock = threading.Lock()
        self._stats = KvtConnectorStats()
        self._stats_lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            # A failed load must never fail a request: vLLM then recomputes (0.32's default
            # policy is "fail").
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.info("kvt: setting kv_load_failure_policy=recompute (a failed "
                            "translation falls back to prefill)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._reqs: Dict[str, _Request] = {}
            self._pending_loads: List[Dict[str, Any]] = []
            self._pending_finals: List[Dict[str, Any]] = []
            self._lookups = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvt-lookup")
        else:
            self._kv_caches: Dict[str, torch.Tensor] = {}
            self._layers: List[str] = []
            self._loads: Dict[str, "_Load"] = {}
            self._loads_lock = threading.Lock()
            self._load_done_cv = threading.Condition(self._loads_lock)
            self._load_pool = ThreadPoolExecutor(
                max_workers=max(1, int(self.config["load_threads"])),
                thread_name_prefix="kvt-load")
            self._done_loads: Dict[str, Dict[str, Any]] = {}
            self._finals_copied: set = set()
            self._failed_this_step: set = set()
            # Shared memory for translated loads and for publishes (kvt/vllm/regions.py),
            # made in register_kv_caches once the cache's size is known; None: inline.
            self._load_region: Optional[WorkerRegion] = None
            self._publish_region: Optional[WorkerRegion] = None
            # The engine's cache shared in place, and its EngineBlockOrder fields; None: the
            # load region above.
            self._engine_region: Optional[WorkerRegion] = None
            self._engine_order: Optional[Dict[str, Any]] = None
            self._publish_ring: Optional[PublishRing] = None
            self._publish_queue: "queue.Queue[Optional[Dict[str, Any]]]" = queue.Queue(
                maxsize=max(1, int(self.config["publish_queue_size"])))
            self._publisher = threading.Thread(target=self._publish_loop, name="kvt-publish",
                                               daemon=True)
            self._publisher.start()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # publishing is best effort: a dropped publish is a future miss

    # -- shared ---------------------------------------------------------------------------------

    def _kvt(self) -> Tuple[Any, Any]:
        with self._client_lock:
            if self._client is None:
                import kvt
                from kvt.prefix import PrefixCache
                self._client = kvt.Client(self.config["kvtd_address"], timeout=None,
                                          channel_options=[
                                              ("grpc.initial_reconnect_backoff_ms", 100),
                                              ("grpc.min_reconnect_backoff_ms", 100),
                                              ("grpc.max_reconnect_backoff_ms", 1000)])
                self._prefix = PrefixCache(self._client)
            return self._client, self._prefix

    def _count(self, name: str, value: int = 1) -> None:
        with self._stats_lock:
            self._stats.add(name, value)

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        with self._stats_lock:
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
        if self.role == KVConnectorRole.SCHEDULER:
            self._lookups.shutdown(wait=False, cancel_futures=True)
        else:
            self._load_pool.shutdown(wait=False, cancel_futures=True)
            try:
                self._publish_queue.put_nowait(None)
            except queue.Full:
                pass
            for region in (self._load_region, self._publish_region, self._engine_region):
                if region is not None:
                    region.close()
        if self._client is not None:
            self._client.close()

    # ============================== scheduler side ==============================================

    def _state(self, request: "Request") -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            self.on_new_request(request)
            st = self._reqs[request.request_id]
        return st

    def on_new_request(self, request: "Request") -> None:
        self._count("requests")
        try:
            options = parse_kv_transfer_params(request.kv_transfer_params, self.config["reuse"])
            outcome: Dict[str, Any] = {}
        except ValueError as error:
            options = {"reuse": "forbid", "mapper_id": "", "min_tokens": 0}
            outcome = {"outcome": "unsupported", "reason": "bad_kv_transfer_params",
                       "detail": str(error)}
            logger.error("kvt: request %s: %s (served without reuse)", request.request_id,
                         error)
        self._reqs[request.request_id] = _Request(request=request, options=options,
                                                  outcome=outcome)

    def _fallback(self, st: _Request, reason: str, detail: str = "") -> Tuple[int, bool]:
        st.decided = True
        st.ext_tokens = 0
        if not st.outcome:
            st.outcome = {"outcome": "fallback_reprefill", "reason": reason}
            if detail:
                st.outcome["detail"] = detail
        return 0, False

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        st = self._state(request)
        if st.decided:
            # Asked again (the allocation failed, or the request was preempted / its load
            # failed): never load twice from one lease.
            if st.load is not None and not st.load_sent:
                if num_computed_tokens == st.load["start"]:
                    return st.ext_tokens, st.ext_tokens > 0
                # The engine's own prefix-cache hit changed meanwhile: the decision no longer
                # fits; drop the lease (it expires) and prefill.
                self._unsalt(st)
                st.load, st.ext_tokens = None, 0
                st.outcome = {"outcome": "fallback_reprefill", "reason": "rescheduled",
                              "detail": "the engine's own prefix-cache hit changed before the "
                                        "translated prefix could be allocated"}
            return 0, False
        if st.outcome.get("outcome") == "unsupported":
            st.decided = True
            return 0, False
        if st.options["reuse"] == "forbid":
            return self._fallback(st, "forbidden", "kv_transfer_params kvt.reuse=forbid")
        prompt = list(request.prompt_token_ids or [])
        # vLLM computes at least the last prompt token itself; whole vLLM blocks only.
        limit = (len(prompt) - 1) // self.block_size * self.block_size
        if limit <= num_computed_tokens:
            return self._fallback(
                st, "too_short" if num_computed_tokens == 0 else "local_prefix_cache",
                f"{len(prompt)} prompt tokens, {num_computed_tokens} from the engine's own "
                f"prefix cache, block size {self.block_size}")
        if st.lookup is None:
            min_tokens = max(num_computed_tokens + self.block_size,
                             int(self.config["min_reuse_tokens"]), st.options["min_tokens"])
            _, prefix = self._kvt()
            st.lookup_started = time.monotonic()
            self._count("lookups")
            st.lookup = self._lookups.submit(
                prefix.lookup, self.model_name, prompt, policy=st.options["reuse"],
                mapper_id=st.options["mapper_id"], min_tokens=min_tokens, max_tokens=limit,
                request_id=request.request_id, timeout=float(self.config["lookup_timeout_s"]))
            st.lookup.add_done_callback(_LookupClock(st))
        if not st.lookup.done():
            # A local kvtd answers in a millisecond or two: wait that long in line (saves a
            # scheduler step), else ask again next step (the scheduler loop never waits longer).
            wait = float(self.config["lookup_wait_s"])
            if wait <= 0 or not _wait(st.lookup, wait):
                return None, False
        try:
            response = st.lookup.result()
        except Exception as error:  # kvtd down, deadline, any RPC error
            self._count("lookup_errors")
            return self._fallback(st, "lookup_failed", _describe(error))
        if not response.hit:
            return self._fallback(st, response.miss_reason or "miss", response.detail)
        self._count("hits")
        end = min(response.matched_tokens, limit) // self.block_size * self.block_size
        if end <= num_computed_tokens:
            return self._fallback(st, "local_prefix_cache",
                                  f"kvtd offers {response.matched_tokens} tokens, the engine's "
                                  f"own prefix cache holds {num_computed_tokens}")
        from kvt.cache import DTYPE_NAMES
        st.decided = True
        st.ext_tokens = end - num_computed_tokens
        st.load = {"req_id": request.request_id, "lease_id": response.lease_id,
                   "mapper_id": response.mapper_id, "matched_tokens": response.matched_tokens,
                   "dtype": DTYPE_NAMES.get(response.dtype, "fp32"),
                   "start": num_computed_tokens, "end": end, "load": st.options["load"],
                   "source_model": response.source_model,
                   "gate": {"passed": response.gate.passed,
                            "mapper_quality": response.gate.mapper_quality,
                            **({"input_shift_score": response.gate.input_shift_score}
                               if response.gate.HasField("input_shift_score") else {})}}
        if not self.allow_translated:
            self._salt(st, response.mapper_id)
        return st.ext_tokens, True

    def _salt(self, st: _Request, mapper_id: str) -> None:
        """Re-hash the request under a salt so its translated blocks (and every block computed
        on top of them) never match a plain request's prefix-cache lookup."""
        request = st.request
        st.orig_salt = request.cache_salt
        st.orig_hashes = list(request.block_hashes)
        salt = f"kvt-translated:{mapper_id}"
        request.cache_salt = f"{st.orig_salt}|{salt}" if st.orig_salt else salt
        request.block_hashes.clear()
        request.update_block_hashes()
        st.salted = True

    def _unsalt(self, st: _Request) -> None:
        if not st.salted:
            return
        request = st.request
        request.cache_salt = st.orig_salt
        request.block_hashes.clear()
        request.update_block_hashes()
        st.salted = False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.load is None or st.load_sent or num_external_tokens == 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        load = dict(st.load)
        load["block_ids"] = block_ids
        load["scheduled_at"] = time.monotonic()
        self._pending_loads.append(load)
        st.load_sent = True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvtConnectorMetadata(loads=self._pending_loads, publishes=self._pending_finals,
                                    idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._pending_loads, self._pending_finals = [], []
        if not self.config["publish"]:
            return meta
        scheduled: List[Tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        scheduled.extend(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in scheduled:
            st = self._reqs.get(req_id)
            if st is None or st.prompt_published:
                continue
            request = st.request
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            prompt_len = request.num_prompt_tokens
            if done < prompt_len:
                continue
            st.prompt_published = True
            n = prompt_len // self.block_tokens * self.block_tokens
            if n == 0 or self._kv_cache_manager is None:
                continue
            block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
            meta.publishes.append({"req_id": req_id, "kind": "prompt",
                                   "token_ids": list(request.prompt_token_ids[:n]),
                                   "block_ids": block_ids[:(n + self.block_size - 1)
                                                          // self.block_size]})
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KvtWorkerMetadata):
            return
        for req_id, result in meta.loads.items():
            st = self._reqs.get(req_id)
            if st is None or st.load is None:
                continue
            st.load["result"] = result
            if not result.get("ok"):
                self._count("load_failures")
                # vLLM recomputes the request from scratch: its blocks are exact again.
                self._unsalt(st)
                st.outcome = {"outcome": "fallback_reprefill", "reason": "translate_failed",
                              "detail": result.get("error", "")}

    def request_finished(self, request: "Request", block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if not st.outcome:
            if st.load is not None and st.load.get("result", {}).get("ok"):
                result = st.load["result"]
                st.outcome = {
                    "outcome": "applied", "tokens_reused": st.load["end"] - st.load["start"],
                    "prefix_tokens": st.load["end"], "source_model": st.load["source_model"],
                    "mapper_id": st.load["mapper_id"],
                    "timings": {"lookup_ms": round(st.lookup_ms, 3),
                                "translate_ms": result.get("translate_ms", 0.0),
                                "load_ms": result.get("load_ms", 0.0),
                                "kvtd_total_ms": result.get("kvtd_total_ms", 0.0)},
                    "gate": st.load["gate"], "transport": result.get("transport", "inline"),
                    "prefix_cache": "shared" if self.allow_translated else "salted"}
                if "input_shift_score" in result:
                    st.outcome["input_shift_score"] = result["input_shift_score"]
            elif st.load is not None:
                st.outcome = {"outcome": "fallback_reprefill", "reason": "not_loaded",
                              "detail": "the request ended before its translated prefix loaded"}
            elif getattr(request, "skip_reading_prefix_cache", False):
                # vLLM drops external and cached prefixes for such requests (prompt_logprobs
                # sets it): the scheduler never asked the connector.
                st.outcome = {"outcome": "unsupported", "reason": "prefix_cache_skipped",
                              "detail": "vLLM skips reading cached prefixes for this request "
                                        "(prompt_logprobs or "
                                        "SamplingParams.skip_reading_prefix_cache)"}
            else:
                st.outcome = {"outcome": "fallback_reprefill", "reason": "not_scheduled",
                              "detail": "the request ended before a reuse decision"}
        outcome = st.outcome
        self._count({"applied": "applied", "fallback_reprefill": "fallback_reprefill"}.get(
            outcome["outcome"], "unsupported"))
        if outcome["outcome"] == "applied":
            self._count("tokens_reused", outcome["tokens_reused"])
        if self.config["log_outcomes"]:
            logger.info("kvt_outcome %s", json.dumps(
                {"request_id": request.request_id, "model": self.model_name, **outcome},
                sort_keys=True))
        delay = False
        # Never publish blocks a load may still be writing (a request aborted while waiting
        # for its translated prefix: num_computed_tokens already counts it).
        unconfirmed = st.load is not None and "result" not in st.load
        if self.config["publish_final"] and block_ids and not unconfirmed:
            n = min(request.num_computed_tokens, len(request.all_token_ids))
            n = n // self.block_tokens * self.block_tokens
            if n > 0 and (n > request.num_prompt_tokens // self.block_tokens * self.block_tokens
                          or not self.config["publish"]):
                self._pending_finals.append({
                    "req_id": request.request_id, "kind": "final",
                    "token_ids": list(request.all_token_ids[:n]),
                    "block_ids": list(block_ids[:(n + self.block_size - 1) // self.block_size]),
                    "hold": True})
                delay = True
        return delay, {"kvt": outcome}

    # ============================== worker side =================================================

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layers = layer_order(list(kv_caches))
        # The kernel's element order within a block, asked of the kernel (kvt/vllm/paged.py).
        self._paged = {name: PagedLayout(kv_caches[name], self.num_kv_heads, self.head_dim)
                       for name in self._layers}
        first = self._paged[self._layers[0]]
        # On CPU, numpy views of whole blocks (None per layer where the kernel's order is not
        # affine): loads and publishes copy block by block instead of element by element.
        flats = [self._kv_caches[name].view(-1) for name in self._layers]
        self._host = _host_views(flats, self.engine_dtype) if flats[0].device.type == "cpu" \
            else None
        self._block_views = ([self._paged[name].block_views(h)
                              for name, h in zip(self._layers, self._host)]
                             if self._host is not None else [None] * len(self._layers))
        logger.info("kvt: %d attention layers, paged layout %s (ISA %s), block size %d, %s "
                    "copies", len(self._layers), first.kind, first.isa or "-", first.block_size,
                    "block" if self._block_views[0] is not None else "indexed")
        if self.config["transport"] != "inline":
            request_bytes = self._cache_bytes(self.max_model_len)
            warn = self.config["transport"] == "shm"
            client_fn = lambda: self._kvt()[0]  # noqa: E731
            self._load_region = WorkerRegion(client_fn, request_bytes, "translated loads", warn)
            ring = int(self.config["publish_region_bytes"]) or min(4 * request_bytes, 256 << 20)
            self._publish_region = WorkerRegion(client_fn, ring, "publishes", warn)
            self._publish_ring = PublishRing(ring)
            if self.config["load_in_place"] and self._host is not None:
                self._share_engine_cache(client_fn, warn)

    def _share_engine_cache(self, client_fn: Any, warn: bool) -> None:
        """Makes the engine's KV cache a shared-memory region kvtd writes loads into (in place,
        before the engine's first step); on any refusal the load region serves instead."""
        first = self._paged[self._layers[0]]
        try:
            tensors = [self._kv_caches[name] for name in self._layers]
            if any(self._paged[name].affine_kv != first.affine_kv for name in self._layers):
                raise ValueError("the layers' block orders differ")
            if None in first.affine_kv:  # refused before the cache moves, not after
                raise ValueError(f"the kernel's order within a block (ISA {first.isa}) is not "
                                 "affine")
            memory = share_in_place(tensors)
            try:
                order = engine_block_order(memory, tensors, first.affine_kv, first.block_elems)
            except BaseException:
                memory.close()
                raise
        except Exception as error:
            (logger.warning if warn else logger.info)(
                "kvt: the engine's KV cache stays private (%s); translated loads go through a "
                "region of their own", error)
            return
        self._engine_order = order
        # An older kvtd would ignore engine_order and the token range and write the standard
        # order over every token of the blocks: never registered with one.
        self._engine_region = WorkerRegion(client_fn, memory.byte_size, "in-place loads",
                                           warn, memory=memory, requires="paged_engine_order")
        logger.info("kvt: the engine's KV cache (%d bytes) is shared with kvtd (%s): translated "
                    "loads are written in place", memory.byte_size, memory.key)

    def _cache_bytes(self, tokens: int) -> int:
        """Bytes of this engine's cache of `tokens` tokens, all layers, K and V."""
        return (2 * len(self._layers) * self.num_kv_heads * self.head_dim *
                _ELEMENT_BYTES[self.engine_dtype] * tokens)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvtConnectorMetadata):
            return
        for spec in meta.loads:
            load = _Load(self, spec)
            with self._loads_lock:
                self._loads[spec["req_id"]] = load
            load.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM does not schedule a request before they finish

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # publishes are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KvtConnectorMetadata) or not meta.publishes:
            return
        for spec in meta.publishes:
            try:
                if spec["req_id"] in self._failed_this_step and spec["kind"] == "prompt":
                    continue  # its blocks hold a failed load; the final publish covers it
                self._copy_and_queue(spec)
            except Exception as error:  # never fail a step for a publish
                self._count("publish_failed")
                logger.warning("kvt: publish copy of %s failed: %s", spec["req_id"], error)
            finally:
                if spec.get("hold"):
                    self._finals_copied.add(spec["req_id"])

    def _copy_and_queue(self, spec: Dict[str, Any]) -> None:
        if self._publish_queue.full():  # only this thread adds: the put below cannot fail
            self._count("publish_dropped")
            logger.warning("kvt: publish queue full, dropped the %s publish of %s",
                           spec["kind"], spec["req_id"])
            return
        item = {"req_id": spec["req_id"], "kind": spec["kind"], "token_ids": spec["token_ids"]}
        slot = self._copy_to_publish_region(spec)
        if slot is not None:
            item["slot"] = slot
        else:
            item["layers"] = self._copy_to_arrays(spec)
        self._publish_queue.put_nowait(item)

    def _copy_to_publish_region(self, spec: Dict[str, Any]) -> Optional[Tuple[int, int]]:
        """Copies the publish's tokens out of the paged cache into free bytes of the publish
        region (packed: per layer K then V, [tokens, heads, head_dim], the engine's dtype) and
        returns (offset, size), or None (no region, no room, or no block copies): inline."""
        n = len(spec["token_ids"])
        nbytes = self._cache_bytes(n)
        if self._publish_ring is None or self._publish_region is None:
            return None
        region = self._publish_region.ready(nbytes)  # registered by the publish thread
        if region is None:
            return None
        offset = self._publish_ring.allocate(nbytes)
        if offset is None:
            self._count("publish_region_full")
            return None
        try:
            packed = self._packed(region, offset, n)
            for layer, (name, views) in enumerate(zip(self._layers, self._block_views)):
                rows = (gather_rows(views, self._paged[name], spec["block_ids"], 0, n,
                                    out=(packed[layer, 0], packed[layer, 1]))
                        if views is not None else None)
                if rows is None:  # no block copies for this layer: an inline publish
                    self._publish_ring.free(offset)
                    return None
        except BaseException:
            self._publish_ring.free(offset)
            raise
        return offset, nbytes

    def _packed(self, region: Any, offset: int, tokens: int) -> np.ndarray:
        """The publish at `offset` of the publish region as [layers, 2, tokens, heads, dim] of
        the engine's wire dtype (a view, no copy)."""
        count = len(self._layers) * 2 * tokens * self.num_kv_heads * self.head_dim
        return np.frombuffer(region.buf, dtype=_WIRE_NUMPY[self.engine_dtype], count=count,
                             offset=offset).reshape(len(self._layers), 2, tokens,
                                                    self.num_kv_heads, self.head_dim)

    def _copy_to_arrays(self, spec: Dict[str, Any]) -> List[Tuple[np.ndarray, np.ndarray]]:
        """The publish's tokens as float numpy arrays per layer (K, V), for an inline publish."""
        n = len(spec["token_ids"])
        layers = []
        for name, views in zip(self._layers, self._block_views):
            rows = (gather_rows(views, self._paged[name], spec["block_ids"], 0, n)
                    if views is not None else None)
            if rows is not None:
                k, v = rows
                layers.append((_bits_to_float(k), _bits_to_float(v))
                              if self.engine_dtype == "bf16" else (k, v))
                continue
            tk, tv = gather_tokens(self._kv_caches[name], self._paged[name], spec["block_ids"],
                                   0, n)
            layers.append((tk.float().numpy() if self.engine_dtype == "bf16" else tk.numpy(),
                           tv.float().numpy() if self.engine_dtype == "bf16" else tv.numpy()))
        return layers

    def _publish_loop(self) -> None:
        while True:
            item = self._publish_queue.get()
            if item is None:
                return
            try:
                self._publish(item)
                if self._publish_region is not None:
                    self._publish_region.get(0)  # registers it here, not in an engine step
            except Exception as error:
                self._count("publish_failed")
                logger.warning("kvt: publish of %s (%s, %d tokens) failed: %s", item["req_id"],
                               item["kind"], len(item["token_ids"]), _describe(error))

    def _publish(self, item: Dict[str, Any]) -> None:
        _, prefix = self._kvt()
        request_id = f"{item['req_id']}/{item['kind']}"
        timeout = float(self.config["publish_timeout_s"])
        if "slot" in item:
            from kvt.errors import KvtError
            offset, nbytes = item["slot"]
            assert self._publish_region is not None and self._publish_ring is not None
            region = self._publish_region.memory
            try:
                try:
                    prefix.publish_region(
                        self.model_name, item["token_ids"], region.ref(offset, nbytes),
                        num_layers=len(self._layers), num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype=self.engine_dtype, request_id=request_id,
                        wait_for_ready=True, timeout=timeout)
                    self._count("publishes_shm")
                except KvtError as error:
                    if "header.input.region" not in str(error):
                        raise
                    # kvtd lost or refuses the region (restarted, client regions off): the same
                    # bytes inline, and register again before the next publish.
                    self._publish_region.mark_failed()
                    packed = self._packed(region, offset, len(item["token_ids"]))
                    floats = _bits_to_float if self.engine_dtype == "bf16" else np.asarray
                    prefix.publish(self.model_name, item["token_ids"],
                                   [(floats(k), floats(v)) for k, v in packed],
                                   dtype=self.engine_dtype, layout="NHD", request_id=request_id,
                                   wait_for_ready=True, timeout=timeout)
            finally:
                self._publish_ring.free(offset)
            self._count("publishes")
            self._count("publish_bytes", nbytes)
            return
        prefix.publish(self.model_name, item["token_ids"], item["layers"],
                       dtype=self.engine_dtype, layout="NHD", request_id=request_id,
                       wait_for_ready=True, timeout=timeout)
        self._count("publishes")
        self._count("publish_bytes", sum(k.nbytes + v.nbytes for k, v in item["layers"]))

    def get_transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        self._failed_this_step = set()
        meta = self._connector_metadata
        idle_wait_s = float(self.config["idle_wait_ms"]) / 1e3
        with self._loads_lock:
            if (idle_wait_s > 0 and isinstance(meta, KvtConnectorMetadata) and meta.idle
                    and self._loads and not self._done_loads):
                # Releases the GIL until a load ends (notified in _load_done) or the bound.
                self._load_done_cv.wait(timeout=idle_wait_s)
            for req_id, result in list(self._done_loads.items()):
                results.finished_recving.add(req_id)
                if not result["ok"]:
                    results.failed_recving.add(req_id)
                    self._failed_this_step.add(req_id)
            self._reported, self._done_loads = dict(self._done_loads), {}
        results.finished_sending = set(self._finals_copied)
        self._finals_copied = set()
        return results

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        reported = getattr(self, "_reported", None)
        if not reported:
            return None
        self._reported = {}
        return KvtWorkerMetadata(loads=reported)

    def _load_done(self, req_id: str, result: Dict[str, Any]) -> None:
        with self._loads_lock:
            self._loads.pop(req_id, None)
            self._done_loads[req_id] = result
            self._load_done_cv.notify_all()
        if not result["ok"]:
            logger.warning("kvt: load of %s failed, vLLM recomputes it: %s", req_id,
                           result.get("error"))


class _Load:
    """One asynchronous TranslateKV of a leased prefix into a request's blocks."""

    def __init__(self, connector: KvtConnector, spec: Dict[str, Any]) -> None:
        self.c = connector
        self.spec = spec
        self._indexed: Optional[tuple] = None  # _targets(), made on first use

    def start(self) -> None:
        self.c._load_pool.submit(self._run)

    def _run(self) -> None:
        spec, c = self.spec, self.c
        t0 = time.monotonic()
        result: Dict[str, Any] = {"ok": False}
        try:
            result = self._translate()
        except Exception as error:
            result = {"ok": False, "error": _describe(error)}
        result["translate_ms"] = round((time.monotonic() - t0) * 1e3, 3)
        c._load_done(spec["req_id"], result)

    def _translate(self) -> Dict[str, Any]:
        spec, c = self.spec, self.c
        holder = c._engine_region if spec.get("load", "auto") == "auto" else None
        engine = holder.get(0) if holder is not None else None
        if holder is not None and engine is not None:
            failed = True
            try:
                result = self._translate_in_place(engine)
                failed = False
                return result
            finally:
                if failed:
                    holder.mark_failed()
        matched = spec["matched_tokens"]
        nbytes = c._cache_bytes(matched)
        holder = c._load_region if spec.get("load", "auto") != "inline" else None
        region = holder.acquire(nbytes) if holder is not None else None
        if holder is None or region is None:
            return self._translate_inline()
        failed = True
        try:
            result = self._translate_region(region, nbytes)
            failed = False
            return result
        finally:
            holder.release(failed)

    def _targets(self) -> Tuple[List[torch.Tensor], Optional[List[np.ndarray]], torch.Tensor,
                                torch.Tensor, np.ndarray, np.ndarray]:
        """Per layer the flat cache tensor (and its numpy view on CPU), and the flat indices of
        the request's rows [start, end): one index serves every layer (same block table, same
        kernel element order). Only for rows that block copies (_write_rows) cannot take."""
        if self._indexed is None:
            spec, c = self.spec, self.c
            index_k, index_v = c._paged[c._layers[0]].index(spec["block_ids"], spec["start"],
                                                            spec["end"])
            flats = [c._kv_caches[name].view(-1) for name in c._layers]
            device = flats[0].device
            # On CPU rows are written with numpy into views of the cache (single-threaded: a
            # torch index_put here would start an OpenMP region beside the model runner's, on
            # the same cores, and wait in it for milliseconds per chunk).
            self._indexed = (flats, c._host, index_k.to(device), index_v.to(device),
                             index_k.cpu().numpy(), index_v.cpu().numpy())
        return self._indexed

    def _write_rows(self, layer: int, is_k: bool, lo: int, rows: np.ndarray, wire: str) -> None:
        """Writes target rows [lo, lo + len(rows)) of the request (numpy [n, heads, dim] of wire
        dtype `wire`) into one layer's K or V blocks: a block copy where the rows are whole
        blocks in the engine's dtype, else through the element indices."""
        spec, c = self.spec, self.c
        views = c._block_views[layer]
        if (views is not None and wire == c.engine_dtype and
                scatter_rows(views[0 if is_k else 1], c._paged[c._layers[layer]],
                             spec["block_ids"], lo, rows)):
            return
        flats, host, index_k, index_v, np_k, np_v = self._targets()
        n, start = rows.shape[0], spec["start"]
        if host is not None and wire == c.engine_dtype:
            host[layer][(np_k if is_k else np_v)[lo - start:lo - start + n]] = rows
            return
        part = _rows(np.ascontiguousarray(rows).tobytes(), wire, n, c.num_kv_heads, c.head_dim,
                     0, n)
        flat = flats[layer]
        flat[(index_k if is_k else index_v)[lo - start:lo - start + n]] = part.to(
            device=flat.device, dtype=flat.dtype)

    def _check_target_header(self, header: Any, call: Any) -> str:
        """The response header's shape, layout and dtype against this engine's cache (the call
        cancelled and an error raised on a mismatch); returns the wire dtype of the rows."""
        from kvt._proto import common_pb2
        from kvt.cache import DTYPE_NAMES
        c = self.c
        shape, dtype = header.target_shape, DTYPE_NAMES.get(header.output_dtype)
        layers, heads, dim = len(c._layers), c.num_kv_heads, c.head_dim
        problem = None
        if (shape.num_layers, shape.num_kv_heads, shape.head_dim) != (layers, heads, dim):
            problem = (f"mapper {self.spec['mapper_id']} produces {shape.num_layers}x"
                       f"{shape.num_kv_heads}x{shape.head_dim}, this engine's cache is "
                       f"{layers}x{heads}x{dim}")
        elif header.output_layout != common_pb2.LAYOUT_NHD:
            problem = "kvtd answered a layout other than NHD"
        elif dtype is None or dtype not in _WIRE_NUMPY:
            problem = f"kvtd answered output dtype {header.output_dtype}"
        if problem or dtype is None:
            call.cancel()
            raise RuntimeError(problem)
        return dtype

    def _region_call(self, header: Any,
                     on_layer: Optional[Callable[[int, int], None]]) -> Tuple[Any, Any]:
        """Runs TranslateKV for `header` (output in a region, no chunks to send) and returns
        (response header, trailer); `on_layer(layer, kind)` for each layer notice."""
        import grpc
        from kvt._proto import common_pb2, translate_pb2
        from kvt.cache import DTYPE_NAMES
        from kvt.errors import from_rpc_error
        c = self.c
        client, _ = c._kvt()
        matched = self.spec["matched_tokens"]
        # wait_for_ready: the scheduler's lookup just got the lease, so kvtd is up; this
        # process's channel may still be reconnecting (e.g. after a kvtd restart).
        call = client.stub.TranslateKV(
            iter([translate_pb2.TranslateKVRequest(header=header)]),
            timeout=float(c.config["translate_timeout_s"]), metadata=client._metadata,
            wait_for_ready=True)
        layers = len(c._layers)
        response_header = trailer = None
        try:
            for response in call:
                which = response.WhichOneof("msg")
                if which == "header":
                    response_header = response.header
                    if self._check_target_header(response_header, call) != c.engine_dtype:
                        call.cancel()
                        raise RuntimeError(
                            f"kvtd wrote {DTYPE_NAMES.get(response_header.output_dtype)} into "
                            f"the region; this engine's cache is {c.engine_dtype}")
                elif which == "chunk":
                    notice = response.chunk
                    if (response_header is None or on_layer is None or notice.layer >= layers
                            or notice.data or notice.token_start != 0
                            or notice.token_count != matched):
                        call.cancel()
                        raise RuntimeError(f"unexpected region notice {notice.layer}/"
                                           f"{notice.kind} [{notice.token_start}, +"
                                           f"{notice.token_count})")
                    on_layer(notice.layer, 0 if notice.kind == common_pb2.CACHE_KIND_K else 1)
                elif which == "trailer":
                    trailer = response.trailer
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        if response_header is None or trailer is None:
            raise RuntimeError("kvtd ended the stream without a header and trailer")
        return response_header, trailer

    def _header(self) -> Any:
        spec, c = self.spec, self.c
        from kvt.prefix import cached_translate_header
        return cached_translate_header(spec["lease_id"], spec["mapper_id"],
                                       spec["matched_tokens"], dtype=spec["dtype"],
                                       output_dtype=c.engine_dtype, output_layout="NHD",
                                       request_id=f"{spec['req_id']}/load")

    @staticmethod
    def _result(transport: str, load_s: float, trailer: Any) -> Dict[str, Any]:
        out: Dict[str, Any] = {"ok": True, "transport": transport,
                               "load_ms": round(load_s * 1e3, 3),
                               "kvtd_total_ms": round(trailer.timings.total_ms, 3),
                               "kvtd_compute_ms": round(trailer.timings.compute_ms, 3)}
        if trailer.HasField("input_shift_score"):
            out["input_shift_score"] = trailer.input_shift_score
        return out

    def _translate_in_place(self, engine: Any) -> Dict[str, Any]:
        """TranslateKV with kvtd writing the request's tokens [start, end) straight into its
        blocks of the engine's shared cache, in the kernels' order: nothing to copy here."""
        spec, c = self.spec, self.c
        layout = c._paged[c._layers[0]]
        start, end = spec["start"], spec["end"]
        header = self._header()
        ref = header.output.region
        ref.region, ref.offset, ref.byte_size = engine.name, 0, engine.byte_size
        paged = ref.paged
        paged.num_blocks, paged.block_size = layout.num_blocks, layout.block_size
        paged.block_table.extend(spec["block_ids"][:-(-end // layout.block_size)])
        paged.first_token, paged.end_token = start, end
        order = c._engine_order or {}
        paged.engine_order.layer_offsets.extend(order["layer_offsets"])
        paged.engine_order.block_stride = order["block_stride"]
        for kind in ("k", "v"):
            for name, value in order[kind].items():
                setattr(getattr(paged.engine_order, kind), name, value)
        _, trailer = self._region_call(header, None)
        return self._result("in_place", 0.0, trailer)

    def _translate_region(self, region: Any, nbytes: int) -> Dict[str, Any]:
        """TranslateKV with the result written by kvtd into the worker's shared-memory region
        (packed: per layer K then V, [tokens, heads, head_dim]); each layer is copied into the
        blocks as soon as kvtd says it is there (header.region_layer_notices), while kvtd
        computes the next ones."""
        spec, c = self.spec, self.c
        start, end, matched = spec["start"], spec["end"], spec["matched_tokens"]
        header = self._header()
        header.output.region.CopyFrom(region.ref(0, nbytes))
        header.region_layer_notices = bool(c.config["layer_notices"])
        layers, heads, dim = len(c._layers), c.num_kv_heads, c.head_dim
        packed = np.frombuffer(region.buf, dtype=_WIRE_NUMPY[c.engine_dtype],
                               count=nbytes // _ELEMENT_BYTES[c.engine_dtype]).reshape(
                                   layers, 2, matched, heads, dim)
        loaded = np.zeros((layers, 2), dtype=bool)
        load_s = 0.0

        def load(layer: int, kind: int) -> None:
            nonlocal load_s
            t = time.monotonic()
            self._write_rows(layer, kind == 0, start, packed[layer, kind, start:end],
                             c.engine_dtype)
            loaded[layer, kind] = True
            load_s += time.monotonic() - t

        _, trailer = self._region_call(header, load)
        # A kvtd without notices wrote everything by the trailer.
        for layer, kind in zip(*np.nonzero(~loaded)):
            load(int(layer), int(kind))
        return self._result("shm", load_s, trailer)

    def _translate_inline(self) -> Dict[str, Any]:
        spec, c = self.spec, self.c
        from kvt._proto import common_pb2
        _, prefix = c._kvt()
        start, end, matched = spec["start"], spec["end"], spec["matched_tokens"]
        stream = prefix.translate_cached_stream(
            spec["lease_id"], spec["mapper_id"], matched, dtype=spec["dtype"],
            output_dtype=c.engine_dtype, output_layout="NHD",
            request_id=f"{spec['req_id']}/load", timeout=float(c.config["translate_timeout_s"]),
            wait_for_ready=True)
        layers = c._layers
        heads, dim = c.num_kv_heads, c.head_dim
        covered = np.zeros((len(layers), 2, end - start), dtype=bool)
        header = trailer = None
        load_s = 0.0
        out_dtype = "fp32"
        for which, message in stream:
            if which == "header":
                header = message
                out_dtype = self._check_target_header(header, stream)
            elif which == "chunk":
                if header is None:
                    raise RuntimeError("a target chunk before the response header")
                chunk = message
                lo, hi = max(chunk.token_start, start), min(chunk.token_start +
                                                            chunk.token_count, end)
                if chunk.layer >= len(layers):
                    raise RuntimeError(f"target chunk of layer {chunk.layer}")
                if hi <= lo:
                    continue
                t = time.monotonic()
                is_k = chunk.kind == common_pb2.CACHE_KIND_K
                rows = np.frombuffer(chunk.data, dtype=_WIRE_NUMPY[out_dtype]).reshape(
                    chunk.token_count, heads, dim)[lo - chunk.token_start:hi - chunk.token_start]
                self._write_rows(chunk.layer, is_k, lo, rows, out_dtype)
                covered[chunk.layer, 0 if is_k else 1, lo - start:hi - start] = True
                load_s += time.monotonic() - t
            elif which == "trailer":
                trailer = message
        if header is None or trailer is None:
            raise RuntimeError("kvtd ended the stream without a header and trailer")
        if not covered.all():
            raise RuntimeError(f"kvtd's result misses {int((~covered).sum())} token rows")
        return self._result("inline", load_s, trailer)


# Wire element types as numpy reads them, matching the engine's storage bit for bit (bf16 as
# its 16-bit patterns).
_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


_WIRE_NUMPY: Dict[str, Any] = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2"),
                               "bf16": np.dtype("<i2")}


def _host_views(flats: List[torch.Tensor], dtype: str) -> Optional[List[np.ndarray]]:
    """numpy views (sharing memory) of CPU cache tensors, bf16 as int16 bit patterns."""
    try:
        if dtype == "bf16":
            return [f.view(torch.int16).numpy() for f in flats]
        return [f.numpy() for f in flats]
    except Exception:
        return None


def _bits_to_float(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (int16) as the float32 values they encode (exact)."""
    return (bits.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _wait(future: Future, seconds: float) -> bool:
    try:
        future.exception(timeout=seconds)
        return True
    except Exception:  # concurrent.futures.TimeoutError
        return future.done()


def _rows(data: bytes, dtype: str, count: int, heads: int, dim: int, lo: int, hi: int
          ) -> torch.Tensor:
    """Rows [lo, hi) of an NHD chunk [count, heads, dim] of wire `dtype`, without a copy for
    fp32 and fp16 (the bytes stay alive in the message; the tensor is only read)."""
    if dtype == "bf16":
        bits = np.frombuffer(data, dtype="<u2").reshape(count, heads, dim)[lo:hi]
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    array = np.frombuffer(data, dtype="<f4" if dtype == "fp32" else "<f2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: only read here
        return torch.from_numpy(array.reshape(count, heads, dim)[lo:hi])
