#!/usr/bin/env python3
"""Models of transformers' Qwen3 architecture (Qwen3ForCausalLM: QK-norm, an explicit head_dim
that is not hidden_size / num_attention_heads, neox RoPE with theta 1e6) with random weights,
written at run time for the Qwen3 tests and benchmark of kvt inside vLLM, and the mappers that go
with them.

Shapes: those of Qwen3-0.6B and Qwen3-1.7B (28 layers each, 8 KV heads x 128: the pair the peers
test on) with a 256-byte vocabulary, so that the files stay at a few GB; and a tiny pair of the
same architecture for tests (a few layers, small hidden sizes, still 128-wide heads). Weights are
seeded normals in bf16 safetensors, scaled so that activations stay near unit RMS through the
layers and the logits are peaked enough that greedy tokens do not hinge on float rounding. vLLM
CPU loads the directories with skip_tokenizer_init=True (inputs are byte ids).

    python3 tests/vllm/qwen3_shapes.py --out=DIR [--tiny]   # models + mapper under DIR

writes DIR/<model name>/{config.json, model.safetensors} for both models and DIR/store/<mapper>
(`kvt synth`: random ridge weights of the pair's shapes, marked synthetic, no recorded quality).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
from typing import Dict, Optional

from kvt_testing import identity_mappers

ROPE_THETA = 1e6
VOCAB = 256

# name -> (layers, hidden, q heads, kv heads, head_dim, intermediate)
SHAPES: Dict[str, tuple] = {
    "kvt-qwen3-0.6b-shape": (28, 1024, 16, 8, 128, 3072),
    "kvt-qwen3-1.7b-shape": (28, 2048, 16, 8, 128, 6144),
    # hidden / heads = 32 and 48, head_dim 128: the explicit head_dim is what the code must use.
    "kvt-qwen3-tiny-A": (3, 128, 4, 2, 128, 256),
    "kvt-qwen3-tiny-B": (4, 192, 4, 2, 128, 384),
}
PAIR = ("kvt-qwen3-0.6b-shape", "kvt-qwen3-1.7b-shape")
TINY_PAIR = ("kvt-qwen3-tiny-A", "kvt-qwen3-tiny-B")


def mapper_id(source: str, target: str) -> str:
    return f"{source}-to-{target}"


def config_of(name: str) -> dict:
    """config.json of model `name` (transformers' Qwen3Config, written as transformers 5 writes
    it, with rope_parameters; rope_theta too, for readers that look there)."""
    from transformers import Qwen3Config

    layers, hidden, heads, kv_heads, head_dim, inter = SHAPES[name]
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, rope_theta=ROPE_THETA,
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    out = config.to_dict()
    out["architectures"] = ["Qwen3ForCausalLM"]
    out["dtype"] = "bfloat16"
    out["torch_dtype"] = "bfloat16"
    out["rope_theta"] = ROPE_THETA
    out["_name_or_path"] = name  # the model's name, as the bundled family records it
    return out


def _std(name: str, shape, layers: int) -> float:
    """Standard deviation of a weight: unit-RMS activations through every projection; the two
    projections that write into the residual stream scaled down by sqrt(2 * layers) so that it
    grows slowly over the stack; a wide lm_head so the next-token distribution is peaked."""
    if name.endswith("norm.weight"):
        return 0.0  # RMSNorm weights: ones (QK-norm included)
    if "embed_tokens" in name:
        return 1.0
    fan_in = shape[1]
    if name == "lm_head.weight":
        return 4.0 / math.sqrt(fan_in)
    std = 1.0 / math.sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * layers)
    return std


def write_model(root: str, name: str, seed: int = 0) -> str:
    """root/name/{config.json, model.safetensors} (bf16). Reused when it is already there and was
    written from the same shape and seed (the stamp file)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = os.path.join(root, name)
    config = config_of(name)
    stamp = hashlib.sha256(json.dumps([config, seed], sort_keys=True).encode()).hexdigest()
    stamp_path = os.path.join(out, "made_from.sha256")
    if os.path.exists(stamp_path) and open(stamp_path).read().strip() == stamp:
        return out
    os.makedirs(out, exist_ok=True)
    # The tensor names and shapes transformers' own Qwen3ForCausalLM has (no memory on "meta").
    with torch.device("meta"):
        skeleton = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in config.items()
                                                   if k not in ("architectures", "dtype",
                                                                "torch_dtype")}))
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    del skeleton
    layers = config["num_hidden_layers"]
    tensors = {}
    for index, (tensor_name, shape) in enumerate(sorted(shapes.items())):
        std = _std(tensor_name, shape, layers)
        if std == 0.0:
            tensors[tensor_name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        g = torch.Generator().manual_seed(seed * 100003 + index)
        tensors[tensor_name] = (torch.randn(shape, generator=g) * std).to(torch.bfloat16)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(stamp_path, "w") as f:
        f.write(stamp + "\n")
    return out


def kvt_binary() -> str:
    """cli/kvt from the runfiles (bazel run / test), else the workspace's bazel-bin."""
    for variable in ("TEST_SRCDIR", "RUNFILES_DIR"):
        root = os.environ.get(variable)
        if root and os.path.exists(os.path.join(root, "kvt", "cli", "kvt")):
            return os.path.join(root, "kvt", "cli", "kvt")
    # Beside this file in the runfiles tree (a py_binary run directly: no RUNFILES_DIR), else in
    # the workspace's bazel-bin.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    beside = os.path.join(root, "cli", "kvt")
    return beside if os.path.exists(beside) else os.path.join(root, "bazel-bin", "cli", "kvt")


def synth_mapper(store: str, source: str, target: str, k: int = 2, seed: int = 1) -> str:
    """store/<source>-to-<target>: `kvt synth` random ridge weights of the pair's KV shapes and
    RoPE (neox, theta 1e6, rotary_dim = head_dim). Synthetic mappers record no held-out quality:
    kvtd's gate passes them only with its floor at 0 (min_mapper_quality, min_r2_heldout)."""
    out = os.path.join(store, mapper_id(source, target))
    if os.path.exists(os.path.join(out, "manifest.yaml")):
        return out
    os.makedirs(store, exist_ok=True)
    s, t = SHAPES[source], SHAPES[target]
    cmd = [kvt_binary(), "synth", f"--out={out}", f"--source_model={source}",
           f"--target_model={target}", f"--rope_theta={ROPE_THETA:g}",
           f"--source_layers={s[0]}", f"--source_heads={s[3]}", f"--source_head_dim={s[4]}",
           f"--target_layers={t[0]}", f"--target_heads={t[3]}", f"--target_head_dim={t[4]}",
           f"--k={k}", "--weight_dtype=bf16", f"--seed={seed}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kvt synth failed: {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return out


def identity_mapper(store: str, mapper: str, model: str, source_name: str,
                    target_name: Optional[str] = None, zero_v: bool = False,
                    target_theta: float = ROPE_THETA) -> str:
    """An identity mapper (tests/vllm/identity_mappers.py) from `source_name` to `target_name`
    (default `model`), both of `model`'s KV shapes. kvtd strips the source's RoPE (neox, theta
    1e6) and applies the target's: with target_theta other than the model's, the output is the
    content space K rotated at that theta, which checks the strip itself."""
    layers, _, _, heads, dim, _ = SHAPES[model]
    return identity_mappers.write(
        os.path.join(store, mapper), source_name=source_name, target_name=target_name or model,
        layers=layers, heads=heads, dim=dim, source_theta=ROPE_THETA, target_theta=target_theta,
        zero_v=zero_v, created_by="tests/vllm/qwen3_shapes.py identity_mapper")


def write_all(out: str, tiny: bool) -> Dict[str, str]:
    """Both models of the pair and the synthesised mapper between them under `out`."""
    source, target = TINY_PAIR if tiny else PAIR
    paths = {name: write_model(out, name, seed=i + 1) for i, name in enumerate((source, target))}
    paths["store"] = os.path.join(out, "store")
    paths["mapper"] = synth_mapper(paths["store"], source, target)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="the tiny pair instead")
    args = parser.parse_args()
    for what, path in write_all(args.out, args.tiny).items():
        print(f"{what}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
