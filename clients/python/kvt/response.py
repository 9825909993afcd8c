"""A TranslateKV response: TranslateResult, and Reassembler, which reads one from the response
stream (header, target chunks, trailer) and checks that every target token of every layer
arrives exactly once. kvt.client's calls return them; they need no channel, so tests feed
Reassembler recorded messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import grpc
import numpy as np

from kvt._proto import common_pb2, translate_pb2
from kvt.cache import DTYPE_NAMES, LAYOUT_NAMES, KVCache, coverage_error, decode
from kvt.errors import InternalError, KvtError, from_rpc_error


@dataclass
class TranslateResult:
    """What a TranslateKV call returned. `target` is None when the output went to a region."""

    header: translate_pb2.TranslateResponseHeader
    trailer: translate_pb2.TranslateTrailer
    target: Optional[KVCache]
    # The requests a translation was split into (Client.max_request_tokens); empty when one.
    # header and trailer then describe the whole: token and byte counts and stage times summed.
    parts: List["TranslateResult"] = field(default_factory=list)
    # time.monotonic() when the first target chunk arrived (None without inline output): with a
    # pipelining server it comes before the upload ends.
    first_chunk_at: Optional[float] = None

    def drop_leading(self, tokens: int) -> "TranslateResult":
        """This result without the outputs of its first `tokens` tokens (a window mapper's
        overlap), in place; its trailer stays the server's account of what was sent."""
        if tokens == 0:
            return self
        target = self.target
        if target is None or target.num_tokens <= tokens:
            raise InternalError(f"a request re-sending {tokens} earlier tokens got "
                                f"{0 if target is None else target.num_tokens} tokens back")
        self.target = target.slice_tokens(tokens, target.num_tokens)
        self.header.num_tokens = self.target.num_tokens
        return self


class Reassembler:
    """Reads a TranslateKV response stream into a TranslateResult, checking the protocol."""

    def __init__(self, call: Any, expect_chunks: bool = True) -> None:
        self._call = call
        self._expect_chunks = expect_chunks
        self._header: Optional[translate_pb2.TranslateResponseHeader] = None
        self._trailer: Optional[translate_pb2.TranslateTrailer] = None
        self._target: Optional[KVCache] = None
        self._received: List[np.ndarray] = []
        self._first_chunk_at: Optional[float] = None

    def _fail(self, message: str) -> KvtError:
        self._call.cancel()
        return InternalError(f"server broke the TranslateKV protocol: {message}")

    def run(self) -> TranslateResult:
        try:
            for response in self._call:
                which = response.WhichOneof("msg")
                if which == "header":
                    self._on_header(response.header)
                elif which == "chunk":
                    self._on_chunk(response.chunk)
                elif which == "trailer":
                    self._trailer = response.trailer
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        if self._header is None or self._trailer is None:
            raise InternalError("server ended the stream without a header and trailer")
        if self._expect_chunks:
            assert self._target is not None
            gap = coverage_error(self._received, self._target.num_tokens)
            if gap is not None:
                raise InternalError(f"server ended the stream without a complete result: {gap}")
        return TranslateResult(header=self._header, trailer=self._trailer, target=self._target,
                               first_chunk_at=self._first_chunk_at)

    def _on_header(self, header: translate_pb2.TranslateResponseHeader) -> None:
        if self._header is not None:
            raise self._fail("a second response header")
        self._header = header
        if not self._expect_chunks:
            return
        if header.output_dtype not in DTYPE_NAMES or header.output_layout not in LAYOUT_NAMES:
            raise self._fail("response header without output dtype/layout")
        shape = header.target_shape
        if min(shape.num_layers, shape.num_kv_heads, shape.head_dim, header.num_tokens) == 0:
            raise self._fail(f"response header with an empty target shape {shape}")
        self._target = KVCache.empty(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                     header.num_tokens, DTYPE_NAMES[header.output_dtype],
                                     LAYOUT_NAMES[header.output_layout])
        self._received = [np.zeros(header.num_tokens, dtype=bool)
                          for _ in range(2 * shape.num_layers)]

    def _on_chunk(self, chunk: common_pb2.KVChunk) -> None:
        if self._first_chunk_at is None:
            self._first_chunk_at = time.monotonic()
        target = self._target
        if target is None:
            raise self._fail("a target chunk before the header (or into a region request)")
        start, count = chunk.token_start, chunk.token_count
        dtype = target.dtype or "fp32"
        if (chunk.layer >= target.num_layers or count == 0 or
                start + count > target.num_tokens or
                chunk.kind not in (common_pb2.CACHE_KIND_K, common_pb2.CACHE_KIND_V) or
                len(chunk.data) != target.token_bytes() * count):
            raise self._fail(f"a malformed target chunk (layer {chunk.layer}, tokens "
                             f"[{start}, {start + count}), {len(chunk.data)} bytes)")
        kind = 0 if chunk.kind == common_pb2.CACHE_KIND_K else 1
        bits = self._received[chunk.layer * 2 + kind]
        if bits[start:start + count].any():
            raise self._fail(f"target layer {chunk.layer} {'KV'[kind]} tokens "
                             f"[{start}, {start + count}) arrived twice")
        bits[start:start + count] = True
        array = (target.k if kind == 0 else target.v)[chunk.layer]
        heads, dim = target.num_kv_heads, target.head_dim
        if target.layout == "HND":
            array[:, start:start + count, :] = decode(chunk.data, dtype, (heads, count, dim))
        else:
            array[start:start + count] = decode(chunk.data, dtype, (count, heads, dim))
