"""Token-level access to vLLM's paged KV cache.

vLLM 0.32's CPU backend (CPU_ATTN) allocates one tensor per attention layer of shape
[num_blocks, num_kv_heads, block_size, 2 * head_dim], but that shape is only the allocation:
its kernels (`cpu_attn_reshape_and_cache`, ISA "vec", "vec16", "amx", ...) store each block in
a packed order of their own (for "vec" fp32 the keys of a head are transposed, [head_dim,
block_size], followed by the values). A naive view reads and writes the wrong elements while
still round-tripping exactly, so this module never guesses the order: it asks the kernel. Writing
bit patterns of every element's index into a one-block scratch cache through
`cpu_attn_reshape_and_cache` and reading where they landed gives, per (ISA, dtype, block size,
heads, head_dim), the memory offset of every (token offset, head, dim) of K and V within a block.
Gathers and scatters are then plain indexed copies of the layer tensor, or, where the kernel's
order within a block is affine in (token offset, head, dim), strided copies of whole blocks
through numpy views (`block_views`): no index array per element to build (0.6-1.3 ms per load
of 2K tokens of kvt-tiny-L) or read (the copy itself 1.8x faster; tests/vllm/paged_test.py
prints both). The connector's loads and publishes use them. The order is affine for fp32
("vec") and for bf16 on "vec"/"vec16", not for bf16 on "amx" (CPUs with AMX): that kernel pairs
K's dims and V's tokens (VNNI), so there the connector copies through `index` and kvtd cannot
write loads into the engine's cache in place (the load region serves).

The common GPU layout [2, num_blocks, block_size, num_kv_heads, head_dim] (flash attention) is
handled from its strides.
"""

from __future__ import annotations

import math
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

_PERMS: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
_PERMS_LOCK = threading.Lock()


def _cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> Optional[str]:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # not a CPU build
        return None
    return _get_attn_isa(dtype, block_size, head_dim)


def _kernel_offsets(dtype: torch.dtype, heads: int, block_size: int, dim: int, isa: str
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(K, V) offsets [block_size, heads, dim] within one block's heads * 2 * block_size * dim
    elements, as cpu_attn_reshape_and_cache with `isa` places them."""
    key = (dtype, heads, block_size, dim, isa)
    with _PERMS_LOCK:
        if key in _PERMS:
            return _PERMS[key]
    from vllm import _custom_ops as ops
    n = block_size * heads * dim
    t = torch.arange(block_size).view(block_size, 1, 1)
    h = torch.arange(heads).view(1, heads, 1)
    d = torch.arange(dim).view(1, 1, dim)
    ids_k = 1 + (t * heads + h) * dim + d          # 0 marks an unused element
    ids_v = ids_k + n
    found = torch.zeros(heads * 2 * block_size * dim, dtype=torch.long)
    for bit in range(math.ceil(math.log2(2 * n + 2))):
        scratch = torch.zeros(1, heads, block_size, 2 * dim, dtype=dtype)
        k_cache, v_cache = scratch.view(1, heads, 2 * block_size, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(((ids_k >> bit) & 1).to(dtype),
                                       ((ids_v >> bit) & 1).to(dtype), k_cache, v_cache,
                                       torch.arange(block_size), isa)
        found |= (scratch.reshape(-1) != 0).long() << bit
    where = torch.full((2 * n + 1,), -1, dtype=torch.long)
    where[found] = torch.arange(found.numel())
    if (where[1:] < 0).any():
        raise RuntimeError(f"cpu_attn_reshape_and_cache ({isa}, {dtype}) left elements unplaced")
    offsets = (where[1:n + 1].view(block_size, heads, dim),
               where[n + 1:].view(block_size, heads, dim))
    with _PERMS_LOCK:
        _PERMS[key] = offsets
    return offsets


def affine_strides(offsets: torch.Tensor
                   ) -> Optional[Tuple[int, Tuple[int, int, int]]]:
    """(base, (token, head, dim) strides) when offsets [block_size, heads, dim] are
    base + t * a + h * b + d * c, else None."""
    t, h, d = offsets.shape
    base = int(offsets[0, 0, 0])
    def step(axis: int, n: int) -> int:
        return int(offsets[tuple(1 if i == axis else 0 for i in range(3))]) - base if n > 1 else 0
    strides = (step(0, t), step(1, h), step(2, d))
    grid = (base + torch.arange(t).view(t, 1, 1) * strides[0] +
            torch.arange(h).view(1, h, 1) * strides[1] + torch.arange(d).view(1, 1, d) * strides[2])
    return (base, strides) if torch.equal(grid, offsets) else None


class PagedLayout:
    """Where token t of a request (block table `block_ids`) lives in one layer's paged cache."""

    def __init__(self, kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
        shape = tuple(kv_cache.shape)
        self.heads, self.dim = num_kv_heads, head_dim
        if not kv_cache.is_contiguous():
            raise ValueError(f"paged KV cache of shape {shape} is not contiguous")
        if len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_dim:
            self.kind = "cpu_attn"
            self.num_blocks = shape[0]
            self.block_size = shape[2]
            self.block_elems = num_kv_heads * 2 * self.block_size * head_dim
            isa = _cpu_isa(kv_cache.dtype, self.block_size, head_dim)
            if isa is None:
                raise ValueError(f"KV cache shape {shape} is CPU_ATTN's, but no CPU vLLM build")
            self.isa = isa
            self._k, self._v = _kernel_offsets(kv_cache.dtype, num_kv_heads, self.block_size,
                                               head_dim, isa)
        elif (len(shape) == 5 and shape[0] == 2 and shape[3] == num_kv_heads and
              shape[4] == head_dim):
            self.kind = "nhd_blocks"
            self.isa = ""
            self.num_blocks = shape[1]
            self.block_size = shape[2]
            self.block_elems = self.block_size * num_kv_heads * head_dim
            local = torch.arange(self.block_elems).view(self.block_size, num_kv_heads, head_dim)
            self._k = local
            self._v = local + shape[1] * self.block_elems  # the V half follows all K blocks
        else:
            raise ValueError(f"unsupported paged KV cache shape {shape} for {num_kv_heads} KV "
                             f"heads x {head_dim}")
        self.affine_kv = (affine_strides(self._k), affine_strides(self._v))

    def block_views(self, flat: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """(K, V) numpy views [num_blocks, block_size, heads, dim] sharing the memory of one
        layer's flat cache `flat` (its numpy view, any element type), or None when the kernel's
        order within a block is not affine (then use `index`)."""
        affine_k, affine_v = self.affine_kv
        if affine_k is None or affine_v is None or flat.size != (
                self.num_blocks * self.block_elems * (2 if self.kind == "nhd_blocks" else 1)):
            return None
        item = flat.itemsize

        def view(base: int, strides: Tuple[int, int, int]) -> np.ndarray:
            return np.lib.stride_tricks.as_strided(
                flat[base:], shape=(self.num_blocks, self.block_size, self.heads, self.dim),
                strides=tuple(n * item for n in (self.block_elems,) + strides))
        return view(*affine_k), view(*affine_v)

    def whole_blocks(self, block_ids: Sequence[int], start: int, end: int) -> Optional[np.ndarray]:
        """The block ids covering tokens [start, end) when both ends are block boundaries (or
        end is the last token of a partly filled last block), else None."""
        if start % self.block_size:
            return None
        last = -(-end // self.block_size)
        return np.asarray(block_ids[start // self.block_size:last], dtype=np.int64)

    def index(self, block_ids: Sequence[int], start: int, end: int
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Flat element indices (K, V), each [end - start, heads, dim], of tokens [start, end)."""
        tokens = torch.arange(start, end, dtype=torch.long)
        table = torch.as_tensor(list(block_ids), dtype=torch.long)
        base = (table[tokens // self.block_size] * self.block_elems).view(-1, 1, 1)
        offsets = tokens % self.block_size
        return base + self._k[offsets], base + self._v[offsets]


def gather_tokens(kv_cache: torch.Tensor, layout: PagedLayout, block_ids: Sequence[int],
                  start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Copies of tokens [start, end) from one layer's paged cache: (K, V), each
    [end - start, num_kv_heads, head_dim] (NHD)."""
    flat = kv_cache.view(-1)
    ik, iv = layout.index(block_ids, start, end)
    return flat[ik.to(flat.device)], flat[iv.to(flat.device)]


def scatter_tokens(kv_cache: torch.Tensor, layout: PagedLayout, block_ids: Sequence[int],
                   start: int, k: Optional[torch.Tensor], v: Optional[torch.Tensor]) -> None:
    """Writes K and/or V ([n, num_kv_heads, head_dim], NHD) of tokens [start, start + n) into
    one layer's paged cache."""
    flat = kv_cache.view(-1)
    rows = k if k is not None else v
    if rows is None:
        return
    n = rows.shape[0]
    ik, iv = layout.index(block_ids, start, start + n)
    if k is not None:
        flat[ik.to(flat.device)] = k.to(dtype=kv_cache.dtype, device=kv_cache.device)
    if v is not None:
        flat[iv.to(flat.device)] = v.to(dtype=kv_cache.dtype, device=kv_cache.device)


def gather_rows(views: Tuple[np.ndarray, np.ndarray], layout: PagedLayout,
                block_ids: Sequence[int], start: int, end: int,
                out: Optional[Tuple[np.ndarray, np.ndarray]] = None
                ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """(K, V), each [end - start, heads, dim], of tokens [start, end) through a layer's block
    views, or None when start is not a block boundary. `out`: contiguous arrays of that shape
    and the views' dtype to write into (e.g. a shared-memory region), with no copy between."""
    blocks = layout.whole_blocks(block_ids, start, end)
    if blocks is None:
        return None
    n, bs, heads, dim = end - start, layout.block_size, layout.heads, layout.dim
    full = n // bs
    rows = []
    for i, view in enumerate(views):
        dst = out[i] if out is not None else np.empty((n, heads, dim), dtype=view.dtype)
        if full:
            # mode="clip": numpy writes straight into `out` ("raise" buffers it first); the
            # block ids are the request's own, in range.
            np.take(view, blocks[:full], axis=0, mode="clip",
                    out=dst[:full * bs].reshape(full, bs, heads, dim))
        if n > full * bs:
            dst[full * bs:] = view[blocks[full], :n - full * bs]
        rows.append(dst)
    return rows[0], rows[1]


def scatter_rows(view: np.ndarray, layout: PagedLayout, block_ids: Sequence[int], start: int,
                 rows: np.ndarray) -> bool:
    """Writes rows [n, heads, dim] (same element type as the view) of tokens [start, start + n)
    through one K or V block view; False (nothing written) unless the range is whole blocks."""
    n = rows.shape[0]
    if n % layout.block_size:
        return False
    blocks = layout.whole_blocks(block_ids, start, start + n)
    if blocks is None:
        return False
    view[blocks] = rows.reshape(-1, layout.block_size, layout.heads, layout.dim)
    return True


def layer_order(names: Sequence[str]) -> List[str]:
    """Attention layer names ("model.layers.12.self_attn.attn") in model order."""
    def index(name: str) -> Tuple[int, str]:
        for part in name.split("."):
            if part.isdigit():
                return int(part), name
        return 1 << 30, name
    return sorted(names, key=index)
