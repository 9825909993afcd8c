"""kvt.cluster: the cluster source-cache tier on Mooncake Store (docs/CLUSTER_TIER.md).

kvtd's source-cache tier is node-local. This module lets a prefix that an engine published on one
node be found and fetched on another: the publishing side also puts the prefix's blocks into
Mooncake Store (the distributed KV store vLLM deployments already run) under a versioned key
scheme; the other node asks which leading blocks the store holds (`longest_prefix`), fetches them
into a registered buffer (a kvt.shm.SharedMemoryRegion) and hands that region to its own kvtd
(`PrefixCache.publish_region`), whose LookupPrefix then applies its quality gate and leases the
prefix for TranslateKV exactly as for a local publish. Source bytes cross the network once.

kvtd is C++ and the Mooncake wheel ships no C/C++ headers, so the store is reached from Python,
by the process that also talks to kvtd for the engine (the connector).

Every store call runs on a worker thread with a deadline: a slow or hung store never blocks the
caller past it. Every failure is a ClusterError with one of REASONS:

    store_unavailable    master unreachable, store not set up or closed
    segment_unavailable  the master answers, but a transfer from the node that holds an
                         object failed (that node is gone); other objects still work
    store_timeout        the call overran its deadline (it may still finish in the background)
    evicted              an object the lookup found is gone at fetch (eviction, removal, lease)
    version_mismatch     an object under a kvt key is not what the key's scheme promises
    store_full           the store had no space for a put
    store_error          any other store status (the code is in the detail)

Objects. A published sequence of n whole blocks (block_tokens tokens each) is cut at multiples of
`chunk_blocks` blocks: objects cover blocks [0, C), [C, 2C), ... and a last, shorter one ends at
block n. The object ending at block e always starts at ((e - 1) // C) * C, so its key needs only
e and the chain hash of block e - 1, which names the model and every token before it
(prefix_cache/chain_hash.h). Two publishers of a shared prefix write the same keys for their
shared whole chunks. A lookup asks for the key ending at every block (one batched is_exist): the
prefix of m blocks is held when every chunk end <= m exists and m is a chunk end or an object ends
there. Per block keys would multiply master metadata, allocations and transfer descriptors by C
for blocks of a few KiB to a few MiB; a chunk costs at most C - 1 blocks of match granularity
against a longer publisher's prefix (default C = 4: 48 tokens).

Key (CLUSTER_KEY_VERSION "v1"; every property that changes the bytes is in it):

    kvt/v1/{model}/{dtype}/bt{block_tokens}.c{chunk_blocks}/l{layers}.h{kv_heads}.d{head_dim}/nhd/
        {start_block}-{end_block}/{chain_hash_hex}

`model` is percent-encoded (no "/" inside a component). Object bytes: a 64-byte header (magic
"KVTC", the scheme version, dtype, geometry, block range, payload size, chain hash; checked on
every fetch) followed by, per layer, K then V of the object's tokens, each [tokens, kv_heads,
head_dim] of `dtype` (bf16 as its bit patterns): the packed region format of
PrefixCache.publish_region, cut to the object's tokens.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import os
import queue
import socket
import struct
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, cast
from urllib.parse import quote, urlsplit

from kvt.cache import ELEMENT_SIZE
from kvt.errors import InvalidArgumentError

CLUSTER_KEY_VERSION = "v1"
HEADER_BYTES = 64
_MAGIC = b"KVTC"
_HEADER_VERSION = 1
_DTYPE_CODES = {"fp32": 1, "fp16": 2, "bf16": 3}
# magic, version, dtype, reserved, block_tokens, chunk_blocks, layers, heads, head_dim,
# start_block, end_block, payload bytes, chain hash; padded to HEADER_BYTES.
_HEADER = struct.Struct("<4sHBBIIIIIIIQ16s")

REASONS = ("store_unavailable", "segment_unavailable", "store_timeout", "evicted",
           "version_mismatch", "store_full", "store_error")

# Mooncake Store's ErrorCode values (mooncake-store/include/types.h); Python gets the ints.
_NO_AVAILABLE_HANDLE = -200
_INVALID_PARAMS = -600
_REPLICA_IS_NOT_READY = -703
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_LEASE_EXPIRED = -707
_TRANSFER_FAIL = -800
_UNAVAILABLE = {-100, -101, -102, -103, -900, -901, -1000, -1001, -1002, -1003, -1010, -1011}
_GONE = {_REPLICA_IS_NOT_READY, _OBJECT_NOT_FOUND, _LEASE_EXPIRED}

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _health(method: F) -> F:
    """ClusterStore methods that keep the store's health (ClusterStore._observed)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._observed(lambda: method(self, *args, **kwargs))

    return cast(F, wrapper)


class ClusterError(Exception):
    """A cluster-tier call that did not succeed: `reason` is one of REASONS. For a call that
    overran its deadline, `pending` is the still-running call's Future: a buffer it writes into
    must not be reused or handed to kvtd before `pending.done()`."""

    def __init__(self, reason: str, detail: str, code: int = 0,
                 pending: Optional["Future[Any]"] = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.code = code
        self.pending = pending


def _reason_of(code: int) -> str:
    if code in _UNAVAILABLE:
        return "store_unavailable"
    if code == _TRANSFER_FAIL:
        return "segment_unavailable"
    if code in _GONE:
        return "evicted"
    if code == _NO_AVAILABLE_HANDLE:
        return "store_full"
    return "store_error"


# -- geometry and keys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """What makes a model's cache bytes what they are: a key names all of it."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "fp32"
    block_tokens: int = 16
    chunk_blocks: int = 4

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_SIZE:
            raise InvalidArgumentError(f"dtype: unknown dtype {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "chunk_blocks"):
            if getattr(self, name) <= 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.model:
            raise InvalidArgumentError("model: empty")

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * ELEMENT_SIZE[self.dtype]

    def packed_bytes(self, num_tokens: int) -> int:
        """Bytes of the packed region format of `num_tokens` tokens."""
        return 2 * self.num_layers * num_tokens * self.token_bytes

    def chunk_start(self, end_block: int) -> int:
        return ((end_block - 1) // self.chunk_blocks) * self.chunk_blocks

    def key_prefix(self, version: str = CLUSTER_KEY_VERSION) -> str:
        return (f"kvt/{version}/{quote(self.model, safe='-._~')}/{self.dtype}/"
                f"bt{self.block_tokens}.c{self.chunk_blocks}/"
                f"l{self.num_layers}.h{self.num_kv_heads}.d{self.head_dim}/nhd/")

    def key(self, end_block: int, chain_hash: bytes, version: str = CLUSTER_KEY_VERSION) -> str:
        """The key of the object that ends at block `end_block` (exclusive) whose last block has
        chain hash `chain_hash`."""
        return (f"{self.key_prefix(version)}{self.chunk_start(end_block)}-{end_block}/"
                f"{chain_hash.hex()}")

    def header(self, start: int, end: int, chain_hash: bytes) -> bytes:
        payload = self.packed_bytes((end - start) * self.block_tokens)
        return _HEADER.pack(_MAGIC, _HEADER_VERSION, _DTYPE_CODES[self.dtype], 0,
                            self.block_tokens, self.chunk_blocks, self.num_layers,
                            self.num_kv_heads, self.head_dim, start, end, payload,
                            chain_hash).ljust(HEADER_BYTES, b"\0")


def chain_hashes(model: str, token_ids: Sequence[int], block_tokens: int) -> List[bytes]:
    """The 16-byte chain hash of every whole block, as kvtd computes them
    (prefix_cache/chain_hash.h; kvt.prefix.first_block_hash is the first)."""
    hashes: List[bytes] = []
    name = model.encode()
    previous = struct.pack("<Q", len(name)) + name
    for b in range(len(token_ids) // block_tokens if block_tokens > 0 else 0):
        block = token_ids[b * block_tokens:(b + 1) * block_tokens]
        previous = hashlib.sha256(previous + struct.pack(f"<{block_tokens}I", *block)).digest()[:16]
        hashes.append(previous)
    return hashes


def object_ends(num_blocks: int, chunk_blocks: int) -> List[int]:
    """End blocks of the objects a sequence of `num_blocks` whole blocks is stored as."""
    ends = list(range(chunk_blocks, num_blocks + 1, chunk_blocks))
    if num_blocks % chunk_blocks:
        ends.append(num_blocks)
    return ends


@dataclass
class PrefixMatch:
    """How many leading blocks of a token sequence the store holds as one model's cache, and
    the objects (key, start block, end block) that hold them, in order."""

    geometry: Geometry
    blocks: int
    objects: List[Tuple[str, int, int]] = field(default_factory=list)
    hashes: List[bytes] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.blocks * self.geometry.block_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the fetched prefix in the packed region format."""
        return self.geometry.packed_bytes(self.tokens)


# -- deadlines -----------------------------------------------------------------------------------


class _Workers:
    """Daemon threads that run blocking store calls. A caller waits at most its timeout; a call
    that overruns keeps its thread until it returns. When every thread is held by such overdue
    calls, new calls fail at once (store_timeout) instead of queueing behind them. Daemon threads:
    a hung store call never holds the process at exit either."""

    def __init__(self, threads: int) -> None:
        self._queue: "queue.Queue[Optional[Tuple[Callable[[], Any], Future[Any]]]]" = (
            queue.Queue())
        self._lock = threading.Lock()
        self._threads = threads
        self._overdue: set = set()
        self._running = 0
        for i in range(threads):
            threading.Thread(target=self._loop, name=f"kvt-cluster-{i}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running += 1
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to the caller
                future.set_exception(error)
            with self._lock:
                self._overdue.discard(future)
                self._running -= 1

    def overdue(self) -> int:
        with self._lock:
            return len(self._overdue)

    def wait_idle(self, timeout: float) -> bool:
        """Until no call runs (True) or `timeout` passed (False)."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._running == 0:
                    return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)

    def shutdown(self) -> None:
        """Each thread ends after the call it runs (if any) returns."""
        for _ in range(self._threads):
            self._queue.put(None)

    def run(self, what: str, fn: Callable[[], T], timeout: float) -> T:
        with self._lock:
            if len(self._overdue) >= self._threads:
                raise ClusterError("store_timeout", f"{what}: every store thread is still held "
                                   f"by a call past its deadline")
        future: "Future[T]" = Future()
        self._queue.put((fn, future))
        try:
            future.exception(timeout=max(0.0, timeout))
        except FuturesTimeout:
            pass
        else:
            error = future.exception()
            if error is None:
                return future.result()
            if isinstance(error, ClusterError):
                raise error
            raise ClusterError("store_error", f"{what}: {error!r}") from error
        if future.cancel():  # never started: nothing to wait for
            raise ClusterError("store_timeout", f"{what}: not started within {timeout:.3f} s")
        with self._lock:
            if not future.done():
                self._overdue.add(future)
        raise ClusterError("store_timeout", f"{what}: no answer within {timeout:.3f} s",
                           pending=future)


class _HeaderSlots:
    """A registered scratch area of HEADER_BYTES slots that object headers are read into and
    written from (registered once at setup: a registration per call would need the metadata
    server on every fetch). A slot is given back when the store call using it returns, not when
    its caller stops waiting."""

    def __init__(self, count: int) -> None:
        self.buffer = bytearray(count * HEADER_BYTES)
        self.address, _ = buffer_address(self.buffer)
        self._free = list(range(count))
        self._lock = threading.Lock()

    def take(self, n: int) -> List[int]:
        with self._lock:
            if n > len(self._free):
                raise ClusterError("store_timeout", f"{n} header slots wanted, "
                                   f"{len(self._free)} free (the others are held by calls "
                                   f"still running)")
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def give(self, slots: List[int]) -> None:
        with self._lock:
            self._free += slots

    def pointer(self, slot: int) -> int:
        return self.address + slot * HEADER_BYTES

    def write(self, slot: int, data: bytes) -> None:
        self.buffer[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES] = data

    def read(self, slot: int) -> bytes:
        return bytes(self.buffer[slot * HEADER_BYTES:(slot + 1) * HEADER_BYTES])


# Store clients closed while a call past its deadline still ran in them: never destroyed (their
# destructor would free what that call uses), kept until the process exits.
_ABANDONED: List[Any] = []


# -- the store -----------------------------------------------------------------------------------


@dataclass
class StoreConfig:
    """Where the Mooncake master and metadata server are, this client's segment, and deadlines.

    global_segment_size: bytes this process contributes to the store (0: a pure client; objects
    then live in other processes' segments, e.g. mooncake_client holders).
    """

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20
    protocol: str = "tcp"
    device_name: str = ""
    header_slots: int = 4096  # objects in flight at once (fetches and puts together)
    setup_timeout_s: float = 10.0
    lookup_timeout_s: float = 0.5
    fetch_timeout_s: float = 5.0
    put_timeout_s: float = 5.0
    threads: int = 4
    # After a call found the store unreachable, calls fail at once (store_unavailable) for this
    # long, then one call tries it again: a down master costs a Mooncake client seconds per call.
    unavailable_backoff_s: float = 1.0


# Buffers (slices) per batched put or get call. A put of 64 objects of 33 slices each (2112)
# hung past a minute on loopback TCP (Mooncake 0.3.13.post1) where 32 such objects (1056) took
# 0.13 s: larger batches are cut into calls of at most this many slices.
MAX_SLICES_PER_CALL = 1024


def _batches(pointers: List[List[int]]) -> List[Tuple[int, int]]:
    """[a, b) ranges of objects whose slices add up to at most MAX_SLICES_PER_CALL (at least
    one object per range)."""
    ranges, start, count = [], 0, 0
    for i, ptrs in enumerate(pointers):
        if i > start and count + len(ptrs) > MAX_SLICES_PER_CALL:
            ranges.append((start, i))
            start, count = i, 0
        count += len(ptrs)
    if start < len(pointers):
        ranges.append((start, len(pointers)))
    return ranges


def _check_reachable(endpoint: str, timeout: float) -> None:
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)),
                                      timeout=timeout):
            pass
    except (OSError, ValueError) as error:
        raise ClusterError("store_unavailable", f"{endpoint} is unreachable: {error}") from error


def buffer_address(buffer: Any) -> Tuple[int, int]:
    """(address, bytes) of a writable, contiguous buffer (memoryview, bytearray, numpy array,
    a kvt.shm.SharedMemoryRegion's buf). The address stays valid while the buffer's memory
    does; no export of the buffer is kept."""
    view = memoryview(buffer)
    try:
        if not view.contiguous:
            raise InvalidArgumentError("buffer: not contiguous")
        if view.readonly:
            import numpy as np

            array = np.frombuffer(view, dtype=np.uint8)
            address = int(array.ctypes.data)
            del array
            return address, view.nbytes
        holder = (ctypes.c_char * view.nbytes).from_buffer(view)
        address = ctypes.addressof(holder)
        del holder
        return address, view.nbytes
    finally:
        view.release()


class ClusterStore:
    """A MooncakeDistributedStore behind deadlines, and the kvt object scheme on top of it.

    Thread-safe. close() abandons calls still running past their deadlines."""

    def __init__(self, config: StoreConfig, timeout: Optional[float] = None) -> None:
        self.config = config
        try:
            module = importlib.import_module("mooncake.store")
        except ImportError as error:
            raise ClusterError("store_unavailable", f"mooncake.store: {error}") from error
        self._workers = _Workers(config.threads)
        self._store: Any = None
        self._closed = False
        self._registered: List[Tuple[int, int]] = []
        self._lock = threading.Lock()
        self._down_at: Optional[float] = None  # when a call last found the store unreachable
        self._down_detail = ""
        self._probe: Optional[int] = None  # the thread trying the store again while it is down
        store = module.MooncakeDistributedStore()

        def setup() -> int:
            return int(store.setup(config.local_hostname, config.metadata_server,
                                   config.global_segment_size, config.local_buffer_size,
                                   config.protocol, config.device_name,
                                   config.master_server_address))

        wait = timeout or config.setup_timeout_s
        deadline = time.monotonic() + wait
        # MooncakeDistributedStore.setup holds the GIL while it retries an unreachable master
        # (90 s measured), which no worker thread can bound: the master (and an HTTP metadata
        # server) must accept a connection first.
        endpoints = [config.master_server_address]
        if config.metadata_server.startswith("http://"):
            endpoints.append(urlsplit(config.metadata_server).netloc)
        try:
            for endpoint in endpoints:
                _check_reachable(endpoint, max(0.05, min(1.0, deadline - time.monotonic())))
            code = self._workers.run("setup", setup, wait)
        except ClusterError:
            _ABANDONED.append(store)
            self._workers.shutdown()
            raise
        if code != 0:
            _ABANDONED.append(store)
            self._workers.shutdown()
            raise ClusterError("store_unavailable",
                               f"setup against master {config.master_server_address} "
                               f"returned {code}", code)
        self._store = store
        self._slots = _HeaderSlots(config.header_slots)
        try:
            self._register_span(self._slots.address, len(self._slots.buffer),
                                max(0.0, deadline - time.monotonic()))
        except ClusterError:
            self.close(timeout=max(0.0, deadline - time.monotonic()))
            raise

    # -- raw calls, each under a deadline --------------------------------------------------------

    def _run(self, what: str, fn: Callable[[Any], T], timeout: float) -> T:
        store = self._store
        if store is None or self._closed:
            raise ClusterError("store_unavailable", f"{what}: the store is closed")
        now = time.monotonic()
        me = threading.get_ident()
        with self._lock:
            if self._down_at is not None and self._probe != me:
                ago = now - self._down_at
                if ago < self.config.unavailable_backoff_s or self._probe is not None:
                    raise ClusterError("store_unavailable", f"{what}: not tried, the store was "
                                       f"unreachable {ago:.2f} s ago ({self._down_detail})")
                self._probe = me  # this call tries the store again; the others fail fast
        return self._workers.run(what, lambda: fn(store), timeout)

    def _observed(self, call: Callable[[], T]) -> T:
        """Runs a public call and keeps the store's health: a store_unavailable marks it down
        (calls fail fast for unavailable_backoff_s, then one call tries again); a store_timeout
        while it is down is reported as store_unavailable; a success marks it up."""
        with self._lock:
            was_down = self._down_at is not None
        try:
            result = call()
        except ClusterError as error:
            if error.reason == "store_timeout" and was_down:
                error = ClusterError("store_unavailable", f"{error.detail} (and the store was "
                                     f"unreachable before: {self._down_detail})", error.code,
                                     error.pending)
            if error.reason == "store_unavailable":
                with self._lock:
                    if self._down_at is None or self._probe == threading.get_ident():
                        self._down_at = time.monotonic()
                        self._down_detail = error.detail
            raise error
        finally:
            with self._lock:
                if self._probe == threading.get_ident():
                    self._probe = None
        with self._lock:
            self._down_at = None
        return result

    @_health
    def exists(self, keys: Sequence[str], timeout: Optional[float] = None) -> List[bool]:
        if not keys:
            return []
        codes = self._run("batch_is_exist",
                          lambda s: list(s.batch_is_exist(list(keys))),
                          self.config.lookup_timeout_s if timeout is None else timeout)
        bad = [c for c in codes if c < 0]
        if bad:
            raise ClusterError(_reason_of(bad[0]) if bad[0] != -1 else "store_unavailable",
                               f"batch_is_exist of {len(keys)} keys: {bad[0]}", bad[0])
        return [c == 1 for c in codes]

    @_health
    def remove(self, keys: Sequence[str], force: bool = True,
               timeout: Optional[float] = None) -> List[int]:
        return self._run("batch_remove", lambda s: list(s.batch_remove(list(keys), force)),
                         self.config.lookup_timeout_s if timeout is None else timeout)

    @_health
    def put_raw(self, key: str, data: bytes, timeout: Optional[float] = None) -> None:
        """One object from bytes (no scheme: tests, tools)."""
        code = self._run("put", lambda s: int(s.put(key, data)),
                         self.config.put_timeout_s if timeout is None else timeout)
        if code != 0 and code != _OBJECT_ALREADY_EXISTS:
            raise ClusterError(_reason_of(code), f"put {key}: {code}", code)

    @_health
    def register(self, buffer: Any, timeout: Optional[float] = None) -> Tuple[int, int]:
        """Registers a buffer that fetches write into (or puts read from) with the transfer
        engine, for as long as it lives; returns (address, bytes). A registered span is kept
        until unregister()."""
        address, size = buffer_address(buffer)
        self._register_span(address, size, timeout)
        return address, size

    def _register_span(self, address: int, size: int, timeout: Optional[float]) -> None:
        code = self._run("register_buffer", lambda s: int(s.register_buffer(address, size)),
                         self.config.fetch_timeout_s if timeout is None else timeout)
        if code != 0:
            raise ClusterError(_reason_of(code), f"register_buffer: {code}", code)
        with self._lock:
            self._registered.append((address, size))

    def unregister(self, address: int, timeout: Optional[float] = None) -> None:
        with self._lock:
            self._registered = [r for r in self._registered if r[0] != address]
        self._run("unregister_buffer", lambda s: int(s.unregister_buffer(address)),
                  self.config.fetch_timeout_s if timeout is None else timeout)

    def _covered(self, address: int, size: int) -> bool:
        with self._lock:
            return any(a <= address and address + size <= a + n for a, n in self._registered)

    # -- the scheme ------------------------------------------------------------------------------

    @_health
    def put_prefix(self, geometry: Geometry, token_ids: Sequence[int], packed: Any,
                   timeout: Optional[float] = None) -> Tuple[int, int]:
        """Stores `token_ids`' whole blocks of `geometry.model`'s cache from `packed`, the packed
        region format of all of token_ids (per layer K then V, each [len(token_ids), kv_heads,
        head_dim] of geometry.dtype): one object per chunk (see the module doc), gathered from
        `packed` without a copy. Objects the store already holds are not written again.
        Returns (objects written, objects already held)."""
        deadline = time.monotonic() + (self.config.put_timeout_s if timeout is None else timeout)
        tokens = [int(t) for t in token_ids]
        address, size = buffer_address(packed)
        if size != geometry.packed_bytes(len(tokens)):
            raise InvalidArgumentError(f"packed has {size} bytes; {len(tokens)} tokens of "
                                       f"{geometry} are {geometry.packed_bytes(len(tokens))}")
        hashes = chain_hashes(geometry.model, tokens, geometry.block_tokens)
        ends = object_ends(len(hashes), geometry.chunk_blocks)
        if not ends:
            return 0, 0
        keys = [geometry.key(e, hashes[e - 1]) for e in ends]
        held = self.exists(keys, timeout=deadline - time.monotonic())
        todo = [(k, e) for k, e, h in zip(keys, ends, held) if not h]
        if not todo:
            return 0, len(keys)
        slots = self._slots.take(len(todo))
        pointers, sizes = [], []
        per_token = geometry.token_bytes
        for i, (key, end) in enumerate(todo):
            start = geometry.chunk_start(end)
            self._slots.write(slots[i], geometry.header(start, end, hashes[end - 1]))
            ptrs, lens = [self._slots.pointer(slots[i])], [HEADER_BYTES]
            count = (end - start) * geometry.block_tokens * per_token
            for part in range(2 * geometry.num_layers):
                ptrs.append(address + (part * len(tokens) + start * geometry.block_tokens)
                            * per_token)
                lens.append(count)
            pointers.append(ptrs)
            sizes.append(lens)
        todo_keys = [k for k, _ in todo]
        keep_alive = packed

        def put(store: Any) -> List[int]:
            # The source is registered for this call only (unless register()ed); `packed`
            # stays referenced by this closure until it returns, even past the caller's deadline.
            assert keep_alive is not None
            registered = False
            try:
                if not self._covered(address, size):
                    code = int(store.register_buffer(address, size))
                    if code != 0:
                        return [code] * len(todo_keys)
                    registered = True
                codes: List[int] = []
                for a, b in _batches(pointers):
                    codes += [int(c) for c in store.batch_put_from_multi_buffers(
                        todo_keys[a:b], pointers[a:b], sizes[a:b])]
                return codes
            finally:
                if registered:
                    store.unregister_buffer(address)
                self._slots.give(slots)

        try:
            codes = self._run(f"put of {len(todo)} objects", put, deadline - time.monotonic())
        except ClusterError as error:
            if error.pending is None:
                self._slots.give(slots)  # never ran
            raise
        bad = [c for c in codes if c not in (0, _OBJECT_ALREADY_EXISTS)]
        if bad:
            raise ClusterError(_reason_of(bad[0]), f"put of {len(todo)} objects: {codes}", bad[0])
        return sum(1 for c in codes if c == 0), len(keys) - len(todo) + sum(
            1 for c in codes if c == _OBJECT_ALREADY_EXISTS)

    @_health
    def longest_prefix(self, geometries: Sequence[Geometry], token_ids: Sequence[int],
                       max_tokens: int = 0, timeout: Optional[float] = None
                       ) -> Dict[str, PrefixMatch]:
        """Per candidate source (model and geometry), how many leading whole blocks of token_ids
        (at most max_tokens tokens; 0 = all) the store holds: one batched is_exist over every
        candidate's keys. Models with no block held map to a match of 0 blocks."""
        tokens = [int(t) for t in token_ids]
        if max_tokens > 0:
            tokens = tokens[:max_tokens]
        plans = []
        keys: List[str] = []
        for geometry in geometries:
            hashes = chain_hashes(geometry.model, tokens, geometry.block_tokens)
            first = len(keys)
            keys += [geometry.key(e, hashes[e - 1]) for e in range(1, len(hashes) + 1)]
            plans.append((geometry, hashes, first))
        held = self.exists(keys, timeout=timeout)
        matches: Dict[str, PrefixMatch] = {}
        for geometry, hashes, first in plans:
            have = held[first:first + len(hashes)]
            c = geometry.chunk_blocks
            best = 0
            for m in range(1, len(hashes) + 1):
                if m % c == 0 and not have[m - 1]:
                    break  # a whole chunk missing: nothing longer can be assembled
                if have[m - 1]:
                    best = m
            objects = [(keys[first + e - 1], geometry.chunk_start(e), e)
                       for e in object_ends(best, c)]
            matches[geometry.model] = PrefixMatch(geometry, best, objects, hashes[:best])
        return matches

    @_health
    def fetch(self, match: PrefixMatch, buffer: Any, offset: int = 0,
              timeout: Optional[float] = None) -> int:
        """Reads the matched prefix into `buffer` at `offset` in the packed region format of
        match.tokens tokens (what PrefixCache.publish_region takes), straight from the store's
        segments into the buffer (no staging copy); returns the bytes written. The buffer must
        have been register()ed (a kvt.shm.SharedMemoryRegion's buf, registered once). Raises
        ClusterError: evicted when an object is gone, version_mismatch when one is not what its
        key promises; a store_timeout's `pending` is the still-running read into the buffer."""
        geometry = match.geometry
        if match.blocks <= 0:
            return 0
        address, size = buffer_address(buffer)
        if offset < 0 or offset + match.nbytes > size:
            raise InvalidArgumentError(f"buffer of {size} bytes cannot take {match.nbytes} "
                                       f"bytes at {offset}")
        base = address + offset
        if not self._covered(base, match.nbytes):
            raise InvalidArgumentError("buffer: not registered with this store (register())")
        slots = self._slots.take(len(match.objects))
        total_tokens = match.tokens
        per_token = geometry.token_bytes
        pointers, sizes = [], []
        for i, (_, start, end) in enumerate(match.objects):
            ptrs, lens = [self._slots.pointer(slots[i])], [HEADER_BYTES]
            count = (end - start) * geometry.block_tokens * per_token
            for part in range(2 * geometry.num_layers):
                ptrs.append(base + (part * total_tokens + start * geometry.block_tokens)
                            * per_token)
                lens.append(count)
            pointers.append(ptrs)
            sizes.append(lens)
        keys = [key for key, _, _ in match.objects]

        headers: List[bytes] = []

        def get(store: Any) -> List[int]:
            try:
                codes: List[int] = []
                for a, b in _batches(pointers):
                    codes += [int(c) for c in store.batch_get_into_multi_buffers(
                        keys[a:b], pointers[a:b], sizes[a:b])]
                headers.extend(self._slots.read(slot) for slot in slots)
                return codes
            finally:
                self._slots.give(slots)

        wait = self.config.fetch_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        try:
            codes = self._run(f"fetch of {len(keys)} objects", get, wait)
        except ClusterError as error:
            if error.pending is None:
                self._slots.give(slots)  # never ran
            raise
        for i, code in enumerate(codes):
            key, start, end = match.objects[i]
            want = HEADER_BYTES + geometry.packed_bytes((end - start) * geometry.block_tokens)
            if code >= 0:
                if code != want:
                    raise ClusterError("version_mismatch", f"{key}: {code} bytes, not {want}")
                continue
            if code in (_INVALID_PARAMS, _TRANSFER_FAIL):
                # Buffers shorter (-600) or longer (-800) than the object, or a failed transfer.
                stored = self._run("get_size", lambda s: int(s.get_size(key)),
                                   max(0.0, deadline - time.monotonic()))
                if stored >= 0 and stored != want:
                    raise ClusterError("version_mismatch",
                                       f"{key}: {stored} bytes, not {want}", code)
                if stored in _GONE:
                    raise ClusterError("evicted", f"{key}: gone ({stored})", stored)
            raise ClusterError(_reason_of(code), f"fetch {key}: {code}", code)
        expected_header = [geometry.header(start, end, match.hashes[end - 1])
                           for _, start, end in match.objects]
        for i, want_header in enumerate(expected_header):
            got = headers[i]
            if got != want_header:
                magic, version = got[:4], struct.unpack_from("<H", got, 4)[0]
                raise ClusterError("version_mismatch",
                                   f"{match.objects[i][0]}: header {magic!r} version {version} "
                                   f"does not match the key's scheme")
        return match.nbytes

    def close(self, timeout: float = 5.0) -> None:
        """Closes the store client once no call runs in it any more. When calls past their
        deadlines still run after `timeout`, or close itself hangs, the client is abandoned
        (kept, never destroyed, until the process exits): destroying it under a running call
        would free what that call uses."""
        if self._closed:
            return
        store, self._closed = self._store, True
        self._store = None
        if store is None:
            return
        end = time.monotonic() + timeout
        try:
            if not self._workers.wait_idle(timeout):
                _ABANDONED.append(store)
                return
            try:
                self._workers.run("close", lambda: store.close(),
                                  max(0.0, end - time.monotonic()))
            except ClusterError:
                _ABANDONED.append(store)
        finally:
            self._workers.shutdown()

    def __enter__(self) -> "ClusterStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def loopback_environment() -> None:
    """Makes the transfer engine advertise 127.0.0.1 (single-host tests and demos): without it
    it advertises the first interface's address."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


__all__: List[str] = ["CLUSTER_KEY_VERSION", "HEADER_BYTES", "REASONS", "ClusterError",
                      "ClusterStore", "Geometry", "PrefixMatch", "StoreConfig", "buffer_address",
                      "chain_hashes", "loopback_environment", "object_ends"]
