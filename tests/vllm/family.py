"""The bundled family's mappers for the vLLM tests, fitted once per suite (tools/dump_kv.py
calibration dumps, `kvt fit` ridge, k=2; eval/handoff_demo.py serves what `--kind both`
recommends instead, with its gate on), and a kvtd with the source-cache tier on a fixed port
(so it can be killed and restarted)."""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

from kvt.prefix import PrefixCache, first_block_hash
from kvt_testing import identity_mappers, tinyfamily
from kvt_testing.kvtd import Kvtd

FAMILY = tinyfamily.MODELS
NAMES = {"S": "kvt-tiny-S", "M": "kvt-tiny-M", "L": "kvt-tiny-L", "U": "kvt-tiny-U"}
PAIRS = (("M", "L"), ("L", "M"), ("S", "L"), ("L", "S"))
CALIB_TOKENS, CALIB_WINDOWS, TOP_K = 256, 32, 2


def model_dir(member: str) -> str:
    return os.path.join(FAMILY, member)


def mapper_id(source: str, target: str) -> str:
    return f"{source}-to-{target}"


def fit_store(work: str, pairs=PAIRS) -> str:
    """Mapper store under work/store with one ridge mapper per pair, named "<S>-to-<T>"."""
    store = os.path.join(work, "store")
    os.makedirs(work, exist_ok=True)
    calib = tinyfamily.write_split("calib", os.path.join(work, "calib.jsonl"))
    members = sorted({m for pair in pairs for m in pair})
    dumps = {m: tinyfamily.dump(model_dir(m), calib, os.path.join(work, "dumps", m),
                                CALIB_TOKENS, CALIB_WINDOWS) for m in members}
    for s, t in pairs:
        out = os.path.join(store, mapper_id(s, t))
        if not os.path.exists(os.path.join(out, "manifest.yaml")):
            tinyfamily.fit(dumps[s], dumps[t], NAMES[s], NAMES[t], TOP_K, out)
    return store


def kvtd_yaml(path: str, *, max_bytes: int = 256 << 20, pair_min_quality: Optional[Dict] = None,
              min_mapper_quality: float = 0.0, min_benefit_recovered: float = 0.0,
              lease_seconds: float = 30,
              allow_client_regions: bool = True, prefix_cache_enabled: bool = True,
              verify_sample_fraction: float = 0.0) -> str:
    # Live verification is off unless a test asks for it: a sampled lookup prefills instead of
    # loading, which the handoff tests and benchmarks must not see by chance.
    lines = ["prefix_cache:", f"  enabled: {'true' if prefix_cache_enabled else 'false'}",
             f"  max_bytes: {max_bytes}",
             "  ttl_seconds: 600", "  block_tokens: 16", f"  lease_seconds: {lease_seconds}",
             f"  min_mapper_quality: {min_mapper_quality}",
             # The benefit gate (kvtd's default 0.5) off unless asked for: the family's fits
             # record no quality.benefit.
             f"  min_benefit_recovered: {min_benefit_recovered}",
             f"  verify_sample_fraction: {verify_sample_fraction}"]
    if pair_min_quality:
        lines.append("  pair_min_quality:")
        lines += [f'    "{k}": {v}' for k, v in pair_min_quality.items()]
    else:
        lines.append("  pair_min_quality: {}")
    # Engines on this node may hand kvtd a shared-memory region for translated loads.
    lines += ["shared_memory:",
              f"  allow_client_regions: {'true' if allow_client_regions else 'false'}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def start_kvtd(store: str, port: int, config: str, name: str = "vllm-kvtd",
               cpu_threads: int = 1) -> Kvtd:
    return Kvtd([f"--config={config}", f"--listen_address=127.0.0.1:{port}",
                 f"--mapper_store={store}", "--backend=cpu", f"--cpu_threads={cpu_threads}",
                 "--drain_grace_seconds=0", "--max_tokens=65536"], name)


def entry_ids(client, model: str) -> set:
    """Ids of the entries kvtd holds for `model` now."""
    return {e.entry_id for e in PrefixCache(client).list(model).entries}


def wait_for_entries(client, model: str, prefix: Sequence[int], timeout: float = 20.0,
                     exclude: Optional[set] = None) -> None:
    """Until kvtd holds `prefix`'s whole blocks as `model`'s cache (publishes are asynchronous):
    an entry of at least that many tokens that starts with the same block (so that a late
    publish of another text cannot end the wait) and whose id is not in `exclude` (entry_ids
    before the publish: a new entry)."""
    prefix_cache = PrefixCache(client)
    end = time.monotonic() + timeout
    while True:
        listing = prefix_cache.list(model)
        block = listing.block_tokens
        want = first_block_hash(model, prefix, block)
        tokens = len(prefix) // block * block if block else len(prefix)
        if any(e.num_tokens >= tokens and e.first_block_hash == want
               and e.entry_id not in (exclude or ()) for e in listing.entries):
            return
        if time.monotonic() > end:
            raise AssertionError(f"kvtd holds no new {tokens}-token entry of {model} starting "
                                 f"with block {want}: "
                                 f"{[(e.num_tokens, e.first_block_hash) for e in listing.entries]}")
        time.sleep(0.05)


def heldout_text(n: int, offset: int = 0) -> List[int]:
    """n byte tokens of the held-out documents (never seen in training or calibration)."""
    stream = [t for ids in tinyfamily.token_stream("heldout") for t in ids]
    return stream[offset:offset + n]


TWIN_L = "kvt-tiny-L-twin"  # a second name for L's weights: the source of the identity mappers


def cache_shape(model_path: str) -> Tuple[int, int, int]:
    """(layers, KV heads, head_dim) of the model directory's config.json."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"], config["num_key_value_heads"], dim


def identity_mapper(store: str, mapper: str, member: str = "L", source_name: str = TWIN_L,
                    zero_v: bool = False, target_name: Optional[str] = None) -> str:
    """A real mapper directory (manifest, safetensors weights, SHA256SUMS) from `source_name` to
    `member` that copies each layer's K (and V, unless zero_v) unchanged: k = 1, W = I, b = 0.
    kvtd serves it like any fitted mapper (RoPE stripped and re-applied at the same positions),
    so a cache `member` computed itself comes back within float rounding: the connector's
    paged load can be checked against a plain run independently of any fitted mapper's
    quality. zero_v writes V's weights as zeros (the load must then change the output).
    target_name: the target model's name (default `member`'s own; the reverse identity, from
    `member` to the twin, reads back what an engine of `member` published)."""
    with open(os.path.join(model_dir(member), "config.json")) as f:
        theta = float(json.load(f).get("rope_theta", 10000.0))
    layers, heads, dim = cache_shape(model_dir(member))
    return identity_mappers.write(
        os.path.join(store, mapper), source_name=source_name,
        target_name=target_name or NAMES[member], layers=layers,
        heads=heads, dim=dim, source_theta=theta, target_theta=theta,
        zero_v=zero_v, created_by="tests/vllm/family.py identity_mapper")
