"""The worker's shared-memory regions: one that kvtd writes translated loads into, one that
publishes are copied into for kvtd to read, so no cache bytes go through protobuf or the socket.

kvtd forgets registrations when it restarts and refuses client regions when
`shared_memory.allow_client_regions` is off; a region here is therefore created lazily,
registered again after any connectivity change of the channel, and after a failure left alone
for `retry_s` (the caller uses inline chunks meanwhile). A region whose use needs a protocol
extension (`requires`) stays registered only with a kvtd that lists it in ServerMetadata, asked
after each registration: the kvtd behind the channel may have been replaced by an older
release, and an older kvtd ignores the fields it does not know rather than refusing them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Deque, Optional, Tuple

from kvt.errors import DeadlineExceededError, UnavailableError

# Under vLLM's logger, so its handlers print these lines with the engine's own.
logger = logging.getLogger("vllm.kvt")


# After kvtd was unreachable or slow (restarting, busy mapping another region) the next use
# tries again soon; a refusal (regions off, no extension) waits retry_s.
_TRANSIENT_RETRY_S = 1.0


def _transient(error: BaseException) -> bool:
    return isinstance(error, (DeadlineExceededError, UnavailableError))


class WorkerRegion:
    """A kvt.shm.SharedMemoryRegion of `byte_size` bytes registered with the kvtd behind
    `client_fn()` (a kvt.Client), or, with `memory`, an object of the process's own that is
    already shared (name, key, byte_size, close(): the engine's cache made shared in place,
    kvt/vllm/engine_cache.py). `acquire`/`release` hold it for one user at a time (the load
    region: one translated load writes it); `get` only makes sure it is registered (the publish
    region, whose ranges PublishRing hands out; the engine cache, whose blocks are the loads'
    own)."""

    def __init__(self, client_fn: Callable[[], Any], byte_size: int, purpose: str,
                 warn: bool, retry_s: float = 30.0, memory: Any = None,
                 requires: Optional[str] = None) -> None:
        self._client_fn = client_fn
        self._memory = memory
        self._requires = requires
        # kvtd maps a region with MAP_POPULATE (no page faults in its requests): ~80 ms per GiB
        # on a quiet 2-core host, but seconds per GiB when the host is busy. Registration runs
        # on a load or publish thread, never in the engine step, so the bound is generous.
        self._register_timeout_s = 10.0 + 5.0 * byte_size / float(1 << 30)
        self.byte_size = byte_size
        self.purpose = purpose
        self._warn = warn  # log failures as warnings (transport "shm") or info ("auto")
        self._retry_s = retry_s
        self._hold = threading.Lock()   # acquire/release
        self._state = threading.Lock()  # the fields below
        self._region: Any = None
        self._registered = False
        self._retry_at = 0.0

    def acquire(self, nbytes: int) -> Any:
        """The registered region, held until release(), or None: busy, too small for nbytes,
        refused lately, or it cannot be made now."""
        if nbytes > self.byte_size or not self._hold.acquire(blocking=False):
            return None
        region = self.get(nbytes)
        if region is None:
            self._hold.release()
        return region

    def release(self, failed: bool = False) -> None:
        if failed:
            self.mark_failed()
        self._hold.release()

    def get(self, nbytes: int) -> Any:
        """The registered region, or None (too small, refused lately, cannot be made now)."""
        if nbytes > self.byte_size:
            return None
        with self._state:
            if time.monotonic() < self._retry_at:
                return None
            try:
                self._ensure_registered()
                return self._region
            except Exception as error:
                # A registration past its deadline may still complete in kvtd (the next try
                # then finds it registered), and a kvtd that was down comes back.
                retry_s = _TRANSIENT_RETRY_S if _transient(error) else self._retry_s
                self._retry_at = time.monotonic() + retry_s
                (logger.warning if self._warn else logger.info)(
                    "kvt: no shared-memory region for %s (%s); other transports for %.0f s",
                    self.purpose, describe_error(error), retry_s)
                return None

    def ready(self, nbytes: int) -> Any:
        """The region if it is registered now and large enough, else None; never calls kvtd
        (for the engine step, which must not wait on a registration)."""
        with self._state:
            if (self._registered and self._region is not None and nbytes <= self.byte_size
                    and time.monotonic() >= self._retry_at):
                return self._region
            return None

    @property
    def memory(self) -> Any:
        """The region object whatever its registration state (its bytes stay valid until
        close()), or None before the first get()."""
        return self._region

    def mark_failed(self) -> None:
        """A call that used the region failed: register again (or find out why) next time."""
        self._registered = False

    def _ensure_registered(self) -> None:
        client = self._client_fn()
        first = self._region is None
        if first:
            if self._memory is not None:
                client.register_system_memory(self._memory.name, self._memory.key,
                                              self._memory.byte_size, 0,
                                              timeout=self._register_timeout_s)
                self._region = self._memory
            else:
                from kvt.shm import SharedMemoryRegion
                self._region = SharedMemoryRegion(client, self.byte_size,
                                                  timeout=self._register_timeout_s)
            # kvtd forgets registrations when it restarts: any connectivity change of the
            # channel means registering again before the next use.
            client._channel.subscribe(self._on_channel_state, try_to_connect=False)
        elif not self._registered:
            from kvt.errors import AlreadyExistsError
            try:
                client.register_system_memory(self._region.name, self._region.key,
                                              self._region.byte_size, 0,
                                              timeout=self._register_timeout_s)
            except AlreadyExistsError:
                pass
        else:
            return
        self._check_extension(client)
        self._registered = True
        if first:
            logger.info("kvt: %s through shared memory (%s, %d bytes)", self.purpose,
                        self._region.name, self.byte_size)

    def _check_extension(self, client: Any) -> None:
        """Asked after registering, so the kvtd that answers is the one holding the
        registration (a kvtd that took the address in between never saw it, and requests
        naming the region fail there); without the extension the registration is withdrawn."""
        if self._requires is None or client.has_extension(self._requires,
                                                          timeout=self._register_timeout_s):
            return
        try:
            client.unregister_system_memory(self._region.name, timeout=2.0)
        except Exception:
            pass
        raise RuntimeError(f"kvtd does not list the extension {self._requires!r} in "
                           "ServerMetadata (a release older than this client)")

    def _on_channel_state(self, state: Any) -> None:
        import grpc
        if state != grpc.ChannelConnectivity.READY:
            self._registered = False

    def close(self) -> None:
        with self._state:
            region, self._region = self._region, None
        if self._memory is not None:  # SharedMemoryRegion.close() unregisters itself
            try:
                if region is not None:
                    self._client_fn().unregister_system_memory(self._memory.name, timeout=2.0)
            except Exception:
                pass
            region = self._memory
        if region is not None:
            try:
                region.close()
            except Exception:
                pass


class PublishRing:
    """First-in first-out allocation of byte ranges in a publish region: the engine step copies
    a publish into the next free range, the publish thread frees ranges in the same order once
    kvtd has copied them. No range wraps around the end (a publish is one packed range)."""

    def __init__(self, byte_size: int) -> None:
        self.byte_size = byte_size
        self._lock = threading.Lock()
        self._live: Deque[Tuple[int, int]] = collections.deque()  # (offset, size), oldest first

    def allocate(self, size: int) -> Optional[int]:
        """The offset of `size` free bytes after the newest live range, or None (no room)."""
        with self._lock:
            if not self._live:
                offset = 0 if size <= self.byte_size else None
            else:
                oldest = self._live[0][0]
                head = self._live[-1][0] + self._live[-1][1]
                if head > oldest:
                    # Live bytes are [oldest, head): room after head, else before oldest.
                    offset = head if head + size <= self.byte_size else (
                        0 if size <= oldest else None)
                else:  # wrapped: live bytes are [oldest, end) and [0, head)
                    offset = head if head + size <= oldest else None
            if offset is not None:
                self._live.append((offset, size))
            return offset

    def free(self, offset: int) -> None:
        """Frees the oldest live range, which must start at `offset`."""
        with self._lock:
            if not self._live or self._live[0][0] != offset:
                raise RuntimeError(f"publish ring: freeing {offset} out of order "
                                   f"(oldest {self._live[0] if self._live else None})")
            self._live.popleft()

    def live_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._live)


def describe_error(error: BaseException) -> str:
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if code is not None and details is not None and not callable(code):
        return f"{getattr(code, 'name', code)}: {details}"
    return f"{type(error).__name__}: {error}"
