"""kvt.prefix: the Python client of kvtd's source-cache tier (kvt.v1.KvPrefixCache).

Serving engines publish their model's KV cache for a token sequence (`publish`), and ask for the
longest stored prefix of a prompt that another family member's cache can be translated from
(`lookup`). A hit carries a single-use lease; `translate_cached` (or the lower-level
`translate_cached_stream`, which hands over target chunks as they arrive) runs TranslateKV on the
leased prefix, so no source bytes travel from the engine.

    with kvt.Client(address) as client:
        prefix = kvt.prefix.PrefixCache(client)
        prefix.publish("kvt-tiny-M", token_ids, layers, layout="NHD")
        hit = prefix.lookup("kvt-tiny-L", token_ids, max_tokens=len(token_ids) - 1)
        if hit.hit:
            result = client.translate_cached(hit.lease_id, hit.mapper_id, hit.matched_tokens,
                                             dtype=kvt.cache.DTYPE_NAMES[hit.dtype])

Every gRPC failure becomes a KvtError subclass (kvt.errors), as in kvt.Client.
"""

from __future__ import annotations

import hashlib
import struct
import time
import uuid
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from kvt._proto import common_pb2, prefix_cache_pb2, prefix_cache_pb2_grpc, translate_pb2
from kvt.cache import DTYPES, ELEMENT_SIZE, LAYOUTS, KVCache, encode
from kvt.errors import InvalidArgumentError, from_rpc_error

POLICIES = {
    "auto": prefix_cache_pb2.REUSE_POLICY_AUTO,
    "forbid": prefix_cache_pb2.REUSE_POLICY_FORBID,
    "force": prefix_cache_pb2.REUSE_POLICY_FORCE,
}

# One layer's K or V as [tokens, heads, head_dim] (NHD) or [heads, tokens, head_dim] (HND).
LayerArrays = Tuple[Any, Any]


def _token_chunks(array: np.ndarray, layout: str, dtype: str, chunk_bytes: int
                  ) -> Iterator[Tuple[int, int, bytes]]:
    """(token_start, token_count, NHD wire bytes) of one layer's K or V."""
    if layout == "HND":
        array = np.transpose(array, (1, 0, 2))
    tokens, heads, dim = array.shape
    per_chunk = max(1, chunk_bytes // max(1, heads * dim * ELEMENT_SIZE[dtype]))
    for start in range(0, tokens, per_chunk):
        count = min(per_chunk, tokens - start)
        yield start, count, encode(array[start:start + count], dtype)


def first_block_hash(model: str, token_ids: Sequence[int], block_tokens: int) -> str:
    """The hex chain hash of the first whole block of `token_ids` as `model`'s cache, as kvtd
    lists it in PrefixEntryInfo.first_block_hash ("" when shorter than one block): SHA-256 of
    u64le(len(model)) || model || the block's tokens as u32le, cut to 16 bytes. Tells which
    stored entry holds which text without reading its bytes."""
    if block_tokens <= 0 or len(token_ids) < block_tokens:
        return ""
    name = model.encode()
    digest = hashlib.sha256(struct.pack("<Q", len(name)) + name +
                            struct.pack(f"<{block_tokens}I", *token_ids[:block_tokens]))
    return digest.digest()[:16].hex()


class PrefixCache:
    """KvPrefixCache calls over the channel of a kvt.Client (same deadlines, metadata, TLS)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._stub = prefix_cache_pb2_grpc.KvPrefixCacheStub(client._channel)

    @property
    def stub(self) -> prefix_cache_pb2_grpc.KvPrefixCacheStub:
        return self._stub

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.client._timeout(timeout)

    # -- Publish -------------------------------------------------------------------------------

    def publish(self, model: str, token_ids: Sequence[int],
                layers: Union[KVCache, Iterable[LayerArrays]], *,
                num_layers: Optional[int] = None, dtype: str = "fp32", layout: str = "NHD",
                ttl_seconds: int = 0, request_id: str = "", chunk_bytes: Optional[int] = None,
                wait_for_ready: bool = False, timeout: Optional[float] = None
                ) -> prefix_cache_pb2.PublishResponse:
        """Stores `model`'s cache of `token_ids` (token i at position i). `layers` is a KVCache
        or an iterable of (K, V) per layer in `layout`, each covering every token; numpy arrays
        or anything np.asarray accepts (CPU torch tensors). The server keeps whole blocks of its
        prefix_cache.block_tokens only. wait_for_ready: wait (up to the deadline) for a
        connection instead of failing at once while kvtd is unreachable."""
        if isinstance(layers, KVCache):
            dtype, layout = layers.dtype or "fp32", layers.layout
            num_layers = layers.num_layers
            layers = list(zip(layers.k, layers.v))
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype: unknown dtype {dtype!r}")
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout: unknown layout {layout!r}")
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise InvalidArgumentError("token_ids: empty")
        layer_list = [(np.asarray(k), np.asarray(v)) for k, v in layers]
        if num_layers is not None and len(layer_list) != num_layers:
            raise InvalidArgumentError(f"layers: {len(layer_list)} given, num_layers={num_layers}")
        if not layer_list:
            raise InvalidArgumentError("layers: none given")
        first = layer_list[0][0]
        if first.ndim != 3:
            raise InvalidArgumentError(f"layers: K of layer 0 has shape {first.shape}")
        n, heads, dim = (first.shape if layout == "NHD" else
                         (first.shape[1], first.shape[0], first.shape[2]))
        if n != len(tokens):
            raise InvalidArgumentError(f"layers cover {n} tokens, token_ids has {len(tokens)}")
        for j, (k, v) in enumerate(layer_list):
            if k.shape != first.shape or v.shape != first.shape:
                raise InvalidArgumentError(
                    f"layers: layer {j} K/V shapes {k.shape}/{v.shape} differ from {first.shape}")
        header = prefix_cache_pb2.PublishHeader(
            request_id=request_id or uuid.uuid4().hex, model=model, token_ids=tokens,
            dtype=DTYPES[dtype], layout=common_pb2.LAYOUT_NHD,
            shape=common_pb2.CacheShape(num_layers=len(layer_list), num_kv_heads=heads,
                                        head_dim=dim),
            ttl_seconds=ttl_seconds)
        size = chunk_bytes or self.client.chunk_bytes

        def requests() -> Iterator[prefix_cache_pb2.PublishRequest]:
            yield prefix_cache_pb2.PublishRequest(header=header)
            for j, (k, v) in enumerate(layer_list):
                for kind, array in ((common_pb2.CACHE_KIND_K, k), (common_pb2.CACHE_KIND_V, v)):
                    for start, count, data in _token_chunks(array, layout, dtype, size):
                        yield prefix_cache_pb2.PublishRequest(chunk=common_pb2.KVChunk(
                            layer=j, kind=kind, token_start=start, token_count=count,
                            data=data))

        try:
            return self._stub.Publish(requests(), timeout=self._timeout(timeout),
                                      metadata=self.client._metadata,
                                      wait_for_ready=wait_for_ready)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def publish_region(self, model: str, token_ids: Sequence[int], region: common_pb2.RegionRef,
                       *, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: str = "fp32", ttl_seconds: int = 0, request_id: str = "",
                       wait_for_ready: bool = False, timeout: Optional[float] = None
                       ) -> prefix_cache_pb2.PublishResponse:
        """Stores `model`'s cache of `token_ids` from a registered shared-memory region
        (`kvt.shm.SharedMemoryRegion.ref(offset, size)`) instead of inline chunks: packed, per
        layer K then V, each [tokens, heads, head_dim] of `dtype` (bf16 as its bit patterns), or
        paged (`region.paged`: the blocks of a block table, in the standard or an engine's own
        order).
        kvtd copies it into its tier before answering, so the region may be reused as soon as
        this returns. No cache bytes go through protobuf or the socket."""
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype: unknown dtype {dtype!r}")
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise InvalidArgumentError("token_ids: empty")
        expected = 2 * num_layers * len(tokens) * num_kv_heads * head_dim * ELEMENT_SIZE[dtype]
        # A paged region (region.paged: blocks in a block table, e.g. an engine's own cache)
        # is bounded by kvtd against its geometry; a packed one must be exactly the cache.
        if not region.HasField("paged") and region.byte_size != expected:
            raise InvalidArgumentError(f"region.byte_size={region.byte_size}, but {num_layers} "
                                       f"layers x {len(tokens)} tokens x {num_kv_heads} x "
                                       f"{head_dim} {dtype} are {expected} bytes")
        header = prefix_cache_pb2.PublishHeader(
            request_id=request_id or uuid.uuid4().hex, model=model, token_ids=tokens,
            dtype=DTYPES[dtype], layout=common_pb2.LAYOUT_NHD,
            shape=common_pb2.CacheShape(num_layers=num_layers, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim),
            input=common_pb2.Transport(region=region), ttl_seconds=ttl_seconds)
        try:
            return self._stub.Publish(iter([prefix_cache_pb2.PublishRequest(header=header)]),
                                      timeout=self._timeout(timeout),
                                      metadata=self.client._metadata,
                                      wait_for_ready=wait_for_ready)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    # -- LookupPrefix --------------------------------------------------------------------------

    def lookup(self, target_model: str, token_ids: Sequence[int], *, policy: str = "auto",
               mapper_id: str = "", min_tokens: int = 0, max_tokens: int = 0,
               request_id: str = "", timeout: Optional[float] = None
               ) -> prefix_cache_pb2.LookupPrefixResponse:
        """The longest stored prefix of token_ids that some other model's mapper translates into
        target_model, leased for one TranslateKV (response.hit / lease_id / matched_tokens), or
        a miss with miss_reason ("no_prefix", "no_mapper", "forbidden", "gate", "too_short",
        "disabled") and detail."""
        if policy not in POLICIES:
            raise InvalidArgumentError(f"policy: unknown {policy!r} (auto, forbid or force)")
        request = prefix_cache_pb2.LookupPrefixRequest(
            request_id=request_id, target_model=target_model,
            token_ids=[int(t) for t in token_ids], policy=POLICIES[policy], mapper_id=mapper_id,
            min_tokens=min_tokens, max_tokens=max_tokens)
        return self.client._unary(self._stub.LookupPrefix, request, timeout)

    # -- admin ---------------------------------------------------------------------------------

    def list(self, model: str = "", timeout: Optional[float] = None
             ) -> prefix_cache_pb2.ListPrefixesResponse:
        return self.client._unary(self._stub.ListPrefixes,
                                  prefix_cache_pb2.ListPrefixesRequest(model=model), timeout)

    def evict(self, model: str = "", entry_id: str = "", timeout: Optional[float] = None
              ) -> prefix_cache_pb2.EvictPrefixesResponse:
        return self.client._unary(
            self._stub.EvictPrefixes,
            prefix_cache_pb2.EvictPrefixesRequest(model=model, entry_id=entry_id), timeout)

    # -- TranslateKV of a leased prefix --------------------------------------------------------

    def translate_cached_stream(self, lease_id: str, mapper_id: str, num_tokens: int, *,
                                dtype: str = "fp32", output_dtype: Optional[str] = None,
                                output_layout: str = "NHD", request_id: str = "",
                                response_chunk_tokens: int = 0,
                                timeout: Optional[float] = None,
                                wait_for_ready: bool = False) -> "CachedTranslation":
        """Starts TranslateKV on a leased prefix; iterate the returned CachedTranslation for
        the response messages (header, chunks, trailer) as they arrive, or cancel() it.
        wait_for_ready: wait (up to the deadline) for a connection instead of failing at once
        while the channel reconnects (the lease proves kvtd was up a moment ago)."""
        header = cached_translate_header(lease_id, mapper_id, num_tokens, dtype=dtype,
                                         output_dtype=output_dtype, output_layout=output_layout,
                                         request_id=request_id,
                                         response_chunk_tokens=response_chunk_tokens)
        call = self.client.stub.TranslateKV(
            iter([translate_pb2.TranslateKVRequest(header=header)]),
            timeout=self._timeout(timeout), metadata=self.client._metadata,
            wait_for_ready=wait_for_ready)
        return CachedTranslation(call)


def cached_translate_header(lease_id: str, mapper_id: str, num_tokens: int, *,
                            dtype: str = "fp32", output_dtype: Optional[str] = None,
                            output_layout: str = "NHD", request_id: str = "",
                            response_chunk_tokens: int = 0) -> translate_pb2.TranslateHeader:
    """The TranslateKV header of a leased prefix: no chunks follow it."""
    if not lease_id:
        raise InvalidArgumentError("lease_id: empty")
    if num_tokens <= 0:
        raise InvalidArgumentError(f"num_tokens must be > 0, got {num_tokens}")
    for name, value in (("dtype", dtype), ("output_dtype", output_dtype or dtype)):
        if value not in DTYPES:
            raise InvalidArgumentError(f"{name}: unknown dtype {value!r}")
    if output_layout not in LAYOUTS:
        raise InvalidArgumentError(f"output_layout: unknown layout {output_layout!r}")
    header = translate_pb2.TranslateHeader(
        request_id=request_id, mapper_id=mapper_id, dtype=DTYPES[dtype],
        layout=common_pb2.LAYOUT_NHD, output_dtype=DTYPES[output_dtype or dtype],
        output_layout=LAYOUTS[output_layout], num_tokens=num_tokens, position_offset=0)
    header.input.cached.lease_id = lease_id
    header.output.inline.chunk_tokens = response_chunk_tokens
    return header


class CachedTranslation:
    """The response stream of a TranslateKV on a leased prefix. Iterating yields
    ("header", TranslateResponseHeader), ("chunk", KVChunk) and ("trailer", TranslateTrailer)
    as they arrive; a gRPC failure is raised as a KvtError."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.started_at = time.monotonic()
        self.first_chunk_at: Optional[float] = None

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[Tuple[str, Any]]:
        try:
            for response in self._call:
                which = response.WhichOneof("msg")
                if which == "chunk" and self.first_chunk_at is None:
                    self.first_chunk_at = time.monotonic()
                yield which, getattr(response, which)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None


__all__: List[str] = ["POLICIES", "CachedTranslation", "PrefixCache", "cached_translate_header"]
