"""The worker's view of vLLM's paged KV cache: its layers in model order, each layer's element
order within a block (kvt/vllm/paged.py), numpy views of the blocks on CPU, and the two things
the connector does with them: write translated rows into a request's blocks and gather a
request's tokens out of them for a publish."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from kvt.vllm.paged import PagedLayout, gather_rows, gather_tokens, layer_order, scatter_rows

TORCH_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Wire element types as numpy reads them, matching the engine's storage bit for bit (bf16 as
# its 16-bit patterns).
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
WIRE_NUMPY: Dict[str, Any] = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2"),
                              "bf16": np.dtype("<i2")}


class EngineKv:
    """vLLM's KV cache tensors of one worker, `dtype` the engine's wire dtype name."""

    def __init__(self, kv_caches: Dict[str, torch.Tensor], num_kv_heads: int, head_dim: int,
                 dtype: str) -> None:
        self.caches = dict(kv_caches)
        self.names = layer_order(list(kv_caches))
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.paged = [PagedLayout(self.caches[name], num_kv_heads, head_dim)
                      for name in self.names]
        self.flats = [self.caches[name].view(-1) for name in self.names]
        self.host = (_host_views(self.flats, dtype) if self.flats[0].device.type == "cpu"
                     else None)
        # Per layer, numpy views of whole blocks (K, V), or None where the kernel's order within
        # a block is not affine: there rows go through element indices instead.
        self.block_views = ([layout.block_views(h) for layout, h in zip(self.paged, self.host)]
                            if self.host is not None else [None] * len(self.names))

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def tensors(self) -> List[torch.Tensor]:
        return [self.caches[name] for name in self.names]

    def cache_bytes(self, tokens: int) -> int:
        """Bytes of `tokens` tokens of this cache, all layers, K and V."""
        return (2 * self.num_layers * self.num_kv_heads * self.head_dim *
                ELEMENT_BYTES[self.dtype] * tokens)

    def packed(self, buf: Any, offset: int, tokens: int) -> np.ndarray:
        """`tokens` tokens packed at `offset` of `buf` as [layers, 2, tokens, heads, dim] of the
        engine's wire dtype (a view, no copy)."""
        count = self.num_layers * 2 * tokens * self.num_kv_heads * self.head_dim
        return np.frombuffer(buf, dtype=WIRE_NUMPY[self.dtype], count=count,
                             offset=offset).reshape(self.num_layers, 2, tokens,
                                                    self.num_kv_heads, self.head_dim)

    def gather_packed(self, block_ids: Sequence[int], tokens: int, packed: np.ndarray) -> bool:
        """Copies tokens [0, tokens) of the blocks into `packed` (see packed()); False where a
        layer has no block copies (the caller publishes inline instead)."""
        for layer, views in enumerate(self.block_views):
            if views is None or gather_rows(views, self.paged[layer], block_ids, 0, tokens,
                                            out=(packed[layer, 0], packed[layer, 1])) is None:
                return False
        return True

    def gather_arrays(self, block_ids: Sequence[int], tokens: int
                      ) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Tokens [0, tokens) of the blocks as float numpy arrays per layer (K, V)."""
        layers = []
        for layer, views in enumerate(self.block_views):
            rows = (gather_rows(views, self.paged[layer], block_ids, 0, tokens)
                    if views is not None else None)
            if rows is not None:
                k, v = rows
                layers.append((bits_to_float(k), bits_to_float(v)) if self.dtype == "bf16"
                              else (k, v))
                continue
            tk, tv = gather_tokens(self.caches[self.names[layer]], self.paged[layer],
                                   block_ids, 0, tokens)
            layers.append((tk.float().numpy(), tv.float().numpy()) if self.dtype == "bf16"
                          else (tk.numpy(), tv.numpy()))
        return layers


class RowWriter:
    """Writes translated rows into one request's blocks [start, ...): a block copy where rows
    are whole blocks of the engine's dtype, else through element indices (made on first use:
    one index serves every layer, same block table and kernel order)."""

    def __init__(self, kv: EngineKv, block_ids: List[int], start: int, end: int) -> None:
        self.kv = kv
        self.block_ids = block_ids
        self.start = start
        self.end = end
        self._indexed: Optional[tuple] = None

    def write(self, layer: int, is_k: bool, lo: int, rows: np.ndarray, wire: str) -> None:
        """Rows [lo, lo + len(rows)) of the request (numpy [n, heads, dim] of wire dtype)."""
        kv = self.kv
        views = kv.block_views[layer]
        if (views is not None and wire == kv.dtype and
                scatter_rows(views[0 if is_k else 1], kv.paged[layer], self.block_ids, lo,
                             rows)):
            return
        index_k, index_v, np_k, np_v = self._index()
        n, first = rows.shape[0], lo - self.start
        if kv.host is not None and wire == kv.dtype:
            # numpy, single-threaded: a torch index_put here would start an OpenMP region
            # beside the model runner's, on the same cores, and wait in it for milliseconds.
            kv.host[layer][(np_k if is_k else np_v)[first:first + n]] = rows
            return
        part = _rows(np.ascontiguousarray(rows).tobytes(), wire, n, kv.num_kv_heads,
                     kv.head_dim)
        flat = kv.flats[layer]
        flat[(index_k if is_k else index_v)[first:first + n]] = part.to(device=flat.device,
                                                                         dtype=flat.dtype)

    def _index(self) -> tuple:
        if self._indexed is None:
            index_k, index_v = self.kv.paged[0].index(self.block_ids, self.start, self.end)
            device = self.kv.flats[0].device
            self._indexed = (index_k.to(device), index_v.to(device), index_k.cpu().numpy(),
                             index_v.cpu().numpy())
        return self._indexed


def _host_views(flats: List[torch.Tensor], dtype: str) -> Optional[List[np.ndarray]]:
    """numpy views (sharing memory) of CPU cache tensors, bf16 as int16 bit patterns."""
    try:
        if dtype == "bf16":
            return [f.view(torch.int16).numpy() for f in flats]
        return [f.numpy() for f in flats]
    except Exception:
        return None


def bits_to_float(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (int16) as the float32 values they encode (exact)."""
    return (bits.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _rows(data: bytes, dtype: str, count: int, heads: int, dim: int) -> torch.Tensor:
    """An NHD chunk [count, heads, dim] of wire `dtype` as a tensor, without a copy for fp32 and
    fp16 (the bytes stay alive in the message; the tensor is only read)."""
    if dtype == "bf16":
        bits = np.frombuffer(data, dtype="<u2").reshape(count, heads, dim)
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    array = np.frombuffer(data, dtype="<f4" if dtype == "fp32" else "<f2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffer: only read here
        return torch.from_numpy(array.reshape(count, heads, dim))
