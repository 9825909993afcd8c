"""Conversions between kvt.KVCache and the cache forms of PyTorch inference code: per-layer
(K, V) torch tensors shaped [batch=1, num_kv_heads, tokens, head_dim] (Hugging Face's) and
transformers' DynamicCache (both the legacy key_cache/value_cache lists and the newer `layers`
API). torch and transformers are imported on first use, so `import kvt` needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import numpy as np

from kvt.cache import KVCache
from kvt.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

_TORCH_TO_KVT = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def _torch() -> Any:
    import torch  # noqa: F811  (lazy: only adapter users need torch)

    return torch


def _to_numpy(tensor: "torch.Tensor", what: str) -> np.ndarray:
    th = _torch()
    if tensor.dim() != 4 or tensor.shape[0] != 1:
        raise InvalidArgumentError(
            f"{what} has shape {tuple(tensor.shape)}; expected [1, num_kv_heads, tokens, head_dim]")
    tensor = tensor[0].detach().to("cpu")
    # numpy has no bfloat16: widen to float32 (exact), the wire dtype stays bf16.
    if tensor.dtype == th.bfloat16:
        tensor = tensor.to(th.float32)
    return tensor.contiguous().numpy()


def from_torch(layers: Sequence[Tuple["torch.Tensor", "torch.Tensor"]],
               dtype: Optional[str] = None) -> KVCache:
    """A KVCache (HND) from per-layer (K, V) tensors [1, num_kv_heads, tokens, head_dim].

    dtype: the wire dtype; default: the tensors' (bfloat16 -> "bf16", float16 -> "fp16",
    float32 -> "fp32").
    """
    if not layers:
        raise InvalidArgumentError("from_torch: no layers")
    if dtype is None:
        dtype = _TORCH_TO_KVT.get(str(layers[0][0].dtype))
        if dtype is None:
            raise InvalidArgumentError(
                f"from_torch: tensors of {layers[0][0].dtype}; pass dtype= (bf16, fp16, fp32)")
    k = [_to_numpy(key, f"layer {i} K") for i, (key, _) in enumerate(layers)]
    v = [_to_numpy(value, f"layer {i} V") for i, (_, value) in enumerate(layers)]
    return KVCache(k=k, v=v, layout="HND", dtype=dtype)


def to_torch(cache: KVCache, dtype: Optional["torch.dtype"] = None,
             device: Any = "cpu") -> List[Tuple["torch.Tensor", "torch.Tensor"]]:
    """Per-layer (K, V) tensors [1, num_kv_heads, tokens, head_dim] of `cache` (NHD caches are
    transposed). dtype: default torch.bfloat16 / float16 / float32 after the cache's dtype."""
    th = _torch()
    if dtype is None:
        dtype = {"bf16": th.bfloat16, "fp16": th.float16,
                 "fp32": th.float32}[cache.dtype or "fp32"]
    hnd = cache.to_layout("HND")

    def convert(array: np.ndarray) -> "torch.Tensor":
        return th.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)[None]

    return [(convert(k), convert(v)) for k, v in zip(hnd.k, hnd.v)]


def dynamic_cache_layers(cache: Any) -> List[Tuple["torch.Tensor", "torch.Tensor"]]:
    """Per-layer (K, V) tensors of a transformers Cache: the `layers` API (transformers >=
    4.54: layer.keys / layer.values), the legacy key_cache / value_cache lists, or a legacy
    tuple of (K, V) pairs."""
    if hasattr(cache, "layers") and not isinstance(cache, (tuple, list)):
        layers = list(cache.layers)
        if layers and hasattr(layers[0], "keys"):
            return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (tuple, list)):
        return [(k, v) for k, v in cache]
    raise InvalidArgumentError(f"unsupported cache type {type(cache).__name__}")


def from_dynamic_cache(cache: Any, dtype: Optional[str] = None) -> KVCache:
    """A KVCache of a Hugging Face DynamicCache (or legacy tuple cache) of batch size 1."""
    return from_torch(dynamic_cache_layers(cache), dtype=dtype)


def to_dynamic_cache(cache: KVCache, dtype: Optional["torch.dtype"] = None,
                     device: Any = "cpu", config: Any = None) -> Any:
    """A transformers DynamicCache holding `cache` (e.g. a translated cache, for generate() or a
    forward pass with past_key_values). `config`: the target model's config, for transformers
    versions whose DynamicCache takes it (sliding-window layers); optional."""
    from transformers import DynamicCache

    try:
        dynamic = DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:
        dynamic = DynamicCache()
    for layer, (k, v) in enumerate(to_torch(cache, dtype=dtype, device=device)):
        dynamic.update(k, v, layer)
    return dynamic
