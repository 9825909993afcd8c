"""The worker's publisher: a thread that publishes requests' KV to kvtd, off the engine step.

The engine step only enqueues a PublishSpec (no copy, no call). The thread then publishes the
request's blocks in the cheapest way kvtd accepts:

  in place   the engine's cache is shared with kvtd (kvt/vllm/engine_cache.py): Publish names the
             request's blocks in the kernels' own order and kvtd reads them straight out of the
             cache. Nothing is copied in the engine process.
  region     the blocks are copied into the publish region (PublishRing) and kvtd reads that.
  inline     the blocks are copied into arrays and sent as chunks.

Every way reads the request's blocks after the engine step that queued it, so the blocks must
not be reused meanwhile. vLLM frees a request's blocks in two ways: when it finishes (the
scheduler side then holds them, and the worker reports the request in finished_sending once
`busy(req_id)` is false) and when it is preempted (the scheduler side sends a fence and the
worker calls `wait_for` before the step writes any block).

A request's final publish (prompt and output) covers its prompt publish. When the final one
arrives while the prompt one is still queued (not yet started: a backlog, or a request shorter
than the delay), it takes the queued one's place: one publish instead of two, counted as
publish_coalesced.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional

from kvt.errors import NotFoundError
from kvt.vllm.engine_kv import bits_to_float
from kvt.vllm.metadata import PublishSpec
from kvt.vllm.regions import describe_error

logger = logging.getLogger("vllm.kvt")

# How long publishes stay off after kvtd said no mapper reads this model.
UNREAD_RETRY_S = 30.0


@dataclass
class _Entry:
    """A queued publish. Mutable: a final publish can take the place of its request's prompt
    publish while that one waits (under Publisher._lock)."""
    spec: PublishSpec
    queued_at: float


class Publisher:
    """`worker`: the KvtWorker whose cache and regions are published (read-only here);
    `count(name, value)`: the connector's counters."""

    def __init__(self, worker: Any, queue_size: int, count: Callable[..., None],
                 delay_s: float = 0.0) -> None:
        self.w = worker
        self._count = count
        # Each publish waits this long after the step that queued it: the step's output reaches
        # the client before kvtd's work on the publish (and this thread's) competes for the
        # cores. A fence (preemption) cuts the wait short.
        self._delay_s = delay_s
        self._hurry = threading.Event()
        self._queue: "queue.Queue[Optional[_Entry]]" = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: Counter = Counter()  # req_id -> publishes queued or running
        self._waiting: Dict[str, _Entry] = {}  # req_id -> its queued entry not yet started
        # Until then kvtd refuses this model's publishes (no mapper reads it): not sent. The
        # store may gain a reader at any time, so the refusal is asked again after a while.
        self._unread_until = 0.0
        self._thread = threading.Thread(target=self._loop, name="kvt-publish", daemon=True)
        self._thread.start()

    # -- the engine step ---------------------------------------------------------------------

    def submit(self, spec: PublishSpec) -> None:
        """Queues a publish; never blocks. A full queue drops it (counted, logged); while kvtd
        has no mapper reading this model the publish is skipped (counted)."""
        if time.monotonic() < self._unread_until:
            self._count("publish_skipped")
            return
        with self._lock:
            waiting = self._waiting.get(spec.req_id)
            if waiting is not None and spec.final and not waiting.spec.final:
                # The final publish covers the prompt one: it is published once, in its place.
                waiting.spec, waiting.queued_at = spec, time.monotonic()
                self._count("publish_coalesced")
                return
            entry = _Entry(spec, time.monotonic())
            try:
                self._queue.put_nowait(entry)
            except queue.Full:
                self._count("publish_dropped")
                logger.warning("kvt: publish queue full, dropped the %s publish of %s",
                               spec.kind, spec.req_id)
                return
            self._pending[spec.req_id] += 1
            self._waiting[spec.req_id] = entry

    def busy(self, req_id: str) -> bool:
        """Whether a publish of the request is queued or running (reads its blocks)."""
        with self._lock:
            return self._pending[req_id] > 0

    def wait_for(self, req_ids: Iterable[str], timeout: float, hurry: bool = False) -> bool:
        """Until no publish of `req_ids` is queued or running, or `timeout` s; False on timeout.
        `hurry`: the queued publishes skip what is left of their delay (the step waits)."""
        wanted = set(req_ids)
        end = time.monotonic() + timeout
        if hurry:
            self._hurry.set()
        try:
            with self._lock:
                while any(self._pending[r] > 0 for r in wanted):
                    left = end - time.monotonic()
                    if left <= 0:
                        return False
                    self._idle.wait(left)
            return True
        finally:
            if hurry:
                self._hurry.clear()

    def close(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass

    # -- the publish thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            spec = self._start(entry)
            try:
                self._publish(spec)
            except NotFoundError as error:
                if "header.model" not in str(error):
                    raise
                self._unread_until = time.monotonic() + UNREAD_RETRY_S
                self._count("publish_failed")
                logger.info("kvt: kvtd keeps no cache of this model (%s); publishes resume "
                            "in %.0f s", describe_error(error), UNREAD_RETRY_S)
            except Exception as error:
                self._count("publish_failed")
                logger.warning("kvt: publish of %s (%s, %d tokens) failed: %s", spec.req_id,
                               spec.kind, len(spec.token_ids), describe_error(error))
            finally:
                with self._lock:
                    self._pending[spec.req_id] -= 1
                    if self._pending[spec.req_id] <= 0:
                        del self._pending[spec.req_id]
                    self._idle.notify_all()

    def _start(self, entry: _Entry) -> PublishSpec:
        """Waits out the entry's delay (a coalesced final publish restarts it), then takes the
        entry out of reach of coalescing and returns what it publishes."""
        hurried = False
        while True:
            with self._lock:
                wait = entry.queued_at + self._delay_s - time.monotonic()
                if wait <= 0 or hurried:
                    spec = entry.spec
                    if self._waiting.get(spec.req_id) is entry:
                        del self._waiting[spec.req_id]
                    return spec
            hurried = self._hurry.wait(wait)

    def _publish(self, spec: PublishSpec) -> None:
        nbytes = self.w.kv.cache_bytes(len(spec.token_ids))
        if not (self._publish_in_place(spec) or self._publish_region(spec, nbytes)):
            layers = self.w.kv.gather_arrays(spec.block_ids, len(spec.token_ids))
            self._call(spec, lambda prefix, kw: prefix.publish(
                self.w.config.model_name, spec.token_ids, layers, dtype=self.w.kv.dtype,
                layout="NHD", **kw))
        self._count("publishes")
        self._count("publish_bytes", nbytes)
        if self.w.cluster_put is not None:
            # The cluster tier, after the node-local publish, still on this thread (the
            # request's blocks are held until it returns).
            try:
                self.w.cluster_put.put(self.w.kv, spec.block_ids, spec.token_ids,
                                       self.w.config.block_tokens)
            except Exception as error:
                self._count("cluster_put_failed")
                logger.warning("kvt: cluster put of %s failed: %s", spec.req_id,
                               describe_error(error))

    def _call(self, spec: PublishSpec, publish: Callable[[Any, dict], Any]) -> Any:
        _, prefix = self.w.kvt()
        return publish(prefix, {"request_id": f"{spec.req_id}/{spec.kind}",
                                "wait_for_ready": True,
                                "timeout": self.w.config.publish_timeout_s})

    def _publish_in_place(self, spec: PublishSpec) -> bool:
        """Publish naming the request's blocks of the engine's shared cache; False when the
        cache is not shared with this kvtd (then the caller copies)."""
        from kvt._proto import common_pb2
        from kvt.errors import KvtError
        holder = self.w.engine_region
        engine = holder.get(0) if holder is not None else None
        if engine is None:
            return False
        ref = common_pb2.RegionRef(region=engine.name, offset=0, byte_size=engine.byte_size)
        self.w.fill_paged_ref(ref.paged, spec.block_ids, 0, len(spec.token_ids), output=False)
        kv = self.w.kv
        try:
            self._call(spec, lambda prefix, kw: prefix.publish_region(
                self.w.config.model_name, spec.token_ids, ref, num_layers=kv.num_layers,
                num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim, dtype=kv.dtype, **kw))
        except KvtError as error:
            if "header.input.region" not in str(error):
                raise
            holder.mark_failed()  # kvtd lost or refuses the region: register again next time
            return False
        self._count("publishes_in_place")
        return True

    def _publish_region(self, spec: PublishSpec, nbytes: int) -> bool:
        """Copies the blocks into free bytes of the publish region and publishes from there;
        False (nothing sent) when there is no region, no room or no block copies."""
        from kvt.errors import KvtError
        holder, ring = self.w.publish_region, self.w.publish_ring
        region = holder.get(nbytes) if holder is not None else None
        if region is None or ring is None:
            return False
        offset = ring.allocate(nbytes)
        if offset is None:
            self._count("publish_region_full")
            return False
        kv = self.w.kv
        try:
            packed = kv.packed(region.buf, offset, len(spec.token_ids))
            if not kv.gather_packed(spec.block_ids, len(spec.token_ids), packed):
                return False
            try:
                self._call(spec, lambda prefix, kw: prefix.publish_region(
                    self.w.config.model_name, spec.token_ids, region.ref(offset, nbytes),
                    num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads,
                    head_dim=kv.head_dim, dtype=kv.dtype, **kw))
            except KvtError as error:
                if "header.input.region" not in str(error):
                    raise
                # kvtd lost or refuses the region (restarted, client regions off): the same
                # bytes inline, and register again before the next publish.
                holder.mark_failed()
                floats = bits_to_float if kv.dtype == "bf16" else (lambda a: a)
                layers = [(floats(k), floats(v)) for k, v in packed]
                self._call(spec, lambda prefix, kw: prefix.publish(
                    self.w.config.model_name, spec.token_ids, layers, dtype=kv.dtype,
                    layout="NHD", **kw))
                return True
            self._count("publishes_shm")
            return True
        finally:
            ring.free(offset)
