"""Cross-node reuse vs same-node reuse vs the plain engine's own prefill at 2K tokens, on the tiny
family or on the Qwen3-shaped pair, with the store's transfer rate next to memcpy and a raw TCP
socket in the same run.

Phase 1: engine B's model without any KV connector, alone (the baseline of every ratio).
Phase 2: two simulated nodes as in tests/cluster/vllm_test.py (each its own kvtd and vLLM
engine, one Mooncake master and segment holder on loopback, nothing else shared):

  --pair=tiny   engine A serves the tiny family's L as "kvt-tiny-L-twin", engine B as
                "kvt-tiny-L"; each kvtd serves the identity mappers between them
  --pair=qwen3  engine A the Qwen3-0.6B-shaped model, engine B the Qwen3-1.7B-shaped one (random
                bf16 weights and a synthesised ridge mapper written at run time, as
                tests/vllm/qwen3_benchmark.py), engines in bf16

Per prompt (fresh held-out text, --tokens long):

  plain     B's model without the connector prefills the prompt (phase 1)
  own       B with the connector prefills it itself (reuse forbidden; --own, tiny pair default)
  cross     A served the prompt (published to kvtd A and put into the store); B's first request
            finds it in the store, fetches it into kvtd B and loads it translated
  same      B again, another salt: kvtd B now holds the prefix (node-local tier)

TTFT is the wall time of a 1-token request (engine_host.py's wall_s). Then, in the same process
and run: memcpy, one TCP stream over loopback, and the store's put_prefix / fetch of a cache of
the same size (A's geometry) at chunk_blocks 4 and 16.

    PATH=$PWD/.venv/bin:$PATH bazel run //tests/cluster:cluster_benchmark -- --prompts=5
    PATH=$PWD/.venv/bin:$PATH bazel run //tests/cluster:cluster_benchmark -- --pair=qwen3 \
        --tokens=2048 --prompts=2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, List

import numpy as np

import engines as E
import family
import qwen3_shapes as Q
from engines import outcome
from kvt.cluster import ClusterStore, Geometry
from mooncake_cluster import MooncakeCluster


@dataclass
class Pair:
    """What the two nodes serve: engine A (node A) publishes, engine B (node B) reuses."""
    name: str
    a_model: str          # served model name of engine A (the source)
    b_model: str          # of engine B (the target)
    a_dir: str
    b_dir: str
    a_shape: tuple        # (layers, kv heads, head_dim) of A's cache: the store's geometry
    wire_dtype: str       # the engines' KV dtype as kvt names it
    engine_dtype: str     # vLLM's dtype of the engines
    stores: Callable[[str], str]  # node work dir -> that node's mapper store
    prompt: Callable[[int, int], List[int]]  # (tokens, offset) -> prompt ids
    max_len: int


def tiny_pair(work):
    """The tiny family's L served under two names (engine A as kvt-tiny-L-twin, B as kvt-tiny-L)
    and the identity mappers between them: a translated prefix is exactly B's own cache."""
    del work

    def stores(node_dir):
        store = os.path.join(node_dir, "store")
        family.identity_mapper(store, "Ltwin-to-L")
        family.identity_mapper(store, "L-to-Ltwin", source_name=family.NAMES["L"],
                               target_name=family.TWIN_L)
        return store

    # The tiny family declares 512 positions; engine_host raises it to max_len for timing only.
    return Pair("tiny family (L as kvt-tiny-L-twin on node A, kvt-tiny-L on node B)",
                family.TWIN_L, family.NAMES["L"], family.model_dir("L"), family.model_dir("L"),
                family.cache_shape(family.model_dir("L")), "fp32", "float32", stores,
                lambda n, offset: family.heldout_text(n, offset), 2048)


def qwen3_pair(work, shapes):
    """The Qwen3-0.6B -> 1.7B-shaped pair of tests/vllm/qwen3_benchmark.py (random bf16 weights
    and a synthesised ridge mapper, written at run time), engines in bf16."""
    paths = Q.write_all(os.path.join(work, "models"), tiny=shapes == "tiny")
    source, target = Q.TINY_PAIR if shapes == "tiny" else Q.PAIR

    def stores(node_dir):
        # Each node its own copy: the nodes share nothing but the Mooncake Store.
        store = os.path.join(node_dir, "store")
        shutil.copytree(paths["store"], store)
        return store

    def prompt(n, offset):
        stream = family.heldout_text(n, offset)
        return (stream + family.heldout_text(n, 0))[:n]

    return Pair(f"Qwen3-shaped {source} (node A) -> {target} (node B), bf16", source, target,
                paths[source], paths[target], family.cache_shape(paths[source]), "bf16",
                "bfloat16", stores, prompt, 4096)


def node_kvtd(work, name, pair, max_bytes, threads):
    node_dir = os.path.join(work, f"node-{name}")
    store = pair.stores(node_dir)
    # The Qwen3 pair's mapper is synthetic (no recorded quality): the gate's floor is 0 there,
    # as in the single-node Qwen3 benchmark; the identity mappers have no quality either.
    config = family.kvtd_yaml(os.path.join(node_dir, "kvtd.yaml"), max_bytes=max_bytes)
    return family.start_kvtd(store, E.free_port(), config, f"kvtd-{name}",
                             cpu_threads=threads).__enter__()


def wait_log(engine, needle, count, timeout=120.0):
    end = time.monotonic() + timeout
    while len(engine.log_lines(needle)) < count:
        if time.monotonic() > end:
            raise RuntimeError(f"engine {engine.name}: no {needle!r}:\n{engine.log_tail()}")
        time.sleep(0.05)


def wait_in_store(store, geometry, prompt, timeout=60.0):
    want = (len(prompt) // 16) // geometry.chunk_blocks * geometry.chunk_blocks
    end = time.monotonic() + timeout
    while store.longest_prefix([geometry], prompt)[geometry.model].blocks < want:
        if time.monotonic() > end:
            raise RuntimeError("the publisher's put did not land")
        time.sleep(0.05)


def rate(nbytes, seconds):
    return nbytes / seconds / 1e9


def best_of(n, fn):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def memcpy_rate(nbytes, repeats):
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return best_of(repeats, lambda: np.copyto(dst, src))


def tcp_rate(nbytes, repeats):
    """One TCP stream over loopback: the receiver reads into a preallocated buffer."""
    payload = memoryview(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    received = bytearray(nbytes)

    def serve():
        conn, _ = listener.accept()
        with conn:
            for _ in range(repeats):
                view, got = memoryview(received), 0
                while got < nbytes:
                    got += conn.recv_into(view[got:])
                conn.sendall(b"k")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    times = []
    with socket.create_connection(listener.getsockname()) as client:
        for _ in range(repeats):
            t = time.perf_counter()
            client.sendall(payload)
            client.recv(1)
            times.append(time.perf_counter() - t)
    thread.join(10)
    listener.close()
    return min(times), statistics.median(times)


def store_rates(store, pair, tokens, chunk_blocks, repeats):
    layers, heads, dim = pair.a_shape
    tokens = tokens // 16 * 16  # the store holds whole blocks
    g = Geometry(f"kvt-bench-{chunk_blocks}", layers, heads, dim, pair.wire_dtype, 16,
                 chunk_blocks)
    nbytes = g.packed_bytes(tokens)
    dst = np.empty(nbytes, np.uint8)
    address, _ = store.register(dst)
    puts, gets = [], []
    try:
        for i in range(repeats):
            ids = [int(t) for t in np.random.default_rng(100 + i).integers(0, 256, tokens)]
            cache = np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8)
            t = time.perf_counter()
            store.put_prefix(g, ids, cache, timeout=30)
            puts.append(time.perf_counter() - t)
            match = store.longest_prefix([g], ids)[g.model]
            t = time.perf_counter()
            store.fetch(match, dst, timeout=30)
            gets.append(time.perf_counter() - t)
            assert np.array_equal(dst, cache)
    finally:
        store.unregister(address)
    return nbytes, (min(puts), statistics.median(puts)), (min(gets), statistics.median(gets))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pair", default="tiny", choices=("tiny", "qwen3"))
    parser.add_argument("--shapes", default="full", choices=("full", "tiny"),
                        help="--pair=qwen3 only: the Qwen3-0.6B / 1.7B shapes, or the tiny "
                             "Qwen3 pair (minutes, for development)")
    # 2047: the engines' max_model_len is 2048 (past the tiny family's declared 512: timing only).
    parser.add_argument("--tokens", type=int, default=2047)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="of each transfer measurement")
    # The engines' cluster.chunk_blocks (kvtd blocks per store object).
    parser.add_argument("--chunk_blocks", type=int, default=4)
    parser.add_argument("--own", action=argparse.BooleanOptionalAction, default=None,
                        help="also time B's own prefill with the connector on (default: tiny "
                             "pair only; the Qwen3 single-node benchmark has that row)")
    parser.add_argument("--warm_tokens", type=int, default=0,
                        help="warm-up prompt length (default: --tokens; 512 for the Qwen3 pair)")
    parser.add_argument("--segment_gib", type=int, default=0,
                        help="the store's segment (default 1 GiB; 3 GiB for the Qwen3 pair)")
    parser.add_argument("--kvtd_threads", type=int, default=2)
    parser.add_argument("--settle_s", type=float, default=1.0,
                        help="pause before each timed request: the other engine's idle polling "
                             "and the publishes' work end before the clock starts")
    args = parser.parse_args()
    qwen3 = args.pair == "qwen3"
    own = args.own if args.own is not None else not qwen3
    warm_tokens = args.warm_tokens or (min(512, args.tokens) if qwen3 else args.tokens)
    segment = (args.segment_gib or (3 if qwen3 else 1)) << 30
    work = tempfile.mkdtemp(prefix="kvt-cluster-bench-")
    pair = qwen3_pair(work, args.shapes) if qwen3 else tiny_pair(work)
    prompts = [pair.prompt(args.tokens, 4000 + i * args.tokens) for i in range(args.prompts)]
    rows = {"plain": plain_engine_ttft(pair, work, prompts, args.settle_s),
            "own": [], "cross": [], "same": []}
    details, transfers = two_nodes(args, pair, work, prompts, rows, own, warm_tokens, segment)
    report(args, pair, rows, details, transfers)
    return 0


def plain_engine_ttft(pair, work, prompts, settle_s):
    """Phase 1, the baseline: engine B's model without any KV connector, alone on the machine."""
    plain = E.Engine("B-plain", pair.b_dir, {}, work, max_model_len=pair.max_len,
                     no_connector=True, dtype=pair.engine_dtype).start()
    try:
        plain.wait_ready(timeout=1200)
        for i in range(2):  # the first requests of an engine are slower
            plain.one(pair.prompt(64, 0), 1, cache_salt=f"warm-{i}")
        out = []
        for i, prompt in enumerate(prompts):
            time.sleep(settle_s)
            out.append(plain.one(prompt, 1, cache_salt=f"plain-{i}")["wall_s"])
            print(f"plain engine, prompt {i + 1}: {out[-1] * 1e3:.0f} ms", file=sys.stderr)
        return out
    finally:
        plain.stop()


def two_nodes(args, pair, work, prompts, rows, own, warm_tokens, segment):
    """Phase 2: node A (kvtd A, engine A) publishes, node B (kvtd B, engine B) reuses, one
    Mooncake master and segment holder between them; then the transfer rates."""
    engines, kvtds = {}, {}
    with MooncakeCluster(segment, "bench") as cluster:
        store = ClusterStore(cluster.config())
        try:
            cluster.wait_ready(store)
            common = {"master_server_address": cluster.master_address,
                      "metadata_server": cluster.metadata_server, "local_hostname": "127.0.0.1",
                      "lookup_timeout_s": 0.5, "fetch_timeout_s": 30.0, "put_timeout_s": 30.0,
                      "chunk_blocks": args.chunk_blocks}
            max_bytes = 3 << 30 if args.pair == "qwen3" else 1 << 30
            for name, model_name, model_dir in (("A", pair.a_model, pair.a_dir),
                                                ("B", pair.b_model, pair.b_dir)):
                kvtds[name] = kvtd = node_kvtd(work, name, pair, max_bytes, args.kvtd_threads)
                config = {"kvtd_address": kvtd.address, "model_name": model_name,
                          "lookup_timeout_s": 30.0, "translate_timeout_s": 300.0,
                          "cluster": common}
                engines[name] = E.Engine(name, model_dir, config, work,
                                         max_model_len=pair.max_len, dtype=pair.engine_dtype,
                                         env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"}).start()
            for engine in engines.values():
                engine.wait_ready(timeout=1200)
                wait_log(engine, "cluster tier: store client ready", 2)
            A, B = engines["A"], engines["B"]
            geometry_a = Geometry(pair.a_model, *pair.a_shape, pair.wire_dtype, 16,
                                  args.chunk_blocks)
            # Warm-up: the first load pays the mapper's page-in and vLLM's first-shape costs.
            warm = pair.prompt(warm_tokens, 0)
            A.one(warm, 1)
            wait_in_store(store, geometry_a, warm)
            B.one(warm, 1, cache_salt="warm-1")
            B.one(warm, 1, cache_salt="warm-2")
            B.one(warm, 1, kvt={"reuse": "forbid"}, cache_salt="warm-3")
            details = [one_prompt(A, B, store, geometry_a, prompt, i, rows, own, args.settle_s)
                       for i, prompt in enumerate(prompts)]
            nbytes = details[0]["cross"]["cluster"]["bytes"]
            transfers = {"bytes": nbytes,
                         "memcpy": memcpy_rate(nbytes, args.repeats),
                         "tcp": tcp_rate(nbytes, args.repeats)}
            for c in (4, 16):
                size, put, get = store_rates(store, pair, args.tokens, c, args.repeats)
                transfers[f"store_c{c}"] = {"bytes": size, "put": put, "fetch": get}
            return details, transfers
        finally:
            for engine in engines.values():
                engine.stop()
            for kvtd in kvtds.values():
                kvtd.__exit__(None, None, None)
            store.close(timeout=2.0)


def one_prompt(A, B, store, geometry_a, prompt, i, rows, own, settle_s):
    if own:
        time.sleep(settle_s)
        rows["own"].append(B.one(prompt, 1, kvt={"reuse": "forbid"},
                                 cache_salt=f"own-{i}")["wall_s"])
    A.one(prompt, 1, cache_salt=f"src-{i}")
    wait_in_store(store, geometry_a, prompt)
    time.sleep(settle_s)
    cross = B.one(prompt, 1, cache_salt=f"cross-{i}")
    o = outcome(cross)
    if o.get("outcome") != "applied" or o.get("tier") != "cluster":
        raise RuntimeError(f"cross-node request not applied from the store: {o}")
    rows["cross"].append(cross["wall_s"])
    time.sleep(settle_s)
    same = B.one(prompt, 1, cache_salt=f"same-{i}")
    s = outcome(same)
    if s.get("outcome") != "applied" or s.get("tier") != "local":
        raise RuntimeError(f"same-node request not applied locally: {s}")
    rows["same"].append(same["wall_s"])
    print(f"prompt {i + 1}: cross {cross['wall_s'] * 1e3:.0f} ms ({o['cluster']}, "
          f"{o['timings']}), same {same['wall_s'] * 1e3:.0f} ms", file=sys.stderr)
    return {"cross": {"tokens_reused": o["tokens_reused"], "cluster": o["cluster"],
                      "timings": o["timings"], "wall_ms": cross["wall_s"] * 1e3},
            "same": {"tokens_reused": s["tokens_reused"], "timings": s["timings"]}}


def report(args, pair, rows, details, transfers):
    plain_ms = statistics.median(rows["plain"]) * 1e3
    print(f"\nTTFT at {args.tokens} tokens, {pair.name}, chunk_blocks {args.chunk_blocks}, median "
          f"of {args.prompts} prompts; {os.cpu_count()} CPUs, load average at the end "
          f"{os.getloadavg()[0]:.1f}; ratios against the plain engine (no connector) of this "
          "run:")
    for name in ("plain", "own", "cross", "same"):
        if not rows[name]:
            continue
        ms = statistics.median(rows[name]) * 1e3
        print(f"  {name:6s} {ms:8.1f} ms  ({ms / plain_ms:.2f}x plain)   all: "
              f"{', '.join(f'{t * 1e3:.0f}' for t in rows[name])}")
    med = lambda key, sub: statistics.median(d["cross"][sub][key] for d in details)  # noqa
    parts = {"store lookup": med("lookup_ms", "cluster"), "fetch": med("fetch_ms", "cluster"),
             "publish to kvtd B": med("publish_ms", "cluster"),
             "translate + load": med("translate_ms", "timings")}
    rest = statistics.median(d["cross"]["wall_ms"] for d in details) - \
        med("lookup_ms", "timings") - parts["translate + load"]
    print(f"  cross-node parts (median, ms): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                           parts.items())
          + f"; scheduler lookup in all {med('lookup_ms', 'timings'):.1f}; the rest (tail "
          f"prefill, scheduling) {rest:.1f}; tokens reused "
          f"{details[0]['cross']['tokens_reused']} (same-node "
          f"{details[0]['same']['tokens_reused']})")
    parts["the rest (tail prefill, scheduling)"] = rest
    print(f"  dominant term: {max(parts, key=parts.get)}")
    nbytes = transfers["bytes"]
    print(f"Transfers of {nbytes / 2**20:.1f} MiB (best / median of {args.repeats}):")
    for name in ("memcpy", "tcp"):
        best, median = transfers[name]
        print(f"  {name:14s} {rate(nbytes, best):6.2f} / {rate(nbytes, median):6.2f} GB/s")
    for c in (4, 16):
        t = transfers[f"store_c{c}"]
        for kind in ("put", "fetch"):
            best, median = t[kind]
            print(f"  store {kind:5s} c{c:<3d} {rate(t['bytes'], best):6.2f} / "
                  f"{rate(t['bytes'], median):6.2f} GB/s")
    print(json.dumps({"ttft_s": rows, "details": details, "transfers": transfers}))


if __name__ == "__main__":
    sys.exit(main())
