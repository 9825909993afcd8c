#!/usr/bin/env python3
"""Writes a mapper directory in the layout of vllm-project/semantic-router's
src/training/kv_mapper (artifact.py, fit.py), with random float32 weights, for testing
`kvt import --format=semantic-router`. Needs numpy and safetensors (the project venv).

The layout, as artifact.py writes it:
  manifest.json        json.dumps(manifest, indent=2, sort_keys=True) + "\\n": mapper_id,
                       compatibility {source_model, source_revision, target_model,
                       target_revision, variant, precision, source_tp, target_tp, head_order,
                       num_kv_heads, head_dim}, topk, ridge_alpha, centered_inputs,
                       rope_stripped_on_keys, source_layers_per_target {"k": {"<L>": [j, ...]},
                       "v": {...}}, calibration, evaluation_report, schema_version
  weights.safetensors  per target layer L: target.L.k.W, target.L.k.b, target.L.v.W,
                       target.L.v.b, float32. y = x @ W + b, x = the listed source layers'
                       pre-RoPE keys (or values) concatenated in stored order, each flattened
                       head-major, so W is [topk * n_kv * d, n_kv * d] and b is [n_kv * d].
  SHA256SUMS           "<sha256>  manifest.json" and "<sha256>  weights.safetensors"

per_head (target head h from source head h only) has no tensor layout in the upstream code
(its validate_artifact accepts full_head only); --per_head_layout picks the dense block matrix
(zeros off the head blocks, same shape as full_head) or a compact [n_kv, topk * d, d] stack whose
row b * d + i of head h multiplies dimension i of head h of the b-th listed source layer.

With --source_config / --target_config it also writes Hugging Face config.json files of the two
models (which the artifact lacks: it stores no layer counts and no RoPE settings).
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np


def save_safetensors(path, tensors):
    """weights.safetensors as artifact.py writes it: safetensors.numpy.save_file of the float32
    arrays (no metadata)."""
    from safetensors.numpy import save_file

    save_file({name: np.ascontiguousarray(array, dtype="<f4") for name, array in tensors.items()},
              path)


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def make_mapper_id(pair_slug, variant, precision, source_revision, target_revision, tp, heads):
    """mapper_id.py's make_mapper_id for equal TP degrees and bundle version 1."""
    return (f"{pair_slug}-{variant}-{precision}-tp{tp}-h{heads}"
            f"-s{source_revision[-12:]}-t{target_revision[-12:]}-b1")


def random_weights(rng, args):
    n, d, k = args.num_kv_heads, args.head_dim, args.topk
    width = n * d
    fan_in = k * (d if args.variant == "per_head" else width)
    if args.variant == "full_head":
        return rng.standard_normal((k * width, width)) / np.sqrt(fan_in)
    compact = rng.standard_normal((n, k * d, d)) / np.sqrt(fan_in)
    if args.per_head_layout == "compact":
        return compact
    dense = np.zeros((k * width, width))
    for b in range(k):
        for h in range(n):
            rows = slice((b * n + h) * d, (b * n + h + 1) * d)
            dense[rows, h * d:(h + 1) * d] = compact[h, b * d:(b + 1) * d, :]
    return dense


def write_artifact(args):
    rng = np.random.default_rng(args.seed)
    width = args.num_kv_heads * args.head_dim
    selection, tensors = {}, {}
    for layer in range(args.target_layers):
        # fit_run.py: one shared top-k list per target layer, for K and V alike.
        chosen = rng.permutation(args.source_layers)[:args.topk]
        selection[str(layer)] = [int(j) for j in chosen]
        for channel in ("k", "v"):
            tensors[f"target.{layer}.{channel}.W"] = random_weights(rng, args).astype(np.float32)
            tensors[f"target.{layer}.{channel}.b"] = (
                0.1 * rng.standard_normal(width)).astype(np.float32)
    source_revision, target_revision = "0123456789abcdef0123", "fedcba9876543210fedc"
    manifest = {
        "mapper_id": make_mapper_id(args.pair_slug, args.variant, "fp16", source_revision,
                                    target_revision, 1, args.num_kv_heads),
        "compatibility": {
            "source_model": args.source_model, "source_revision": source_revision,
            "target_model": args.target_model, "target_revision": target_revision,
            "variant": args.variant, "precision": "fp16", "source_tp": 1, "target_tp": 1,
            "head_order": "contiguous", "num_kv_heads": args.num_kv_heads,
            "head_dim": args.head_dim,
        },
        "topk": args.topk,
        "ridge_alpha": 0.01,
        "centered_inputs": True,
        "rope_stripped_on_keys": True,
        "source_layers_per_target": {"k": selection, "v": dict(selection)},
        "calibration": {"corpus": "random (tools/write_semantic_router_mapper.py)",
                        "seed": args.seed, "num_sequences": 0},
        "evaluation_report": None,
        "schema_version": 1,
    }
    os.makedirs(args.out, exist_ok=True)
    save_safetensors(os.path.join(args.out, "weights.safetensors"), tensors)
    with open(os.path.join(args.out, "manifest.json"), "w") as out:
        out.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    lines = [f"{sha256_file(os.path.join(args.out, name))}  {name}"
             for name in ("manifest.json", "weights.safetensors")]
    with open(os.path.join(args.out, "SHA256SUMS"), "w") as out:
        out.write("\n".join(lines) + "\n")


def write_config(path, name, layers, args, theta, partial_rotary_factor=1.0, rope_scaling=None):
    config = {
        "_name_or_path": name,
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": layers,
        "num_attention_heads": 2 * args.num_kv_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_size": 2 * args.num_kv_heads * args.head_dim,
        "rope_theta": theta,
        "max_position_embeddings": 4096,
        "rope_scaling": rope_scaling,
    }
    if partial_rotary_factor != 1.0:
        config["partial_rotary_factor"] = partial_rotary_factor
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as out:
        out.write(json.dumps(config, indent=2) + "\n")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the artifact directory to write")
    parser.add_argument("--variant", choices=("full_head", "per_head"), default="full_head")
    parser.add_argument("--per_head_layout", choices=("dense", "compact"), default="dense")
    parser.add_argument("--source_layers", type=int, default=5)
    parser.add_argument("--target_layers", type=int, default=4)
    parser.add_argument("--num_kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=16)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pair_slug", default="tiny-a-b")
    parser.add_argument("--source_model", default="test/tiny-a")
    parser.add_argument("--target_model", default="test/tiny-b")
    parser.add_argument("--source_config", help="also write the source model's config.json here")
    parser.add_argument("--target_config", help="also write the target model's config.json here")
    parser.add_argument("--source_rope_theta", type=float, default=10000.0)
    parser.add_argument("--target_rope_theta", type=float, default=1000000.0)
    parser.add_argument("--target_partial_rotary_factor", type=float, default=1.0)
    parser.add_argument("--target_rope_scaling", default="null",
                        help='the target config\'s rope_scaling as JSON, e.g. '
                             '\'{"rope_type": "linear", "factor": 2}\'')
    args = parser.parse_args(argv)
    if not 1 <= args.topk <= args.source_layers:
        parser.error("--topk must be in [1, --source_layers]")
    write_artifact(args)
    if args.source_config:
        write_config(args.source_config, args.source_model, args.source_layers, args,
                     args.source_rope_theta)
    if args.target_config:
        write_config(args.target_config, args.target_model, args.target_layers, args,
                     args.target_rope_theta, args.target_partial_rotary_factor,
                     json.loads(args.target_rope_scaling))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
