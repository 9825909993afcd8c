"""Shared-memory transport helpers: a POSIX shared-memory object created by this process and
registered with kvtd, so caches travel through it instead of through the gRPC stream.

kvtd maps the object by its shm_open name (`key`) and reads or writes caches packed layer-major
(per layer K then V, no padding) at the offsets a TranslateKV header names. The server must run
with shared_memory.allow_client_regions: true, on the same host; under auth, registering needs
the admin role.
"""

from __future__ import annotations

import os
import threading
import uuid
from multiprocessing import shared_memory
from typing import Any, Optional, Protocol

from kvt._proto import common_pb2
from kvt.cache import ELEMENT_SIZE, KVCache, paged_nbytes, read_paged, write_paged
from kvt.errors import InvalidArgumentError, KvtError


class MemoryRegistrar(Protocol):
    """What a region needs of the client that registers it (kvt.Client is one)."""

    def register_system_memory(self, name: str, key: str, byte_size: int, offset: int = 0,
                               timeout: Optional[float] = None) -> None: ...

    def unregister_system_memory(self, name: str, timeout: Optional[float] = None) -> None: ...


def unique_region_name() -> str:
    """A region name no other process or thread of this host picks."""
    return f"kvt-py-{os.getpid()}-{threading.get_ident() % 100000}-{uuid.uuid4().hex[:12]}"


class SharedMemoryRegion:
    """Creates a POSIX shm object of `byte_size` bytes and registers it with the server as
    `name` (a unique name by default). close() (or leaving the `with` block) unregisters it and
    unlinks the object; a failed registration unlinks it before the error propagates.

    Arrays returned by read_cache() are copies, so the object can be closed while they live.
    """

    def __init__(self, client: MemoryRegistrar, byte_size: int, name: Optional[str] = None,
                 timeout: Optional[float] = None) -> None:
        if byte_size <= 0:
            raise InvalidArgumentError(f"shared-memory region byte_size must be > 0: {byte_size}")
        self._client: Optional[MemoryRegistrar] = client
        self.name = name or unique_region_name()
        self.byte_size = byte_size
        self._timeout = timeout
        self._shm: Optional[shared_memory.SharedMemory] = shared_memory.SharedMemory(
            create=True, size=byte_size)
        try:
            client.register_system_memory(self.name, self.key, byte_size, 0, timeout)
        except BaseException:
            self._client = None
            self._release()
            raise

    @property
    def key(self) -> str:
        """The shm_open name of the object ("/psm_..."), as RegisterSystemMemory takes it."""
        if self._shm is None:
            raise InvalidArgumentError(f"region {self.name} is closed")
        return "/" + self._shm.name.lstrip("/")

    @property
    def buf(self) -> memoryview:
        if self._shm is None or self._shm.buf is None:
            raise InvalidArgumentError(f"region {self.name} is closed")
        return self._shm.buf

    def _range(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise InvalidArgumentError(
                f"bytes [{offset}, {offset + size}) lie outside region {self.name} "
                f"({self.byte_size} bytes)")
        return self.buf[offset:offset + size]

    def ref(self, offset: int, byte_size: int) -> common_pb2.RegionRef:
        self._range(offset, byte_size)
        return common_pb2.RegionRef(region=self.name, offset=offset, byte_size=byte_size)

    def write(self, offset: int, data: bytes) -> None:
        view = self._range(offset, len(data))
        view[:] = data
        view.release()

    def read(self, offset: int, size: int) -> bytes:
        view = self._range(offset, size)
        try:
            return bytes(view)
        finally:
            view.release()

    def write_cache(self, cache: KVCache, offset: int = 0) -> int:
        """Packs `cache` at `offset` in the region format; returns the bytes written."""
        view = self._range(offset, cache.nbytes)
        try:
            position = 0
            for part in cache.packed():
                view[position:position + len(part)] = part
                position += len(part)
        finally:
            view.release()
        return cache.nbytes

    def read_cache(self, offset: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   num_tokens: int, dtype: str, layout: str = "HND") -> KVCache:
        """A copy of the packed cache of that shape at `offset`."""
        if dtype not in ELEMENT_SIZE:
            raise InvalidArgumentError(f"dtype: unknown dtype {dtype!r}")
        size = 2 * num_layers * num_kv_heads * head_dim * num_tokens * ELEMENT_SIZE[dtype]
        return KVCache.unpack(self.read(offset, size), num_layers, num_kv_heads, head_dim,
                              num_tokens, dtype, layout)

    def write_paged(self, cache: KVCache, offset: int, paged: common_pb2.PagedBlocks,
                    block_layout: str = "NHD") -> int:
        """Scatters `cache` into the vLLM paged cache at `offset` (RegionRef.paged: per layer
        (2, num_blocks, block_size, heads, head_dim), blocks ordered by `block_layout`) at the
        slots of paged.block_table; returns the paged cache's byte size."""
        size = paged_nbytes(cache.num_layers, paged.num_blocks, paged.block_size,
                            cache.num_kv_heads, cache.head_dim, cache.dtype or "fp32")
        view = self._range(offset, size)
        try:
            write_paged(cache, view, paged, block_layout)
        finally:
            view.release()
        return size

    def read_paged(self, offset: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   num_tokens: int, dtype: str, paged: common_pb2.PagedBlocks,
                   block_layout: str = "NHD", layout: str = "HND") -> KVCache:
        """A copy of the request's tokens gathered out of the paged cache at `offset`."""
        size = paged_nbytes(num_layers, paged.num_blocks, paged.block_size, num_kv_heads,
                            head_dim, dtype)
        data = self.read(offset, size)
        return read_paged(data, num_layers, num_kv_heads, head_dim, num_tokens, dtype, paged,
                          block_layout, layout)

    def _release(self) -> None:
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.close()
            shm.unlink()

    def close(self) -> None:
        """Unregisters (if still registered), then unlinks the object even if that failed (the
        unregister error is raised after). Idempotent."""
        client, self._client = self._client, None
        try:
            if client is not None:
                client.unregister_system_memory(self.name, self._timeout)
        finally:
            self._release()

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        try:
            self.close()
        except KvtError:
            if exc is None:
                raise
            # Keep the error that ended the block; the object is unlinked regardless.

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
