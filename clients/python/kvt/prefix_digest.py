"""kvt.prefix_digest: the reading side of kvtd's published-prefix digest.

kvtd keeps a counting Bloom filter over the first block of every prefix its prefix cache holds,
in a POSIX shared-memory object on its host (prefix_cache.digest_slots; the layout is in
kvt.v1.PrefixDigestInfo). A client on the same host maps it read-only and learns, without a
LookupPrefix round trip, that a prompt no stored prefix can match is a miss:

    with kvt.Client(address) as client:
        digest = PrefixDigest.of(client)          # None: kvtd has no digest
        if digest is not None and digest.live() and not digest.might_hold(prompt):
            ...                                   # certain miss: prefill, no lookup

"No" is exact while the heartbeat is fresh (kvtd updates the counters before Publish returns);
"maybe" is a false positive now and then, and LookupPrefix decides.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from kvt.errors import FailedPreconditionError
from kvt.prefix import first_block_hash

logger = logging.getLogger("kvt.prefix_digest")

SEED = "kvt.prefix_digest"     # the model name a key's chain hash is seeded with
MAGIC = b"kvtdgst1"
HEADER_BYTES = 64
# A heartbeat older than this means kvtd is gone (it rewrites it every second).
MAX_HEARTBEAT_AGE_S = 5.0
_HEADER = struct.Struct("<8sIIQQQQ")  # magic, hashes, block_tokens, slots, instance, beat, keys


class PrefixDigest:
    """A read-only mapping of one kvtd's digest (`info`: ServerMetadata's prefix_digest)."""

    def __init__(self, info: Any, shm_dir: str = "/dev/shm") -> None:
        self.name = info.shm_name
        self.block_tokens = int(info.block_tokens)
        self.slots = int(info.slots)
        self.hashes = int(info.hashes)
        self.instance = int(info.instance)
        if "/" in self.name[1:] or not self.name.startswith("/"):
            raise FailedPreconditionError(f"prefix digest: bad shm_name {self.name!r}")
        self._counters: Optional[np.ndarray] = None
        self._map: Optional[mmap.mmap] = None
        fd = os.open(shm_dir + self.name, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, HEADER_BYTES + 2 * self.slots, mmap.MAP_SHARED,
                                  mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, hashes, block_tokens, slots, instance, _, _ = _HEADER.unpack_from(self._map, 0)
        if (magic, hashes, block_tokens, slots, instance) != (
                MAGIC, self.hashes, self.block_tokens, self.slots, self.instance):
            self.close()
            raise FailedPreconditionError(
                f"prefix digest {self.name}: its header ({magic!r}, hashes {hashes}, "
                f"block_tokens {block_tokens}, slots {slots}, instance {instance:x}) is not "
                f"what kvtd announced (another kvtd's, or not a digest)")
        self._counters = np.frombuffer(self._map, dtype="<u2", count=self.slots,
                                       offset=HEADER_BYTES)

    @classmethod
    def of(cls, client: Any, timeout: Optional[float] = 5.0) -> Optional["PrefixDigest"]:
        """The digest of the kvtd behind `client` (kvt.Client), None when it announces none.
        OSError when the object cannot be opened here (kvtd on another host, or readable by its
        own user only)."""
        metadata = client.server_metadata(timeout=timeout)
        if "prefix_digest" not in metadata.extensions:
            return None
        return cls(metadata.prefix_digest)

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            raise FailedPreconditionError(f"prefix digest {self.name} is closed")
        return self._map

    def heartbeat_age_s(self) -> float:
        beat = struct.unpack_from("<Q", self._mapping(), 32)[0]
        return float("inf") if beat == 0 else time.time() - beat / 1e3

    def live(self) -> bool:
        """kvtd is still writing it (heartbeat fresh, not stopped)."""
        return self.heartbeat_age_s() <= MAX_HEARTBEAT_AGE_S

    def keys(self) -> int:
        return struct.unpack_from("<Q", self._mapping(), 40)[0]

    def might_hold(self, token_ids: Sequence[int]) -> bool:
        """False: no prefix kvtd stores starts with `token_ids`' first block (nor can one match
        when `token_ids` is shorter than a block). True: maybe."""
        key = first_block_hash(SEED, token_ids, self.block_tokens)
        if not key:
            return False
        counters = self._counters
        if counters is None:
            raise FailedPreconditionError(f"prefix digest {self.name} is closed")
        words = struct.unpack_from(f"<{self.hashes}I", bytes.fromhex(key))
        mask = self.slots - 1
        return all(counters[w & mask] != 0 for w in words)

    def close(self) -> None:
        self._counters = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a counters view still exported: the GC unmaps it
                pass
            self._map = None


class DigestFollower:
    """Keeps the digest of the kvtd behind `client()` (a kvt.Client) open for a caller that must
    never wait on kvtd: it is resolved (ServerMetadata) on `submit`'s threads, and dropped as
    soon as the client's connection to kvtd is lost (a killed kvtd's heartbeat would look fresh
    for seconds, while a restarted one already takes publishes the old digest never sees) or
    the heartbeat stops; then resolved again, at most every `retry_s` (`absent_retry_s` while
    kvtd announces no digest or it cannot be opened here)."""

    def __init__(self, client: Callable[[], Any], submit: Callable[..., Any],
                 retry_s: float = 1.0, absent_retry_s: float = 30.0) -> None:
        self._client = client
        self._submit = submit
        self._retry_s = retry_s
        self._absent_retry_s = absent_retry_s
        self._lock = threading.Lock()
        self._digest: Optional[PrefixDigest] = None
        self._pending = False
        self._next_try = 0.0
        self._watched: Any = None  # the client whose connection is watched
        self._losses = 0           # connection losses seen; a resolve spanning one is dropped
        self._was_connected = False
        self.resolves = 0          # ServerMetadata calls made (informational)

    def certain_miss(self, token_ids: Sequence[int]) -> bool:
        """True only when a live digest shows no stored prefix can match `token_ids`; False
        (ask kvtd) otherwise, starting a re-resolve when due."""
        digest = self._digest
        if digest is not None and digest.live():
            return not digest.might_hold(token_ids)
        self.refresh()
        return False

    def ready(self) -> bool:
        """Whether a live digest is held now; if not, starts a resolve when due."""
        digest = self._digest
        if digest is not None and digest.live():
            return True
        self.refresh()
        return False

    def refresh(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._pending or now < self._next_try:
                return
            self._pending = True
        try:
            self._submit(self._resolve)
        except RuntimeError:  # the executor is shut down
            with self._lock:
                self._pending = False

    def _on_connection(self, connected: bool) -> None:
        # Only a connection that was up can be lost: the channel's first report (idle, before
        # the resolve's own call connects it) drops nothing.
        with self._lock:
            if connected:
                self._was_connected = True
            elif self._was_connected:
                self._was_connected = False
                self._digest = None
                self._next_try = 0.0
                self._losses += 1

    def _resolve(self) -> None:
        digest, retry = None, self._retry_s
        with self._lock:
            losses = self._losses
        try:
            client = self._client()
            if client is not self._watched:
                # Before the call: a loss from here on drops what it resolves.
                client.watch_connection(self._on_connection)
                self._watched = client
            self.resolves += 1
            digest = PrefixDigest.of(client, timeout=2.0)
            if digest is None:
                retry = self._absent_retry_s
        except OSError as error:
            logger.info("kvt: kvtd's prefix digest cannot be opened here (%s); every lookup "
                        "asks kvtd", error)
            retry = self._absent_retry_s
        except Exception as error:  # kvtd down or restarting: ask again soon
            logger.debug("kvt: prefix digest not resolved: %s", error)
        # The old mapping is dropped, not closed: a caller may be reading it right now, and
        # the collector unmaps it after the last one.
        with self._lock:
            self._digest = digest if self._losses == losses else None
            self._pending = False
            self._next_try = time.monotonic() + retry if self._losses == losses else 0.0

    def close(self) -> None:
        with self._lock:
            self._digest = None
            self._next_try = float("inf")
