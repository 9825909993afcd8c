"""Cross-node reuse vs same-node reuse vs the plain engine's own prefill, at 2K tokens on the tiny
family, with the store's transfer rate next to memcpy and a raw TCP socket in the same run.

Two simulated nodes as in tests/cluster/vllm_test.py (each its own kvtd and vLLM engine, one
Mooncake master and segment holder on loopback): engine A serves the tiny family's L as
"kvt-tiny-L-twin", engine B as "kvt-tiny-L"; each kvtd serves the identity mappers between them.
Per prompt (fresh held-out text, --tokens long):

  plain     B prefills the prompt itself (reuse forbidden, a cache salt of its own)
  cross     A served the prompt (published to kvtd A and put into the store); B's first request
            finds it in the store, fetches it into kvtd B and loads it translated
  same      B again, another salt: kvtd B now holds the prefix (node-local tier)

TTFT is the wall time of a 1-token request (engine_host.py's wall_s). Then, in the same process
and run: memcpy, one TCP stream over loopback, and the store's put_prefix / fetch of a cache of
the same size (kvt-tiny-L's geometry) at chunk_blocks 4 and 16.

    PATH=$PWD/.venv/bin:$PATH bazel run //tests/cluster:cluster_benchmark -- --prompts=5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

import engines as E
import family
from engines import outcome
from kvt.cluster import ClusterStore, Geometry
from mooncake_cluster import MooncakeCluster

A_NAME, B_NAME = family.TWIN_L, family.NAMES["L"]


def l_shape():
    with open(os.path.join(family.model_dir("L"), "config.json")) as f:
        config = json.load(f)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"], config["num_key_value_heads"], dim


def node_kvtd(work, name):
    store = os.path.join(work, f"node-{name}", "store")
    family.identity_mapper(store, "Ltwin-to-L")
    family.identity_mapper(store, "L-to-Ltwin", source_name=B_NAME, target_name=A_NAME)
    config = family.kvtd_yaml(os.path.join(work, f"node-{name}", "kvtd.yaml"), max_bytes=1 << 30)
    return family.start_kvtd(store, E.free_port(), config, f"kvtd-{name}").__enter__()


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


def store_rates(store, shape, tokens, chunk_blocks, repeats):
    layers, heads, dim = shape
    tokens = tokens // 16 * 16  # the store holds whole blocks
    g = Geometry(f"kvt-bench-{chunk_blocks}", layers, heads, dim, "fp32", 16, chunk_blocks)
    nbytes = g.packed_bytes(tokens)
    dst = np.empty(nbytes, np.uint8)
    address, _ = store.register(dst)
    puts, gets = [], []
    try:
        for i in range(repeats):
            ids = [int(t) for t in np.random.default_rng(100 + i).integers(0, 256, tokens)]
            cache = np.random.default_rng(i).standard_normal(nbytes // 4).astype(np.float32)
            t = time.perf_counter()
            store.put_prefix(g, ids, cache, timeout=30)
            puts.append(time.perf_counter() - t)
            match = store.longest_prefix([g], ids)[g.model]
            t = time.perf_counter()
            store.fetch(match, dst, timeout=30)
            gets.append(time.perf_counter() - t)
            assert np.array_equal(dst.view(np.float32), cache)
    finally:
        store.unregister(address)
    return nbytes, (min(puts), statistics.median(puts)), (min(gets), statistics.median(gets))


def main():
    parser = argparse.ArgumentParser()
    # 2047: the tiny family's max_position_embeddings is 2048 (as tests/vllm/ttft_benchmark.py).
    parser.add_argument("--tokens", type=int, default=2047)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    # The engines' cluster.chunk_blocks (kvtd blocks per store object).
    parser.add_argument("--chunk_blocks", type=int, default=4)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="kvt-cluster-bench-")
    shape = l_shape()
    engines, kvtds = {}, {}
    with MooncakeCluster(1 << 30, "bench") as cluster:
        store = ClusterStore(cluster.config())
        try:
            cluster.wait_ready(store)
            common = {"master_server_address": cluster.master_address,
                      "metadata_server": cluster.metadata_server, "local_hostname": "127.0.0.1",
                      "lookup_timeout_s": 0.5, "fetch_timeout_s": 10.0, "put_timeout_s": 10.0,
                      "chunk_blocks": args.chunk_blocks}
            for name, model_name in (("A", A_NAME), ("B", B_NAME)):
                kvtds[name] = kvtd = node_kvtd(work, name)
                config = {"kvtd_address": kvtd.address, "model_name": model_name,
                          "lookup_timeout_s": 2.0, "translate_timeout_s": 60.0,
                          "cluster": common}
                engines[name] = E.Engine(name, family.model_dir("L"), config, work,
                                         max_model_len=2048,
                                         env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"}).start()
            for engine in engines.values():
                engine.wait_ready()
                wait_log(engine, "cluster tier: store client ready", 2)
            A, B = engines["A"], engines["B"]
            geometry_a = Geometry(A_NAME, *shape, "fp32", 16, args.chunk_blocks)
            # Warm-up: the first load pays the mapper's page-in and vLLM's first-shape costs.
            warm = family.heldout_text(args.tokens, 0)
            A.one(warm, 1)
            wait_in_store(store, geometry_a, warm)
            B.one(warm, 1, cache_salt="warm-1")
            B.one(warm, 1, cache_salt="warm-2")
            B.one(warm, 1, kvt={"reuse": "forbid"}, cache_salt="warm-3")
            rows = {"plain": [], "cross": [], "same": []}
            details = []
            for i in range(args.prompts):
                prompt = family.heldout_text(args.tokens, 4000 + i * args.tokens)
                plain = B.one(prompt, 1, kvt={"reuse": "forbid"}, cache_salt=f"plain-{i}")
                rows["plain"].append(plain["wall_s"])
                A.one(prompt, 1)
                wait_in_store(store, geometry_a, prompt)
                cross = B.one(prompt, 1, cache_salt=f"cross-{i}")
                o = outcome(cross)
                if o.get("tier") != "cluster":
                    raise RuntimeError(f"cross-node request not applied from the store: {o}")
                rows["cross"].append(cross["wall_s"])
                same = B.one(prompt, 1, cache_salt=f"same-{i}")
                s = outcome(same)
                if s.get("outcome") != "applied" or s.get("tier") != "local":
                    raise RuntimeError(f"same-node request not applied locally: {s}")
                rows["same"].append(same["wall_s"])
                details.append({"cross": {"tokens_reused": o["tokens_reused"],
                                          "cluster": o["cluster"], "timings": o["timings"]},
                                "same": {"tokens_reused": s["tokens_reused"],
                                         "timings": s["timings"]}})
            nbytes = details[0]["cross"]["cluster"]["bytes"]
            transfers = {"bytes": nbytes,
                         "memcpy": memcpy_rate(nbytes, args.repeats),
                         "tcp": tcp_rate(nbytes, args.repeats)}
            for c in (4, 16):
                size, put, get = store_rates(store, shape, args.tokens, c, args.repeats)
                transfers[f"store_c{c}"] = {"bytes": size, "put": put, "fetch": get}
        finally:
            for engine in engines.values():
                engine.stop()
            for kvtd in kvtds.values():
                kvtd.__exit__(None, None, None)
            store.close(timeout=2.0)

    plain_ms = statistics.median(rows["plain"]) * 1e3
    print(f"\nTTFT at {args.tokens} tokens, tiny family (L as kvt-tiny-L-twin on node A, "
          f"kvt-tiny-L on node B), chunk_blocks {args.chunk_blocks}, median of {args.prompts} "
          "prompts:")
    for name in ("plain", "cross", "same"):
        ms = statistics.median(rows[name]) * 1e3
        print(f"  {name:6s} {ms:8.1f} ms  ({ms / plain_ms:.2f}x plain)   all: "
              f"{', '.join(f'{t * 1e3:.0f}' for t in rows[name])}")
    med = lambda key, sub: statistics.median(d["cross"][sub][key] for d in details)  # noqa
    print(f"  cross-node parts (median): store lookup {med('lookup_ms', 'cluster'):.1f} ms, "
          f"fetch {med('fetch_ms', 'cluster'):.1f} ms, publish to kvtd "
          f"{med('publish_ms', 'cluster'):.1f} ms, scheduler lookup total "
          f"{med('lookup_ms', 'timings'):.1f} ms, translate+load "
          f"{med('translate_ms', 'timings'):.1f} ms; tokens reused "
          f"{details[0]['cross']['tokens_reused']} (same-node "
          f"{details[0]['same']['tokens_reused']})")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
