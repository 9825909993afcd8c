"""KVCache: one model's KV cache in host memory as numpy arrays, one K and one V per layer, and
its encoding to the wire (dtype conversion, token-range chunks, the packed region format)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from kvt._proto import common_pb2
from kvt.errors import InvalidArgumentError

# Wire element types by their short names; numpy holds bf16 data as float32 (exactly: every
# bf16 value is a float32), fp16 as float16 and fp32 as float32.
DTYPES = {"bf16": common_pb2.DTYPE_BF16, "fp16": common_pb2.DTYPE_FP16,
          "fp32": common_pb2.DTYPE_FP32}
DTYPE_NAMES = {value: name for name, value in DTYPES.items()}
ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
NUMPY_DTYPE: Dict[str, "np.dtype[Any]"] = {
    "bf16": np.dtype(np.float32), "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}
LAYOUTS = {"HND": common_pb2.LAYOUT_HND, "NHD": common_pb2.LAYOUT_NHD}
LAYOUT_NAMES = {value: name for name, value in LAYOUTS.items()}

DTypeLike = Union[str, None]


def _check_dtype(dtype: str, what: str) -> str:
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"{what}: unknown dtype {dtype!r} (bf16, fp16 or fp32)")
    return dtype


def _check_layout(layout: str, what: str) -> str:
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"{what}: unknown layout {layout!r} (HND or NHD)")
    return layout


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) of `values`, rounded to nearest even; NaN stays a quiet NaN."""
    values = np.ascontiguousarray(values, dtype="<f4")
    bits = values.view("<u4")
    # bits + 0x7FFF + lsb(bits >> 16), then >> 16: in place on one temporary (this is the
    # client's hot loop for bf16 caches).
    rounded = bits >> np.uint32(16)
    rounded &= np.uint32(1)
    rounded += np.uint32(0x7FFF)
    rounded += bits
    rounded >>= np.uint32(16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = (bits[nan] >> np.uint32(16)) | np.uint32(0x40)
    return rounded.astype("<u2")


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype="<u2").astype("<u4") << np.uint32(16)).view("<f4")


def encode(values: np.ndarray, dtype: str) -> bytes:
    """The little-endian wire bytes of `values` (any float array) as `dtype`."""
    if dtype == "bf16":
        return float32_to_bf16_bits(np.asarray(values, dtype=np.float32)).tobytes()
    return np.ascontiguousarray(values, dtype="<f2" if dtype == "fp16" else "<f4").tobytes()


def decode(data: Union[bytes, memoryview], dtype: str, shape: Tuple[int, ...]) -> np.ndarray:
    """Wire bytes of `dtype` as a numpy array of `shape` (float32 for bf16 and fp32, float16)."""
    if dtype == "bf16":
        return bf16_bits_to_float32(np.frombuffer(data, dtype="<u2")).reshape(shape)
    array = np.frombuffer(data, dtype="<f2" if dtype == "fp16" else "<f4").reshape(shape)
    return array.astype(NUMPY_DTYPE[dtype], copy=True)


def _default_dtype(array: np.ndarray) -> str:
    if array.dtype == np.float16:
        return "fp16"
    if array.dtype.name == "bfloat16":  # ml_dtypes.bfloat16, when the caller uses it
        return "bf16"
    return "fp32"


@dataclass
class KVCache:
    """One model's cache: `k[l]` and `v[l]` per layer, each [num_kv_heads, num_tokens, head_dim]
    for layout "HND" (Hugging Face) or [num_tokens, num_kv_heads, head_dim] for "NHD" (vLLM).

    `dtype` is the element type on the wire ("bf16", "fp16", "fp32"); None picks it from the
    arrays (float16 -> fp16, ml_dtypes.bfloat16 -> bf16, else fp32). Arrays of another float type
    are converted when sent (bf16: round to nearest even). Keys are post-RoPE, as caches hold them.
    """

    k: List[np.ndarray]
    v: List[np.ndarray]
    layout: str = "HND"
    dtype: Optional[str] = None
    _shape: Tuple[int, int, int] = field(default=(0, 0, 0), init=False, repr=False)

    def __post_init__(self) -> None:
        self.k = [np.asarray(a) for a in self.k]
        self.v = [np.asarray(a) for a in self.v]
        _check_layout(self.layout, "cache layout")
        if len(self.k) != len(self.v) or not self.k:
            raise InvalidArgumentError(
                f"cache: {len(self.k)} K and {len(self.v)} V layers; need the same number, >= 1")
        if self.dtype is None:
            self.dtype = _default_dtype(self.k[0])
        _check_dtype(self.dtype, "cache dtype")
        first = self.k[0]
        if first.ndim != 3:
            axes = ("[heads, tokens, head_dim]" if self.layout == "HND"
                    else "[tokens, heads, head_dim]")
            raise InvalidArgumentError(
                f"cache layer 0 K has shape {first.shape}; expected 3 axes {axes}")
        for name, arrays in (("K", self.k), ("V", self.v)):
            for layer, array in enumerate(arrays):
                if array.shape != first.shape:
                    raise InvalidArgumentError(
                        f"cache layer {layer} {name} has shape {array.shape}, layer 0 K has "
                        f"{first.shape}; every layer's K and V must have the same shape")
                if not (np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"):
                    raise InvalidArgumentError(
                        f"cache layer {layer} {name} has dtype {array.dtype}; expected floats")
        if self.layout == "HND":
            heads, tokens, dim = first.shape
        else:
            tokens, heads, dim = first.shape
        if heads == 0 or tokens == 0 or dim == 0:
            raise InvalidArgumentError(f"cache has an empty axis: shape {first.shape}")
        self._shape = (heads, tokens, dim)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_kv_heads(self) -> int:
        return self._shape[0]

    @property
    def num_tokens(self) -> int:
        return self._shape[1]

    @property
    def head_dim(self) -> int:
        return self._shape[2]

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE[self.dtype or "fp32"]

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K (or V) on the wire."""
        return self.num_kv_heads * self.num_tokens * self.head_dim * self.element_size

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache on the wire (and in a shared-memory region)."""
        return 2 * self.num_layers * self.layer_bytes

    def token_bytes(self) -> int:
        """Wire bytes of one token of one layer's K or V."""
        return self.num_kv_heads * self.head_dim * self.element_size

    def token_range(self, array: np.ndarray, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of one layer's K or V, in the cache's layout."""
        if self.layout == "HND":
            return array[:, start:start + count, :]
        return array[start:start + count]

    def chunks(self, chunk_bytes: int, keys_only: bool = False
               ) -> Iterator[Tuple[int, "common_pb2.CacheKind", int, int, bytes]]:
        """(layer, kind 1=K/2=V, token_start, token_count, data) covering every layer in order,
        K then V, in token ranges of at most `chunk_bytes` (at least one token each)."""
        per_chunk = max(1, chunk_bytes // max(1, self.token_bytes()))
        for layer in range(self.num_layers):
            parts: List[Tuple["common_pb2.CacheKind", np.ndarray]] = [
                (common_pb2.CACHE_KIND_K, self.k[layer])]
            if not keys_only:
                parts.append((common_pb2.CACHE_KIND_V, self.v[layer]))
            for kind, array in parts:
                for start in range(0, self.num_tokens, per_chunk):
                    count = min(per_chunk, self.num_tokens - start)
                    yield (layer, kind, start, count,
                           encode(self.token_range(array, start, count), self.dtype or "fp32"))

    def packed(self) -> Iterator[bytes]:
        """The region format (RegionRef): per layer in order, K then V, whole, no padding."""
        for layer in range(self.num_layers):
            yield encode(self.k[layer], self.dtype or "fp32")
            yield encode(self.v[layer], self.dtype or "fp32")

    @staticmethod
    def empty(num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
              dtype: str = "fp32", layout: str = "HND") -> "KVCache":
        """A zeroed cache of the given shape (the buffers a response is assembled into)."""
        _check_dtype(dtype, "dtype")
        _check_layout(layout, "layout")
        shape = ((num_kv_heads, num_tokens, head_dim) if layout == "HND"
                 else (num_tokens, num_kv_heads, head_dim))
        np_dtype = NUMPY_DTYPE[dtype]
        return KVCache(k=[np.zeros(shape, np_dtype) for _ in range(num_layers)],
                       v=[np.zeros(shape, np_dtype) for _ in range(num_layers)],
                       layout=layout, dtype=dtype)

    @staticmethod
    def unpack(data: Union[bytes, memoryview], num_layers: int, num_kv_heads: int, head_dim: int,
               num_tokens: int, dtype: str, layout: str = "HND") -> "KVCache":
        """The inverse of packed(): a cache read from region bytes (copied out of `data`)."""
        _check_dtype(dtype, "dtype")
        _check_layout(layout, "layout")
        shape = ((num_kv_heads, num_tokens, head_dim) if layout == "HND"
                 else (num_tokens, num_kv_heads, head_dim))
        layer_bytes = num_kv_heads * num_tokens * head_dim * ELEMENT_SIZE[dtype]
        if len(data) != 2 * num_layers * layer_bytes:
            raise InvalidArgumentError(
                f"packed cache has {len(data)} bytes, expected {2 * num_layers * layer_bytes}")
        view = memoryview(data)
        k, v = [], []
        for layer in range(num_layers):
            base = 2 * layer * layer_bytes
            k.append(decode(view[base:base + layer_bytes], dtype, shape))
            v.append(decode(view[base + layer_bytes:base + 2 * layer_bytes], dtype, shape))
        return KVCache(k=k, v=v, layout=layout, dtype=dtype)

    def slice_tokens(self, start: int, end: int) -> "KVCache":
        """Tokens [start, end) of every layer (views, no copy)."""
        if not 0 <= start < end <= self.num_tokens:
            raise InvalidArgumentError(
                f"token range [{start}, {end}) outside the cache's {self.num_tokens} tokens")
        return KVCache(k=[self.token_range(a, start, end - start) for a in self.k],
                       v=[self.token_range(a, start, end - start) for a in self.v],
                       layout=self.layout, dtype=self.dtype)

    @staticmethod
    def concat(caches: Sequence["KVCache"]) -> "KVCache":
        """The caches' tokens one after another (same layers, heads, dtype and layout)."""
        first = caches[0]
        form = (first.dtype, first.layout, first.num_layers, first.num_kv_heads, first.head_dim)
        for cache in caches[1:]:
            other = (cache.dtype, cache.layout, cache.num_layers, cache.num_kv_heads,
                     cache.head_dim)
            if other != form:
                raise InvalidArgumentError(f"concat: cache of form {other} after {form}")
        if len(caches) == 1:
            return first
        axis = 1 if first.layout == "HND" else 0
        return KVCache(
            k=[np.concatenate([c.k[l] for c in caches], axis) for l in range(first.num_layers)],
            v=[np.concatenate([c.v[l] for c in caches], axis) for l in range(first.num_layers)],
            layout=first.layout, dtype=first.dtype)

    def to_layout(self, layout: str) -> "KVCache":
        """The same cache in the other layout (a view-free copy), or self."""
        _check_layout(layout, "layout")
        if layout == self.layout:
            return self
        return KVCache(k=[np.ascontiguousarray(a.transpose(1, 0, 2)) for a in self.k],
                       v=[np.ascontiguousarray(a.transpose(1, 0, 2)) for a in self.v],
                       layout=layout, dtype=self.dtype)


def coverage_error(received: Sequence[np.ndarray], num_tokens: int) -> Optional[str]:
    """e.g. "layer 3 V: tokens [128, 256) missing" for the first gap, else None."""
    for index, bits in enumerate(received):
        if bits.all():
            continue
        begin = int(np.argmin(bits))
        rest = bits[begin:]
        end = begin + (int(np.argmax(rest)) if rest.any() else len(rest))
        return (f"layer {index // 2} {'K' if index % 2 == 0 else 'V'}: tokens "
                f"[{begin}, {end}) missing")
    return None


def paged_nbytes(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: str) -> int:
    """Bytes of a vLLM paged cache (RegionRef.paged): per layer (2, num_blocks, block_size,
    num_kv_heads, head_dim) elements."""
    _check_dtype(dtype, "dtype")
    return (num_layers * 2 * num_blocks * block_size * num_kv_heads * head_dim *
            ELEMENT_SIZE[dtype])


def _paged_view(buffer: Any, num_layers: int, num_blocks: int, block_size: int,
                num_kv_heads: int, head_dim: int, dtype: str, block_layout: str) -> np.ndarray:
    _check_dtype(dtype, "dtype")
    _check_layout(block_layout, "block_layout")
    size = paged_nbytes(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    if len(memoryview(buffer).cast("B")) != size:
        raise InvalidArgumentError(
            f"paged cache buffer has {len(memoryview(buffer).cast('B'))} bytes, expected {size}")
    wire = "<u2" if dtype == "bf16" else ("<f2" if dtype == "fp16" else "<f4")
    block = ((block_size, num_kv_heads, head_dim) if block_layout == "NHD"
             else (num_kv_heads, block_size, head_dim))
    return np.frombuffer(buffer, dtype=wire).reshape((num_layers, 2, num_blocks) + block)


def _token_slots(block_table: Sequence[int], num_tokens: int, num_blocks: int,
                 block_size: int) -> Tuple[np.ndarray, np.ndarray]:
    table = np.asarray(block_table, dtype=np.int64)
    needed = -(-num_tokens // block_size)
    if len(table) < needed or (table[:needed] >= num_blocks).any() or (table < 0).any():
        raise InvalidArgumentError(
            f"block_table: need {needed} entries in [0, {num_blocks}), got {list(table)}")
    tokens = np.arange(num_tokens)
    return table[tokens // block_size], tokens % block_size


def read_paged(buffer: Any, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
               dtype: str, paged: "common_pb2.PagedBlocks", block_layout: str = "NHD",
               layout: str = "HND") -> KVCache:
    """The request's tokens gathered out of a paged cache (vLLM layout; `block_layout` orders
    one block as the header's layout does) into a KVCache in `layout` (a copy)."""
    view = _paged_view(buffer, num_layers, paged.num_blocks, paged.block_size, num_kv_heads,
                       head_dim, dtype, block_layout)
    blocks, slots = _token_slots(paged.block_table, num_tokens, paged.num_blocks,
                                 paged.block_size)
    k: List[np.ndarray] = []
    v: List[np.ndarray] = []
    for layer in range(num_layers):
        for kind, out in ((0, k), (1, v)):
            tensor = view[layer, kind]
            rows = tensor[blocks, slots] if block_layout == "NHD" else tensor[blocks, :, slots]
            array = rows.transpose(1, 0, 2) if layout == "HND" else rows  # rows: [T, H, D]
            out.append(decode(np.ascontiguousarray(array).tobytes(), dtype, array.shape))
    return KVCache(k=k, v=v, layout=layout, dtype=dtype)


def write_paged(cache: KVCache, buffer: Any, paged: "common_pb2.PagedBlocks",
                block_layout: str = "NHD") -> None:
    """Scatters `cache`'s tokens into a writable paged-cache buffer (e.g. a region's memoryview
    slice) at the slots `paged.block_table` names; other slots are left as they were."""
    dtype = cache.dtype or "fp32"
    view = _paged_view(buffer, cache.num_layers, paged.num_blocks, paged.block_size,
                       cache.num_kv_heads, cache.head_dim, dtype, block_layout)
    blocks, slots = _token_slots(paged.block_table, cache.num_tokens, paged.num_blocks,
                                 paged.block_size)
    nhd = cache.to_layout("NHD")
    wire = "<u2" if dtype == "bf16" else ("<f2" if dtype == "fp16" else "<f4")
    for layer in range(cache.num_layers):
        for kind, arrays in ((0, nhd.k), (1, nhd.v)):
            rows = np.frombuffer(encode(arrays[layer], dtype), dtype=wire).reshape(
                nhd.num_tokens, cache.num_kv_heads, cache.head_dim)
            if block_layout == "NHD":
                view[layer, kind][blocks, slots] = rows
            else:
                view[layer, kind][blocks, :, slots] = rows
