"""Test support: a float64 numpy reference of SPEC 3 (strip source RoPE, x W + b per target
layer, re-apply target RoPE) for a ridge mapper directory (manifest.yaml + weights.safetensors
read here independently of kvtd), and the SPEC 3 error measure."""

from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import numpy as np
import yaml
from safetensors.numpy import load_file


def read_safetensors(path: str) -> Dict[str, np.ndarray]:
    """{name: float64 array} of a safetensors file (safetensors.numpy: F32/F16 weights; numpy
    has no bfloat16)."""
    return {name: array.astype(np.float64) for name, array in load_file(path).items()}


class RidgeMapper:
    """A mapper directory loaded for the reference (ridge kind, rope scaling `none`)."""

    def __init__(self, directory: str) -> None:
        with open(os.path.join(directory, "manifest.yaml"), encoding="utf-8") as f:
            self.manifest = yaml.safe_load(f)
        assert self.manifest["kind"] == "ridge", self.manifest["kind"]
        self.weights = read_safetensors(os.path.join(directory, self.manifest["weights"]["file"]))
        self.source = self.manifest["source"]
        self.target = self.manifest["target"]

    def _inv_freq(self, model: dict) -> Tuple[np.ndarray, int]:
        rope = model["rope"]
        assert rope["style"] == "neox" and rope["scaling"]["type"] == "none", rope
        rotary = int(rope.get("rotary_dim") or model["head_dim"])
        # SPEC 2: inv_freq[m] = theta^(-2m/r), m in [0, r/2).
        theta = float(rope["theta"])
        return theta ** (-np.arange(0, rotary, 2, dtype=np.float64) / rotary), rotary

    def _rotate(self, x: np.ndarray, positions: np.ndarray, model: dict, inverse: bool
                ) -> np.ndarray:
        """x: [T, heads, d] float64; neox rotation of the first rotary dims by +-p*inv_freq."""
        inv_freq, rotary = self._inv_freq(model)
        angle = np.outer(positions.astype(np.float64), inv_freq)  # [T, r/2]
        if inverse:
            angle = -angle
        cos = np.cos(angle)[:, None, :]
        sin = np.sin(angle)[:, None, :]
        half = rotary // 2
        out = x.copy()
        a, b = x[..., :half], x[..., half:rotary]
        out[..., :half] = a * cos - b * sin
        out[..., half:rotary] = b * cos + a * sin
        return out

    def translate(self, k: Sequence[np.ndarray], v: Sequence[np.ndarray], positions: np.ndarray
                  ) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        """Source K/V per layer as [heads, T, d] (HND) -> target K/V per layer, HND, float64."""
        k_tok = [np.asarray(a, np.float64).transpose(1, 0, 2) for a in k]  # [T, heads, d]
        v_tok = [np.asarray(a, np.float64).transpose(1, 0, 2) for a in v]
        stripped = [self._rotate(a, positions, self.source, inverse=True) for a in k_tok]
        tokens = len(positions)
        heads, dim = self.target["num_kv_heads"], self.target["head_dim"]
        out_k, out_v = [], []
        for entry in self.manifest["layers"]:
            layer = entry["target_layer"]
            x_k = np.concatenate([stripped[j].reshape(tokens, -1) for j in entry["sigma_k"]], 1)
            x_v = np.concatenate([v_tok[j].reshape(tokens, -1) for j in entry["sigma_v"]], 1)
            content = x_k @ self.weights[f"layers.{layer}.k.weight"] + \
                self.weights[f"layers.{layer}.k.bias"]
            values = x_v @ self.weights[f"layers.{layer}.v.weight"] + \
                self.weights[f"layers.{layer}.v.bias"]
            keys = self._rotate(content.reshape(tokens, heads, dim), positions, self.target,
                                inverse=False)
            out_k.append(keys.transpose(1, 0, 2))
            out_v.append(values.reshape(tokens, heads, dim).transpose(1, 0, 2))
        return out_k, out_v


def max_rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|: the measure of the SPEC 3 tolerances."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if actual.shape != expected.shape or np.isnan(actual).any():
        return float("inf")
    return float(np.abs(actual - expected).max() / np.abs(expected).max())
