"""The connector's cross-node tier: Mooncake Store (kvt.cluster) behind kvtd's node-local tier
(docs/CLUSTER_TIER.md). Only imported when kv_connector_extra_config has a `cluster` section.

  StoreHandle     one store client per process and configuration, set up on a background thread
                  at connector start (Mooncake's setup can hold the GIL for a minute against a
                  silent master; kvt.cluster probes the master's port first). Until it is ready,
                  lookups skip the store with reason store_unavailable.
  ClusterLookup   the scheduler side, on its lookup threads (never in the engine step): after
                  kvtd's LookupPrefix misses or matches less, longest_prefix over the sources
                  with a served mapper into this model; on a longer match, the fetch into a
                  shared-memory region registered with kvtd and the store, a Publish from that
                  region to kvtd, and kvtd's LookupPrefix again (its gate and lease decide).
  ClusterPut      the worker side, on the publisher thread: put_prefix of a published prefix.

Why the scheduler side fetches (not a worker): the bytes fetched are the *source* model's cache,
bound for kvtd, not for this engine's blocks; one fetch per node and request (not one per
tensor-parallel worker); and the reuse decision then rests on kvtd's answer for a prefix it
holds, exactly as for a local publish, so the worker's translated load is today's, unchanged.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from kvt.vllm.options import ClusterOptions

logger = logging.getLogger("vllm.kvt")

# Local miss reasons after which the store is asked (a missing mapper, a refused pair, a
# disabled tier are not helped by more source bytes).
ASK_STORE_AFTER = ("no_prefix", "too_short")
MAPPERS_TTL_S = 30.0
_MAPPER_FAILED = 5  # kvt.v1.MapperState.MAPPER_STATE_FAILED

_handles: Dict[ClusterOptions, "StoreHandle"] = {}
_handles_lock = threading.Lock()


def store_handle(options: ClusterOptions) -> "StoreHandle":
    """The process's store client for `options` (the scheduler and a worker in one process
    share it), its set-up started on first use."""
    with _handles_lock:
        handle = _handles.get(options)
        if handle is None:
            handle = _handles[options] = StoreHandle(options)
        return handle


def _local_hostname(options: ClusterOptions) -> str:
    if options.local_hostname:
        return options.local_hostname
    bound = os.environ.get("MC_TCP_BIND_ADDRESS")
    if bound:
        return bound
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


class StoreHandle:
    """A kvt.cluster.ClusterStore being set up on a daemon thread; `get()` never waits."""

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self._store: Any = None
        self._closed = False
        self.state = "setting up"
        self._wake = threading.Event()
        if options.local_hostname in ("127.0.0.1", "localhost"):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        threading.Thread(target=self._setup, name="kvt-cluster-setup", daemon=True).start()

    def _setup(self) -> None:
        from kvt.cluster import ClusterError, ClusterStore, StoreConfig
        o = self.options
        config = StoreConfig(master_server_address=o.master_server_address,
                             metadata_server=o.metadata_server,
                             local_hostname=_local_hostname(o), global_segment_size=0,
                             protocol=o.protocol, device_name=o.device_name,
                             setup_timeout_s=o.setup_timeout_s,
                             lookup_timeout_s=o.lookup_timeout_s,
                             fetch_timeout_s=o.fetch_timeout_s, put_timeout_s=o.put_timeout_s)
        while not self._closed:
            try:
                store = ClusterStore(config)
            except ClusterError as error:
                self.state = f"{error.reason}: {error.detail}"
                logger.warning("kvt: cluster tier: no store client yet (%s); next try in "
                               "%.0f s", self.state, o.setup_retry_s)
                self._wake.wait(o.setup_retry_s)
                continue
            except Exception as error:  # a broken install: keep the node-local tier
                self.state = f"store_unavailable: {error!r}"
                logger.error("kvt: cluster tier off: %s", self.state)
                return
            self._store = store
            self.state = "ready"
            logger.info("kvt: cluster tier: store client ready (master %s)",
                        o.master_server_address)
            return

    def get(self) -> Any:
        """The ClusterStore once set up, else None (see `state`)."""
        return self._store

    def wait_ready(self, timeout: float) -> Any:
        end = time.monotonic() + timeout
        while self._store is None and time.monotonic() < end and not self._closed:
            time.sleep(0.05)
        return self._store


class _NotPublished(Exception):
    """A fetched prefix that kvtd did not take (its Publish from the region failed)."""


# The smallest fetch region made (bytes); it grows in powers of two up to fetch_region_bytes.
_MIN_FETCH_REGION = 64 << 20


class ClusterLookup:
    """The scheduler side's store step (runs on a lookup thread). `kvt()`: (client,
    PrefixCache); `count(name, value)`: the connector's counters."""

    def __init__(self, options: ClusterOptions, model_name: str, own_dtype: str,
                 block_tokens: int, kvt: Callable[[], Any], count: Callable[..., None]) -> None:
        self.options = options
        self.model_name = model_name
        self.dtypes = options.dtypes(own_dtype)
        self.block_tokens = block_tokens
        self.kvt = kvt
        self._count = count
        self.handle = store_handle(options)
        self._mappers: List[Any] = []
        self._mappers_at = -1e9
        self._fetch_lock = threading.Lock()   # one fetch at a time into the region
        self._region: Any = None              # a WorkerRegion, made on first fetch
        self._registered: Optional[Tuple[Any, int]] = None  # (region object, store address)
        self._failed: Dict[Tuple[str, ...], float] = {}  # object keys -> retry time

    # -- candidates ------------------------------------------------------------------------------

    def _geometries(self) -> List[Any]:
        from kvt.cluster import Geometry
        now = time.monotonic()
        if now - self._mappers_at > MAPPERS_TTL_S:
            client, _ = self.kvt()
            self._mappers = [m for m in client.list_mappers(timeout=self.options.lookup_timeout_s
                                                             + 1.0)
                             if m.target_model == self.model_name
                             and m.state != _MAPPER_FAILED]
            self._mappers_at = now
        out, seen = [], set()
        for m in self._mappers:
            s = m.source_shape
            for dtype in self.dtypes:
                key = (m.source_model, s.num_layers, s.num_kv_heads, s.head_dim, dtype)
                if key in seen or not s.num_layers:
                    continue
                seen.add(key)
                out.append(Geometry(m.source_model, s.num_layers, s.num_kv_heads, s.head_dim,
                                    dtype, self.block_tokens, self.options.chunk_blocks))
        return out

    # -- the step --------------------------------------------------------------------------------

    def consult(self, prompt: List[int], response: Any, lookup: Callable[[], Any],
                limit: int, block_size: int) -> Tuple[Any, Optional[Dict[str, Any]]]:
        """After kvtd's answer `response`: the response to decide on (kvtd's again after a
        fetch) and what the store did (None: not asked)."""
        if response.hit:
            local = min(response.matched_tokens, limit) // block_size * block_size
            if local >= limit // block_size * block_size:
                return response, None  # kvtd covers all a request can load
        elif response.miss_reason in ASK_STORE_AFTER:
            local = 0
        else:
            return response, None
        store = self.handle.get()
        if store is None:
            return response, self._error("store_unavailable",
                                         f"the store client is not set up ({self.handle.state})")
        from kvt.cluster import ClusterError
        try:
            geometries = self._geometries()
        except Exception as error:
            return response, {"result": "skipped", "reason": "no_mappers",
                              "detail": f"kvtd's mapper list: {error}"}
        if not geometries:
            return response, {"result": "skipped", "reason": "no_mappers",
                              "detail": f"no served mapper into {self.model_name}"}
        self._count("cluster_lookups")
        t0 = time.monotonic()
        try:
            matches = store.longest_prefix(geometries, prompt, max_tokens=limit,
                                           timeout=self.options.lookup_timeout_s)
        except ClusterError as error:
            return response, self._error(error.reason, error.detail)
        lookup_ms = round((time.monotonic() - t0) * 1e3, 3)
        match = max(matches.values(), key=lambda m: m.tokens)
        info: Dict[str, Any] = {"lookup_ms": lookup_ms}
        try:
            fitting = self._fitting(match)
        except ClusterError as error:
            return response, {**info, **self._error(error.reason, error.detail)}
        if fitting.tokens // block_size * block_size <= local:
            self._count("cluster_misses")
            detail = f"the store holds {match.tokens} tokens, kvtd {local}"
            if fitting is not match:
                detail += f" ({fitting.tokens} fit cluster.fetch_region_bytes)"
            return response, {**info, "result": "miss", "detail": detail}
        match = fitting
        keys = tuple(k for k, _, _ in match.objects)
        retry_at = self._failed.get(keys, 0.0)
        if time.monotonic() < retry_at:
            return response, self._error("recently_failed", "a fetch of this prefix failed "
                                         f"{self.options.failed_key_ttl_s:.0f} s ago or less",
                                         count=False)
        self._count("cluster_hits")
        info.update(source_model=match.geometry.model, tokens=match.tokens)
        try:
            fetched = self._fetch(store, match, prompt)
        except _NotPublished as error:
            return response, {**info, **self._error("publish_failed", str(error), count=False)}
        except ClusterError as error:
            if error.reason in ("segment_unavailable", "evicted"):
                now = time.monotonic()
                if len(self._failed) > 1024:
                    self._failed = {k: t for k, t in self._failed.items() if t > now}
                self._failed[keys] = now + self.options.failed_key_ttl_s
            return response, {**info, **self._error(error.reason, error.detail)}
        info.update(fetched)
        info["result"] = "fetched"
        return lookup(), info

    def _error(self, reason: str, detail: str, count: bool = True) -> Dict[str, Any]:
        if count:
            self._count(f"cluster_error_{reason}")
        return {"result": "error", "reason": reason, "detail": detail}

    def _fitting(self, match: Any) -> Any:
        """The leading objects of `match` that fit fetch_region_bytes (all of them, mostly)."""
        from kvt.cluster import ClusterError, PrefixMatch
        limit = self.options.fetch_region_bytes
        if match.nbytes <= limit:
            return match
        g = match.geometry
        per_block = g.packed_bytes(g.block_tokens)
        objects, blocks = [], 0
        for key, start, end in match.objects:
            if end * per_block > limit:
                break
            objects.append((key, start, end))
            blocks = end
        if not blocks:
            raise ClusterError("store_error", f"one object of {per_block * g.chunk_blocks} "
                               f"bytes exceeds cluster.fetch_region_bytes")
        return PrefixMatch(g, blocks, objects, match.hashes[:blocks])

    def _fetch(self, store: Any, match: Any, prompt: List[int]) -> Dict[str, Any]:
        from kvt.cluster import ClusterError
        o = self.options
        g = match.geometry
        if not self._fetch_lock.acquire(timeout=o.fetch_timeout_s):
            raise ClusterError("store_timeout", "the fetch region stayed busy for "
                               f"{o.fetch_timeout_s} s")
        held = True
        try:
            region = self._ensure_region(store, match.nbytes)
            logger.info("kvt: cluster: fetching %d tokens of %s (%d objects)", match.tokens,
                        g.model, len(match.objects))
            if o.fetch_delay_s:
                time.sleep(o.fetch_delay_s)
            t0 = time.monotonic()
            try:
                nbytes = store.fetch(match, region.buf, timeout=o.fetch_timeout_s)
            except ClusterError as error:
                if error.pending is not None:
                    # The read may still land in the region: it stays held until it returns.
                    held = False
                    error.pending.add_done_callback(lambda _f: self._fetch_lock.release())
                raise
            fetch_ms = (time.monotonic() - t0) * 1e3
            self._count("cluster_fetches")
            self._count("cluster_fetch_bytes", nbytes)
            self._count("cluster_fetch_us", int(fetch_ms * 1e3))
            _, prefix = self.kvt()
            t1 = time.monotonic()
            try:
                prefix.publish_region(g.model, prompt[:match.tokens], region.ref(0, nbytes),
                                      num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                                      head_dim=g.head_dim, dtype=g.dtype, timeout=10.0)
            except Exception as error:
                # kvtd lost or refuses the region (restarted: register again next time).
                self._region.mark_failed()
                raise _NotPublished(f"the fetched prefix's Publish to kvtd: {error}") from error
            publish_ms = (time.monotonic() - t1) * 1e3
            logger.info("kvt: cluster fetch of %d tokens of %s: %d bytes in %.1f ms, published "
                        "to kvtd in %.1f ms", match.tokens, g.model, nbytes, fetch_ms,
                        publish_ms)
            return {"fetched_tokens": match.tokens, "bytes": nbytes,
                    "fetch_ms": round(fetch_ms, 3), "publish_ms": round(publish_ms, 3)}
        finally:
            if held:
                self._fetch_lock.release()

    def _ensure_region(self, store: Any, nbytes: int) -> Any:
        """A fetch region of at least `nbytes`, registered with kvtd (kvt.vllm.regions.
        WorkerRegion: again after a kvtd restart) and with the store (once per region: its
        memory never moves). It is made at the first fetch and replaced by a larger one when a
        longer prefix comes (sizes in powers of two from 64 MiB, at most fetch_region_bytes): a
        node whose prefixes are short never holds more than it uses, and kvtd maps the region
        resident."""
        from kvt.cluster import ClusterError
        from kvt.vllm.regions import WorkerRegion
        if self._region is None or self._region.byte_size < nbytes:
            size = max(nbytes, _MIN_FETCH_REGION)
            size = min(1 << (size - 1).bit_length(), self.options.fetch_region_bytes)
            self._drop_region(store)
            self._region = WorkerRegion(lambda: self.kvt()[0], size, "cluster fetches",
                                        warn=True, retry_s=5.0)
        region = self._region.get(nbytes)
        if region is None:
            raise ClusterError("store_error", "no shared-memory region registered with kvtd "
                               "for cluster fetches (kvtd's shared_memory."
                               "allow_client_regions must be on)")
        if self._registered is None or self._registered[0] is not region:
            address, _ = store.register(region.buf)
            self._registered = (region, address)
        return region

    def _drop_region(self, store: Any) -> None:
        """Unregisters and frees the current fetch region (the fetch lock is held: no fetch
        writes it)."""
        if self._registered is not None:
            try:
                store.unregister(self._registered[1])
            except Exception as error:  # the store went away: nothing is registered any more
                logger.info("kvt: cluster: unregistering the old fetch region: %s", error)
            self._registered = None
        if self._region is not None:
            self._region.close()
            self._region = None


class ClusterPut:
    """The worker side: puts published prefixes into the store, on the publisher thread."""

    def __init__(self, options: ClusterOptions, model_name: str, count: Callable[..., None]
                 ) -> None:
        self.options = options
        self.model_name = model_name
        self._count = count
        self.handle = store_handle(options)
        self._staging: Optional[np.ndarray] = None
        self._pending: Optional[Future] = None

    def put(self, kv: Any, block_ids: List[int], token_ids: List[int],
            block_tokens: int) -> None:
        """Puts tokens [0, len(token_ids)) of the blocks (whole kvtd blocks) into the store;
        failures are counted and logged, never raised."""
        from kvt.cluster import ClusterError, Geometry
        store = self.handle.get()
        if store is None:
            self._count("cluster_put_skipped")
            return
        if self._pending is not None and not self._pending.done():
            self._count("cluster_put_skipped")  # a put past its deadline still reads staging
            return
        self._pending = None
        n = len(token_ids)
        nbytes = kv.cache_bytes(n)
        if self._staging is None or self._staging.nbytes < nbytes:
            self._staging = np.empty(nbytes, np.uint8)
        packed = kv.packed(self._staging, 0, n)
        if not kv.gather_packed(block_ids, n, packed):
            self._count("cluster_put_skipped")
            return
        g = Geometry(self.model_name, kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype,
                     block_tokens, self.options.chunk_blocks)
        try:
            written, held = store.put_prefix(g, token_ids, self._staging[:nbytes],
                                             timeout=self.options.put_timeout_s)
        except ClusterError as error:
            self._pending = error.pending
            self._count("cluster_put_failed")
            self._count(f"cluster_error_{error.reason}")
            logger.warning("kvt: cluster put of %d tokens failed: %s", n, error)
            return
        self._count("cluster_puts")
        self._count("cluster_put_objects", written)
        logger.debug("kvt: cluster put of %d tokens: %d objects written, %d held", n, written,
                     held)
