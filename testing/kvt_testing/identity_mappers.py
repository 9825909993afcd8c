"""Test support: identity mapper directories (k = 1, W = I, b = 0 per layer, in RoPE-free content
space) that kvtd serves like fitted ones: manifest, safetensors weights, SHA256SUMS. A cache the
source computed comes back through them within float rounding, so the connector's and kvtd's
data paths can be checked independently of any fitted mapper's quality."""

from __future__ import annotations

import hashlib
import os
from typing import List


def rope_yaml(theta: float, rotary_dim: int) -> str:
    return (f"{{theta: {theta:g}, rotary_dim: {rotary_dim}, style: neox, "
            "scaling: {type: none}}")


def write(out: str, *, source_name: str, target_name: str, layers: int, heads: int, dim: int,
          source_theta: float, target_theta: float, zero_v: bool, created_by: str) -> str:
    """The mapper directory `out`; zero_v writes V's weights as zeros (the load must then change
    the output) and records a held-out quality of 0 (the gate sees an honest figure)."""
    import numpy as np
    from safetensors.numpy import save_file

    width = heads * dim
    tensors = {}
    for layer in range(layers):
        for kind in ("k", "v"):
            zero = kind == "v" and zero_v
            tensors[f"layers.{layer}.{kind}.weight"] = (
                np.zeros((width, width), np.float32) if zero else np.eye(width, dtype=np.float32))
            tensors[f"layers.{layer}.{kind}.bias"] = np.zeros(width, np.float32)

    def side(name: str, theta: float) -> List[str]:
        return [f"  name: {name}", f"  num_layers: {layers}", f"  num_kv_heads: {heads}",
                f"  head_dim: {dim}", f"  rope: {rope_yaml(theta, dim)}"]

    manifest = (["format_version: 1", "kind: ridge", "synthetic: false", "source:"]
                + side(source_name, source_theta) + ["target:"]
                + side(target_name, target_theta)
                + ["k: 1", "lambda: 0", "lambda_scale: covariance",
                   "weights: {file: weights.safetensors, dtype: fp32}", "layers:"]
                + [f"  - {{target_layer: {l}, sigma_k: [{l}], sigma_v: [{l}]}}"
                   for l in range(layers)]
                + [f"quality: {{attention_cosine_heldout: {0.0 if zero_v else 1.0}}}",
                   f"created_by: {created_by}"])
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "weights.safetensors"),
              metadata={"kvt_mapper_format_version": "1", "kvt_mapper_kind": "ridge"})
    with open(os.path.join(out, "manifest.yaml"), "w") as f:
        f.write("\n".join(manifest) + "\n")
    sums = []
    for name in ("manifest.yaml", "weights.safetensors"):
        with open(os.path.join(out, name), "rb") as f:
            sums.append(f"{hashlib.sha256(f.read()).hexdigest()}  {name}")
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        f.write("\n".join(sums) + "\n")
    return out
