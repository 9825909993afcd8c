"""Conversions between kvt.KVCache and the cache forms of PyTorch inference code: per-layer
(K, V) torch tensors shaped [batch=1, num_kv_heads, tokens, head_dim] (Hugging Face's),
transformers' DynamicCache (the `layers` API of transformers 5, DynamicLayer keys / values, and
the key_cache / value_cache lists of older versions) and the deprecated tuple past_key_values
((K, V) per layer: read by from_dynamic_cache, written by to_legacy_cache, turned into a
DynamicCache that transformers 5 accepts by as_dynamic_cache). torch and transformers are
imported on first use, so `import kvt` needs neither.
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


def _is_legacy(cache: Any) -> bool:
    return isinstance(cache, (tuple, list))


def dynamic_cache_layers(cache: Any) -> List[Tuple["torch.Tensor", "torch.Tensor"]]:
    """Per-layer (K, V) tensors of a transformers Cache: the `layers` API (transformers >= 4.54,
    5.x: DynamicLayer.keys / .values), the key_cache / value_cache lists of older versions, or a
    legacy tuple of (K, V) pairs (the deprecated tuple `past_key_values`)."""
    if _is_legacy(cache):
        pairs = []
        for i, pair in enumerate(cache):
            if len(pair) < 2:
                raise InvalidArgumentError(f"legacy cache layer {i}: expected a (K, V) pair")
            pairs.append((pair[0], pair[1]))
        return pairs
    if hasattr(cache, "layers"):
        layers: List[Any] = list(cache.layers)
        if all(hasattr(layer, "keys") and hasattr(layer, "values") for layer in layers):
            empty = [i for i, layer in enumerate(layers) if layer.keys is None]
            if empty:
                # DynamicCache(config=...) creates its layers before the first update.
                raise InvalidArgumentError(
                    f"cache layers {empty} hold no tensors yet (run a forward pass first)")
            return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    raise InvalidArgumentError(f"unsupported cache type {type(cache).__name__}")


def from_dynamic_cache(cache: Any, dtype: Optional[str] = None) -> KVCache:
    """A KVCache of a Hugging Face DynamicCache (or legacy tuple cache) of batch size 1."""
    return from_torch(dynamic_cache_layers(cache), dtype=dtype)


def _dynamic_cache(layers: Sequence[Tuple["torch.Tensor", "torch.Tensor"]],
                   config: Any = None) -> Any:
    from transformers import DynamicCache

    try:
        dynamic = DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # transformers < 4.56: no config argument
        dynamic = DynamicCache()
    for layer, (k, v) in enumerate(layers):
        dynamic.update(k, v, layer)
    return dynamic


def to_dynamic_cache(cache: KVCache, dtype: Optional["torch.dtype"] = None,
                     device: Any = "cpu", config: Any = None) -> Any:
    """A transformers DynamicCache holding `cache` (e.g. a translated cache, for generate() or a
    forward pass with past_key_values). `config`: the target model's config, for transformers
    versions whose DynamicCache takes it (sliding-window layers); optional."""
    return _dynamic_cache(to_torch(cache, dtype=dtype, device=device), config=config)


def to_legacy_cache(cache: KVCache, dtype: Optional["torch.dtype"] = None,
                    device: Any = "cpu") -> Tuple[Tuple["torch.Tensor", "torch.Tensor"], ...]:
    """`cache` as the deprecated tuple past_key_values: ((K, V), ...) per layer, each
    [1, num_kv_heads, tokens, head_dim]. transformers 5 models no longer take tuples; pass the
    tuple through as_dynamic_cache (or use to_dynamic_cache) before a forward pass."""
    return tuple(to_torch(cache, dtype=dtype, device=device))


def as_dynamic_cache(past_key_values: Any, config: Any = None) -> Any:
    """A transformers Cache for past_key_values: a legacy tuple of (K, V) pairs becomes a
    DynamicCache holding the same tensors (what transformers < 5 did itself with a tuple, which
    transformers 5 rejects); a Cache object (or None) is returned as it is."""
    if past_key_values is None or not _is_legacy(past_key_values):
        return past_key_values
    return _dynamic_cache(dynamic_cache_layers(past_key_values), config=config)
