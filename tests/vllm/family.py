"""Test support: the bundled family's mappers for the vLLM tests, fitted once per suite the way
eval/handoff_demo.py fits them (tools/dump_kv.py calibration dumps, `kvt fit` ridge, k=2), and a
kvtd with the source-cache tier on a fixed port (so it can be killed and restarted)."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

import retention as R  # eval/retention.py: dumps, kvt fit, the Member wrapper

FAMILY = os.path.join(R.ROOT, "eval", "tinyfamily", "models")
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
    calib = R.write_split("calib", os.path.join(work, "calib.jsonl"))
    members = sorted({m for pair in pairs for m in pair})
    dumps = {m: R.dump(model_dir(m), calib, os.path.join(work, "dumps", m), CALIB_TOKENS,
                       CALIB_WINDOWS) for m in members}
    for s, t in pairs:
        out = os.path.join(store, mapper_id(s, t))
        if not os.path.exists(os.path.join(out, "manifest.yaml")):
            R.fit(dumps[s], dumps[t], NAMES[s], NAMES[t], TOP_K, out)
    return store


def kvtd_yaml(path: str, *, max_bytes: int = 256 << 20, pair_min_quality: Optional[Dict] = None,
              min_mapper_quality: float = 0.0) -> str:
    lines = ["prefix_cache:", "  enabled: true", f"  max_bytes: {max_bytes}",
             "  ttl_seconds: 600", "  block_tokens: 16", "  lease_seconds: 30",
             f"  min_mapper_quality: {min_mapper_quality}"]
    if pair_min_quality:
        lines.append("  pair_min_quality:")
        lines += [f'    "{k}": {v}' for k, v in pair_min_quality.items()]
    else:
        lines.append("  pair_min_quality: {}")
    # Engines on this node may hand kvtd a shared-memory region for translated loads.
    lines += ["shared_memory:", "  allow_client_regions: true"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def start_kvtd(store: str, port: int, config: str, name: str = "vllm-kvtd") -> "R.Kvtd":
    return R.Kvtd([f"--config={config}", f"--listen_address=127.0.0.1:{port}",
                   f"--mapper_store={store}", "--backend=cpu", "--cpu_threads=1",
                   "--drain_grace_seconds=0", "--max_tokens=65536"], name)


def wait_for_entries(client, model: str, tokens: int, timeout: float = 20.0) -> None:
    """Until kvtd holds at least `tokens` tokens of `model` (publishes are asynchronous)."""
    from kvt.prefix import PrefixCache
    prefix = PrefixCache(client)
    end = time.monotonic() + timeout
    while True:
        entries = prefix.list(model).entries
        if any(e.num_tokens >= tokens for e in entries):
            return
        if time.monotonic() > end:
            raise AssertionError(f"kvtd holds no {tokens}-token entry of {model}: "
                                 f"{[(e.model, e.num_tokens) for e in entries]}")
        time.sleep(0.05)


def heldout_text(n: int, offset: int = 0) -> List[int]:
    """n byte tokens of the held-out documents (never seen in training or calibration)."""
    stream = [t for ids in R.token_stream("heldout") for t in ids]
    return stream[offset:offset + n]
