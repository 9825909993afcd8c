"""vLLM's own paged KV cache as a shared-memory region kvtd writes translated prefixes into.

vLLM 0.32 allocates every layer's KV cache in one backing tensor (vllm/v1/worker/utils.py,
allocate_kv_cache). On CPU that is a private anonymous mapping of this process. `share_in_place`
moves it, without changing its address or contents, onto a POSIX shared-memory object: the
object is filled with the current bytes and mapped over the same pages (MAP_FIXED), so every
tensor, view and kernel of vLLM keeps working on the same addresses while kvtd, which maps the
object by name, reads and writes the very blocks the attention kernels use. A translated load
then needs no copy in the engine at all: kvtd scatters each target layer into the request's
blocks in the kernels' own order (RegionRef.paged.engine_order), and the connector only waits
for the trailer.

No library does this (it is the CPU counterpart of registering the GPU cache for CUDA IPC):
hence the few lines of mmap through ctypes here. It refuses, and the connector keeps its other
transports, when the backing allocation is not a mapping of its own (it must not share pages
with other heap objects), when the platform is not Linux, or when any step fails.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import sys
import time
import uuid
from typing import Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger("vllm.kvt")

_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_SHARED, _MAP_FIXED, _MAP_POPULATE = 0x01, 0x10, 0x8000
_CHUNK_BYTES = 64 << 20
_SHM_DIR = "/dev/shm/"
_OBJECT_PREFIX = "kvt-engine-"
_STALE_AFTER_S = 60.0


class EngineCacheRegion:
    """The shared-memory object now backing vLLM's KV cache: `key` (its shm_open name),
    `byte_size` (the page-aligned span of the backing tensor) and `base` (its address here).
    `offset_of(tensor)`: a layer tensor's byte offset inside the span. close() unlinks the name
    (the mapping stays, as the engine still uses it)."""

    def __init__(self, key: str, base: int, byte_size: int, lock_fd: int) -> None:
        self.key = key
        self.name = f"kvt-engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.base = base
        self.byte_size = byte_size
        self._lock_fd = lock_fd  # holds the liveness lock (see sweep_stale_objects)

    def offset_of(self, tensor: torch.Tensor) -> int:
        offset = tensor.data_ptr() - self.base
        if offset < 0 or offset + tensor.numel() * tensor.element_size() > self.byte_size:
            raise ValueError(f"tensor at {tensor.data_ptr():#x} lies outside the engine cache "
                             f"region [{self.base:#x}, +{self.byte_size})")
        return offset

    def close(self) -> None:
        try:
            os.unlink(_SHM_DIR + self.key.lstrip("/"))
        except FileNotFoundError:
            pass
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def sweep_stale_objects(min_age_s: float = _STALE_AFTER_S) -> List[str]:
    """Unlinks the shared-memory objects of engines that died without close() (killed, OOM):
    each would otherwise hold its cache's size of host memory until the node reboots. An engine
    holds a shared flock on its object for its whole life, so an object whose exclusive lock
    can be taken has no live owner, whatever PID namespace the owner ran in. Objects younger
    than `min_age_s` are left alone (their owner may be between creating and locking). Returns
    the names removed."""
    removed: List[str] = []
    try:
        names = [n for n in os.listdir(_SHM_DIR) if n.startswith(_OBJECT_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = _SHM_DIR + name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_ctime < min_age_s:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live engine holds it (or it vanished)
        else:
            try:
                os.unlink(path)
                removed.append(name)
            except OSError:
                pass
        finally:
            os.close(fd)
    if removed:
        logger.warning("kvt: removed %d shared KV caches of engines that exited without "
                       "closing them: %s", len(removed), ", ".join(removed))
    return removed


def _maps() -> List[Tuple[int, int, str]]:
    """This process's mappings (start, end, pathname), from /proc/self/maps."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end, fields[5] if len(fields) > 5 else ""))
    return out


def _backing(tensors: Sequence[torch.Tensor]) -> Tuple[int, int]:
    """(address, bytes) of the one storage every layer tensor views."""
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
    if len(storages) != 1:
        raise ValueError(f"the KV cache tensors view {len(storages)} storages, not one")
    return storages.pop()


def _own_pages(address: int, nbytes: int, maps: List[Tuple[int, int, str]]) -> Tuple[int, int]:
    """The page-aligned span [start, end) that holds the allocation [address, +nbytes) and
    nothing else, or ValueError. glibc's malloc serves an allocation this large from an mmap of
    its own, whose chunk header says so (IS_MMAPPED) and where the mapping starts (prev_size);
    any other allocator (tcmalloc, jemalloc) must have handed out whole pages."""
    page = mmap.PAGESIZE
    others = [path for _, _, path in maps
              if any(name in os.path.basename(path) for name in ("tcmalloc", "jemalloc",
                                                                  "mimalloc"))]
    if not others:  # glibc malloc
        # The header is read only where it can be: a storage that starts a mapping (torch's
        # from_blob of an mmap, say) has no readable bytes before it.
        if not any(s <= address - 16 and address <= e for s, e, _ in maps):
            raise ValueError("the KV cache has no malloc chunk header before it")
        size_field = ctypes.c_size_t.from_address(address - 8).value
        prev_size = ctypes.c_size_t.from_address(address - 16).value
        if not size_field & 0x2:
            raise ValueError("glibc did not serve the KV cache from a mapping of its own")
        start = address - 16 - prev_size
        end = address - 16 + (size_field & ~0x7)
    else:
        start, end = address, -(-(address + nbytes) // page) * page
    if start % page or end % page or start > address or end < address + nbytes:
        raise ValueError(f"the KV cache [{address:#x}, +{nbytes}) is not on pages of its own "
                         f"(span [{start:#x}, {end:#x}), allocator {others or 'glibc'})")
    if not any(s <= start and end <= e and path == "" for s, e, path in maps):
        raise ValueError(f"the KV cache span [{start:#x}, {end:#x}) is not one anonymous mapping")
    return start, end


def share_in_place(tensors: Sequence[torch.Tensor]) -> EngineCacheRegion:
    """Moves the CPU storage behind `tensors` onto a new POSIX shared-memory object, in place
    (same address, same bytes). Raises ValueError, the memory untouched, when it cannot be done
    safely; OSError if a mapping fails midway (the chunks already moved stay shared, with their
    bytes). Call before the engine runs (nothing may write the cache meanwhile)."""
    if not sys.platform.startswith("linux"):
        raise ValueError("in-place shared KV cache needs Linux")
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        raise ValueError("in-place shared KV cache needs CPU tensors")
    address, nbytes = _backing(tensors)
    start, end = _own_pages(address, nbytes, _maps())
    length = end - start
    sweep_stale_objects()
    key = f"/{_OBJECT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(_SHM_DIR + key.lstrip("/"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    lock_fd = os.dup(fd)
    region = EngineCacheRegion(key, start, length, lock_fd)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_SH)  # released by close() or by the process's death
        os.ftruncate(fd, length)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        with mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as staging:
            window = ctypes.c_char.from_buffer(staging)
            try:
                _move_chunks(libc, fd, start, length, ctypes.addressof(window))
            finally:
                del window  # the buffer export must end before the mmap closes
    except BaseException:
        region.close()
        raise
    finally:
        os.close(fd)
    return region


def _move_chunks(libc: ctypes.CDLL, fd: int, start: int, length: int, staging: int) -> None:
    """Copies [start, +length) into the object (mapped at `staging`) and maps the object over
    it, chunk by chunk: each chunk's private pages are released as soon as the object's pages
    replace them, so the cache is never held twice (a CPU cache can be most of the host's
    memory)."""
    for offset in range(0, length, _CHUNK_BYTES):
        size = min(_CHUNK_BYTES, length - offset)
        ctypes.memmove(staging + offset, start + offset, size)
        # MAP_POPULATE: the engine's page tables filled now, as torch.zeros left them for the
        # private pages, not by a fault on each page's first use in a step.
        placed = libc.mmap(start + offset, size, _PROT_READ | _PROT_WRITE,
                           _MAP_SHARED | _MAP_FIXED | _MAP_POPULATE, fd, offset)
        if placed != start + offset:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mmap MAP_FIXED over the KV cache at +{offset}: "
                                 f"{os.strerror(errno)}")


def engine_block_order(region: EngineCacheRegion, tensors: List[torch.Tensor],
                       affine: Sequence[Optional[Tuple[int, Tuple[int, int, int]]]],
                       block_elements: int) -> Dict[str, object]:
    """The kvt.v1 EngineBlockOrder fields (as keyword arguments) of the layer `tensors` inside
    `region`, from the kernel's affine K and V order within a block (PagedLayout.affine_kv):
    per layer its byte offset, the block stride, and K's and V's (offset, slot, head, dim)
    strides in elements."""
    strides = []
    for kind in affine:
        if kind is None:
            raise ValueError("the kernel's order within a block is not affine")
        base, (slot, head, dim) = kind
        if min(base, slot, head, dim) < 0:
            raise ValueError(f"negative stride in the kernel's block order {kind}")
        strides.append({"offset": base, "slot_stride": slot, "head_stride": head,
                        "dim_stride": dim})
    return {"layer_offsets": [region.offset_of(t) for t in tensors],
            "block_stride": block_elements, "k": strides[0], "v": strides[1]}
