"""kvt.cache and the response reassembly without a server: bf16 rounding against a scalar
reference (ties, NaN, infinities, overflow, subnormals), wire encode/decode, chunking in both
layouts covering every token once, the packed region format, KVCache shape errors, and the
client's refusal of a response stream that breaks the protocol (a real kvtd never sends one, so
the stream is built from real response messages here)."""

from __future__ import annotations

import os
import struct
import sys
import unittest
from typing import Any, Iterator, List

import numpy as np

import kvt
from kvt.cache import (bf16_bits_to_float32, decode, encode, float32_to_bf16_bits)
from kvt.proto import common_pb2, translate_pb2
from kvt.response import Reassembler
from kvt_testing import junit_main

# KVT_TEST_SEED (docs/TESTING.md) replays a run; unset, a fresh seed.
SEED = (int(os.environ["KVT_TEST_SEED"]) if os.environ.get("KVT_TEST_SEED")
        else int.from_bytes(os.urandom(4), "little"))
print(f"cache_test: seed {SEED} (replay with KVT_TEST_SEED={SEED})", file=sys.stderr)


def bf16_reference(value: float) -> int:
    """Round-to-nearest-even of one float32 to bf16, bit by bit."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if value != value:
        return (bits >> 16) | 0x40
    upper, lower = bits >> 16, bits & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return upper & 0xFFFF


class CacheTest(unittest.TestCase):
    def setUp(self) -> None:
        self.rng = np.random.default_rng(SEED)

    def test_bf16_rounding_matches_scalar_reference(self) -> None:
        special = np.array([1.0, 1.00390625, 1.01171875, -1.00390625, np.inf, -np.inf, np.nan,
                            -np.nan, 3.4028235e38, -3.4028235e38, 0.0, -0.0, 1e-40, -1e-45,
                            65504.0, 1.0 + 2 ** -8 + 2 ** -20], dtype=np.float32)
        random = (self.rng.standard_normal(20000) *
                  10.0 ** self.rng.integers(-30, 30, 20000)).astype(np.float32)
        values = np.concatenate([special, random])
        got = float32_to_bf16_bits(values)
        expected = [bf16_reference(float(v)) for v in values]
        self.assertEqual([int(g) for g in got], expected)
        # Widening back is exact, and bf16 values survive a second rounding unchanged.
        wide = bf16_bits_to_float32(got)
        np.testing.assert_array_equal(float32_to_bf16_bits(wide), got)

    def test_encode_decode_every_dtype(self) -> None:
        values = self.rng.standard_normal((3, 5, 4)).astype(np.float32)
        for dtype, np_dtype in (("fp32", np.float32), ("fp16", np.float16), ("bf16", np.float32)):
            data = encode(values, dtype)
            self.assertEqual(len(data), values.size * (4 if dtype == "fp32" else 2))
            back = decode(data, dtype, values.shape)
            self.assertEqual(back.dtype, np_dtype)
            tolerance = {"fp32": 0, "fp16": 1e-3, "bf16": 4e-3}[dtype]
            np.testing.assert_allclose(back, values, rtol=tolerance, atol=tolerance)
        np.testing.assert_array_equal(decode(encode(values, "fp32"), "fp32", values.shape), values)

    def test_chunks_cover_every_token_once_in_both_layouts(self) -> None:
        layers, heads, tokens, dim = 3, 2, 23, 4
        k = [self.rng.standard_normal((heads, tokens, dim)).astype(np.float32)
             for _ in range(layers)]
        v = [self.rng.standard_normal((heads, tokens, dim)).astype(np.float32)
             for _ in range(layers)]
        for layout in ("HND", "NHD"):
            cache = kvt.KVCache(k=k, v=v).to_layout(layout)
            chunk_bytes = 5 * heads * dim * 4 + 3  # 5 tokens per chunk
            rebuilt = kvt.KVCache.empty(layers, heads, dim, tokens, "fp32", "HND")
            seen = np.zeros((layers, 2, tokens), dtype=int)
            order = []
            for layer, kind, start, count, data in cache.chunks(chunk_bytes):
                self.assertLessEqual(count, 5)
                order.append(layer)
                shape = (heads, count, dim) if layout == "HND" else (count, heads, dim)
                part = decode(data, "fp32", shape)
                if layout == "NHD":
                    part = part.transpose(1, 0, 2)
                kind_index = 0 if kind == common_pb2.CACHE_KIND_K else 1
                (rebuilt.k if kind_index == 0 else rebuilt.v)[layer][:, start:start + count] = part
                seen[layer, kind_index, start:start + count] += 1
            self.assertTrue((seen == 1).all())
            self.assertEqual(order, sorted(order))  # layers in order, for pipelining servers
            for layer in range(layers):
                np.testing.assert_array_equal(rebuilt.k[layer], k[layer])
                np.testing.assert_array_equal(rebuilt.v[layer], v[layer])
            keys_only = list(cache.chunks(chunk_bytes, keys_only=True))
            self.assertTrue(all(kind == common_pb2.CACHE_KIND_K for _, kind, *_ in keys_only))

    def test_packed_round_trip(self) -> None:
        cache = kvt.KVCache(k=[self.rng.standard_normal((7, 2, 8)).astype(np.float16)] * 2,
                            v=[self.rng.standard_normal((7, 2, 8)).astype(np.float16)] * 2,
                            layout="NHD")
        self.assertEqual(cache.dtype, "fp16")
        data = b"".join(cache.packed())
        self.assertEqual(len(data), cache.nbytes)
        back = kvt.KVCache.unpack(data, 2, 2, 8, 7, "fp16", "NHD")
        np.testing.assert_array_equal(back.v[1], cache.v[1])
        with self.assertRaises(kvt.InvalidArgumentError):
            kvt.KVCache.unpack(data[:-2], 2, 2, 8, 7, "fp16", "NHD")

    def test_paged_round_trip_in_both_block_layouts(self) -> None:
        cache = kvt.KVCache(k=[self.rng.standard_normal((2, 13, 4)).astype(np.float32)] * 3,
                            v=[self.rng.standard_normal((2, 13, 4)).astype(np.float32)] * 3)
        paged = kvt.PagedBlocks(num_blocks=6, block_size=4, block_table=[5, 0, 3, 1, 2])
        for block_layout in ("NHD", "HND"):
            buffer = bytearray(kvt.cache.paged_nbytes(3, 6, 4, 2, 4, "fp32"))
            kvt.cache.write_paged(cache, buffer, paged, block_layout)
            tensor = np.frombuffer(bytes(buffer), np.float32).reshape(
                (3, 2, 6) + ((4, 2, 4) if block_layout == "NHD" else (2, 4, 4)))
            # Token 9 of layer 2's V sits in block_table[2] = 3, slot 1.
            slot = tensor[2, 1, 3, 1] if block_layout == "NHD" else tensor[2, 1, 3, :, 1]
            np.testing.assert_array_equal(slot, cache.v[2][:, 9])
            back = kvt.cache.read_paged(bytes(buffer), 3, 2, 4, 13, "fp32", paged, block_layout)
            for layer in range(3):
                np.testing.assert_array_equal(back.k[layer], cache.k[layer])
                np.testing.assert_array_equal(back.v[layer], cache.v[layer])
        short = kvt.PagedBlocks(num_blocks=6, block_size=4, block_table=[5, 0, 3])
        with self.assertRaises(kvt.InvalidArgumentError) as caught:
            kvt.cache.read_paged(bytes(buffer), 3, 2, 4, 13, "fp32", short)
        self.assertIn("block_table", str(caught.exception))

    def test_shape_errors_name_the_layer(self) -> None:
        good = np.zeros((2, 4, 8), np.float32)
        cases = [
            (dict(k=[good], v=[good, good]), "1 K and 2 V"),
            (dict(k=[good, good], v=[good, np.zeros((2, 5, 8))]), "layer 1 V"),
            (dict(k=[np.zeros((2, 4))], v=[np.zeros((2, 4))]), "3 axes"),
            (dict(k=[good], v=[good.astype(np.int32)]), "layer 0 V has dtype int32"),
            (dict(k=[good], v=[good], layout="THD"), "layout"),
            (dict(k=[np.zeros((2, 0, 8))], v=[np.zeros((2, 0, 8))]), "empty axis"),
        ]
        for kwargs, fragment in cases:
            with self.assertRaises(kvt.InvalidArgumentError) as caught:
                kvt.KVCache(**kwargs)  # type: ignore[arg-type]
            self.assertIn(fragment, str(caught.exception))
            self.assertEqual(caught.exception.code.name, "INVALID_ARGUMENT")


class _Stream:
    """A finished response stream: real messages, nothing on the wire."""

    def __init__(self, messages: List[translate_pb2.TranslateKVResponse]) -> None:
        self.messages = messages
        self.cancelled = False

    def __iter__(self) -> Iterator[translate_pb2.TranslateKVResponse]:
        return iter(self.messages)

    def cancel(self) -> None:
        self.cancelled = True


def response(**fields: Any) -> translate_pb2.TranslateKVResponse:
    return translate_pb2.TranslateKVResponse(**fields)


class ReassemblyTest(unittest.TestCase):
    header = translate_pb2.TranslateResponseHeader(
        mapper_id="m", target_shape=common_pb2.CacheShape(num_layers=1, num_kv_heads=1,
                                                          head_dim=2),
        output_dtype=common_pb2.DTYPE_FP32, output_layout=common_pb2.LAYOUT_HND, num_tokens=4)

    def chunk(self, kind: int, start: int, count: int, value: float = 1.0
              ) -> translate_pb2.TranslateKVResponse:
        data = np.full(2 * count, value, np.float32).tobytes()
        return response(chunk=common_pb2.KVChunk(layer=0, kind=kind, token_start=start,
                                                 token_count=count, data=data))

    def run_stream(self, messages: List[translate_pb2.TranslateKVResponse]) -> Any:
        return Reassembler(_Stream(messages)).run()

    def test_complete_stream_in_any_order(self) -> None:
        K, V = common_pb2.CACHE_KIND_K, common_pb2.CACHE_KIND_V
        result = self.run_stream([response(header=self.header), self.chunk(V, 2, 2, 4.0),
                                  self.chunk(K, 0, 3, 1.0), self.chunk(V, 0, 2, 3.0),
                                  self.chunk(K, 3, 1, 2.0),
                                  response(trailer=translate_pb2.TranslateTrailer())])
        np.testing.assert_array_equal(result.target.k[0][0, :, 0], [1, 1, 1, 2])
        np.testing.assert_array_equal(result.target.v[0][0, :, 1], [3, 3, 4, 4])

    def test_protocol_violations_raise_internal(self) -> None:
        K, V = common_pb2.CACHE_KIND_K, common_pb2.CACHE_KIND_V
        trailer = response(trailer=translate_pb2.TranslateTrailer())
        head = response(header=self.header)
        cases = [
            ([head, self.chunk(K, 0, 4), trailer], "layer 0 V: tokens [0, 4) missing"),
            ([head, self.chunk(K, 0, 4), self.chunk(K, 3, 1), self.chunk(V, 0, 4), trailer],
             "arrived twice"),
            ([head, self.chunk(K, 2, 3), trailer], "malformed"),
            ([self.chunk(K, 0, 4), trailer], "before the header"),
            ([head, head], "second response header"),
            ([head, self.chunk(K, 0, 4), self.chunk(V, 0, 4)], "without a header and trailer"),
        ]
        for messages, fragment in cases:
            with self.assertRaises(kvt.InternalError) as caught:
                self.run_stream(messages)
            self.assertIn(fragment, str(caught.exception))


if __name__ == "__main__":
    junit_main.main()
