"""The cluster tier inside vLLM: two simulated nodes on this machine, each with its own kvtd and
its own vLLM engine (KvtConnector with a `cluster` section), sharing nothing but one Mooncake
Store (a real mooncake_master and mooncake_client segment holder on loopback; every transfer
engine advertises 127.0.0.1). No mocks.

  node A: kvtd A, engine A = the tiny family's L weights served as "kvt-tiny-L-twin"
  node B: kvtd B, engine B = L as "kvt-tiny-L"

Each kvtd serves the identity mappers between the two names (tests/vllm/family.py
identity_mapper: real mapper directories, RoPE stripped and re-applied, W = I), so a prefix
translated across nodes must give exactly the output of a plain run, checked as the
single-node suite's MechanicsTest checks it (greedy tokens equal, first log-probabilities within
1e-3).

  1. A publishes, B reuses (outcome applied, tier cluster), and back (B publishes, A reuses).
  2. Every failure falls back to prefill with a named reason and a plain run's output: a key of
     another scheme version (cluster_miss), a v1 key whose object is not what the scheme
     promises (cluster_version_mismatch), objects removed between the lookup and the fetch
     (cluster_evicted), the master not answering (SIGSTOP: cluster_store_timeout), the segment
     holder gone (SIGKILL: cluster_segment_unavailable, then cluster_recently_failed for the same
     objects), the master gone (SIGKILL: cluster_store_unavailable). The last two are last: they
     take the store down.
  3. A prefix longer than a node's fetch region (cluster.fetch_region_bytes) is fetched in part,
     once: the next request finds the part in the node's kvtd (a store miss naming the region).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import unittest

import numpy as np

import engines as E
import family
from engines import outcome
from kvt.cluster import ClusterStore, Geometry, chain_hashes, object_ends
from mooncake_cluster import MooncakeCluster

WORK = os.environ.get("TEST_TMPDIR") or "/tmp/kvt-cluster-vllm-test"
LOGS = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or WORK
GEN = 8
A_NAME, B_NAME = family.TWIN_L, family.NAMES["L"]
# B waits this long between a store lookup and its fetch (cluster.fetch_delay_s), so that the
# evicted case can remove the objects in between; the test waits for B's log line, not a time.
FETCH_DELAY_S = 2.0
# A's fetch region may not grow past 1 MiB: five 64-token objects of kvt-tiny-L (192 KiB each),
# so a longer prefix is fetched in part (test 6).
A_FETCH_REGION = 1 << 20


LAYERS, HEADS, DIM = family.cache_shape(family.model_dir("L"))


def geometry(model):
    return Geometry(model, LAYERS, HEADS, DIM, "fp32", block_tokens=16, chunk_blocks=4)


class Suite:
    cluster = None
    store = None
    kvtds = {}
    engines = {}


def node_kvtd(name):
    """A node's kvtd with a mapper store of its own (the identity mappers both ways)."""
    store = os.path.join(WORK, f"node-{name}", "store")
    family.identity_mapper(store, "Ltwin-to-L")
    family.identity_mapper(store, "L-to-Ltwin", source_name=B_NAME, target_name=A_NAME)
    config = family.kvtd_yaml(os.path.join(WORK, f"node-{name}", "kvtd.yaml"))
    return family.start_kvtd(store, E.free_port(), config, f"kvtd-{name}").__enter__()


def setUpModule():
    os.makedirs(WORK, exist_ok=True)
    Suite.cluster = MooncakeCluster(128 << 20, "vllm-test").__enter__()
    try:
        Suite.store = ClusterStore(Suite.cluster.config())
        cluster = {"master_server_address": Suite.cluster.master_address,
                   "metadata_server": Suite.cluster.metadata_server,
                   "local_hostname": "127.0.0.1", "lookup_timeout_s": 0.3,
                   "fetch_timeout_s": 5.0}
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        for name, model_name, extra in (("A", A_NAME, {"fetch_region_bytes": A_FETCH_REGION}),
                                        ("B", B_NAME, {"fetch_delay_s": FETCH_DELAY_S})):
            Suite.kvtds[name] = kvtd = node_kvtd(name)
            config = {"kvtd_address": kvtd.address, "model_name": model_name,
                      "lookup_timeout_s": 2.0, "translate_timeout_s": 30.0,
                      "cluster": {**cluster, **extra}}
            Suite.engines[name] = E.Engine(name, family.model_dir("L"), config, LOGS,
                                           env=env).start()
        Suite.cluster.wait_ready(Suite.store)
        for engine in Suite.engines.values():
            engine.wait_ready()
        for engine in Suite.engines.values():
            # The scheduler (engine core) and the worker process each set up a store client.
            wait_log(engine, "cluster tier: store client ready", 2, 60)
    except BaseException:
        tearDownModule()
        raise
    print("engines started in " + ", ".join(f"{n} {e.start_s:.0f} s"
                                            for n, e in Suite.engines.items()), file=sys.stderr)


def tearDownModule():
    for engine in Suite.engines.values():
        engine.stop()
    for kvtd in Suite.kvtds.values():
        kvtd.__exit__(None, None, None)
    if Suite.store is not None:
        Suite.store.close(timeout=2.0)
    if Suite.cluster is not None:
        Suite.cluster.__exit__()


def wait_log(engine, needle, count, timeout=30.0):
    """Until the engine's log holds `count` lines containing `needle`."""
    end = time.monotonic() + timeout
    while len(engine.log_lines(needle)) < count:
        if time.monotonic() > end:
            raise AssertionError(f"engine {engine.name}: fewer than {count} log lines with "
                                 f"{needle!r}:\n{engine.log_tail()}")
        time.sleep(0.05)


def wait_in_store(model, prompt, timeout=30.0):
    """Until the store holds the prompt's whole 64-token chunks as `model`'s cache (puts run on
    the publisher thread, after the request)."""
    want = (len(prompt) // 16) // 4 * 4
    end = time.monotonic() + timeout
    while True:
        match = Suite.store.longest_prefix([geometry(model)], prompt)[model]
        if match.blocks >= want:
            return match
        if time.monotonic() > end:
            raise AssertionError(f"the store holds {match.blocks} blocks of {model}, not {want}")
        time.sleep(0.05)


_salts = iter(range(1 << 30))


def plain(engine, prompt):
    return engine.one(prompt, GEN, kvt={"reuse": "forbid"}, cache_salt=f"plain-{next(_salts)}",
                      logprobs=5)


def text(n, offset):
    return family.heldout_text(n, offset)


class ClusterTierVllmTest(unittest.TestCase):
    maxDiff = None

    def assert_like_plain(self, engine, got, prompt):
        want = plain(engine, prompt)
        self.assertEqual(got["token_ids"], want["token_ids"])
        for g, w in zip(got["logprobs"], want["logprobs"]):
            for token, value in w.items():
                self.assertAlmostEqual(g[token], value, places=3)

    def reuse_across(self, publisher, reader, offset):
        context = text(192, offset)
        prompt = context + text(40, offset + 192)
        publisher.one(context, 2)
        wait_in_store(A_NAME if publisher is Suite.engines["A"] else B_NAME, context)
        got = reader.one(prompt, GEN, logprobs=5)
        o = outcome(got)
        self.assertEqual(o.get("outcome"), "applied", o)
        self.assertEqual(o["tier"], "cluster", o)
        self.assertEqual(o["cluster"]["result"], "fetched", o)
        self.assertEqual(o["cluster"]["fetched_tokens"], 192, o)
        self.assertEqual(o["tokens_reused"], 192, o)  # whole vLLM blocks (32) of the prefix
        self.assertGreater(o["cluster"]["bytes"], 0, o)
        self.assert_like_plain(reader, got, prompt)
        print(f"\n{publisher.name} -> {reader.name}: {o['tokens_reused']} tokens; cluster "
              f"{o['cluster']}; timings {o['timings']}", file=sys.stderr)
        return o

    def fallback(self, prompt, reason, cache_salt=None):
        B = Suite.engines["B"]
        got = B.one(prompt, GEN, logprobs=5, cache_salt=cache_salt)
        o = outcome(got)
        self.assertEqual((o.get("outcome"), o.get("reason")), ("fallback_reprefill", reason), o)
        self.assert_like_plain(B, got, prompt)
        return o

    # -- 1 ----------------------------------------------------------------------------------

    def test_1_publish_on_a_reuse_on_b_and_back(self):
        A, B = Suite.engines["A"], Suite.engines["B"]
        o = self.reuse_across(A, B, 20000)
        self.assertEqual(o["source_model"], A_NAME)
        self.assertEqual(o["mapper_id"], "Ltwin-to-L")
        o = self.reuse_across(B, A, 21000)
        self.assertEqual(o["source_model"], B_NAME)
        self.assertEqual(o["mapper_id"], "L-to-Ltwin")
        # The counters reach vLLM's metrics (LLM.get_metrics drops the _total suffix).
        B.one(text(8, 0), 1, kvt={"reuse": "forbid"}, cache_salt="flush")
        metrics = B.metrics()
        for name in ("cluster_lookups", "cluster_hits", "cluster_fetches", "cluster_fetch_bytes",
                     "applied_cluster", "cluster_puts"):
            self.assertGreater(metrics.get(f"vllm:kvt_{name}", 0), 0, (name, metrics))

    # -- 2 ----------------------------------------------------------------------------------

    def test_2_another_scheme_version_is_a_miss(self):
        prompt = text(160, 22000)
        g = geometry(A_NAME)
        hashes = chain_hashes(A_NAME, prompt, 16)
        payload = g.header(0, 4, hashes[3]) + np.random.default_rng(3).standard_normal(
            g.packed_bytes(64) // 4).astype(np.float32).tobytes()
        Suite.store.put_raw(g.key(4, hashes[3], version="v2"), payload)
        o = self.fallback(prompt, "cluster_miss")
        self.assertEqual(o["cluster"]["local_reason"], "no_prefix", o)

    def test_3_an_object_not_what_its_key_promises_is_refused(self):
        prompt = text(160, 23000)
        g = geometry(A_NAME)
        hashes = chain_hashes(A_NAME, prompt, 16)
        forged = bytearray(g.header(0, 4, hashes[3]))
        forged[4:6] = (2).to_bytes(2, "little")  # another header version under a v1 key
        payload = bytes(forged) + bytes(g.packed_bytes(64))
        Suite.store.put_raw(g.key(4, hashes[3]), payload)
        self.fallback(prompt, "cluster_version_mismatch")

    def test_4_evicted_between_lookup_and_fetch(self):
        A, B = Suite.engines["A"], Suite.engines["B"]
        context = text(128, 24000)
        A.one(context, 2)
        match = wait_in_store(A_NAME, context)
        fetching = len(B.log_lines("kvt: cluster: fetching"))
        result = {}
        job = threading.Thread(target=lambda: result.update(
            got=B.one(context + text(20, 24128), GEN, logprobs=5)))
        job.start()
        # B found the objects and waits cluster.fetch_delay_s before fetching: remove them.
        wait_log(B, "kvt: cluster: fetching", fetching + 1)
        self.assertEqual(Suite.store.remove([k for k, _, _ in match.objects]),
                         [0] * len(match.objects))
        job.join(120)
        o = outcome(result["got"])
        self.assertEqual((o.get("outcome"), o.get("reason")),
                         ("fallback_reprefill", "cluster_evicted"), o)
        self.assert_like_plain(B, result["got"], context + text(20, 24128))

    def test_5_master_not_answering_gives_store_timeout(self):
        A = Suite.engines["A"]
        context = text(128, 25000)
        A.one(context, 2)
        wait_in_store(A_NAME, context)
        master = Suite.cluster.master
        os.kill(master.pid, signal.SIGSTOP)
        try:
            got = Suite.engines["B"].one(context + text(20, 25128), GEN, logprobs=5)
        finally:
            os.kill(master.pid, signal.SIGCONT)
        o = outcome(got)
        self.assertEqual((o.get("outcome"), o.get("reason")),
                         ("fallback_reprefill", "cluster_store_timeout"), o)
        self.assert_like_plain(Suite.engines["B"], got, context + text(20, 25128))

    # -- 6 ----------------------------------------------------------------------------------

    def test_6_a_prefix_longer_than_the_fetch_region_is_fetched_in_part_once(self):
        A, B = Suite.engines["A"], Suite.engines["B"]
        context = text(512, 28000)
        prompt = context + text(40, 28512)
        B.one(context, 2)
        wait_in_store(B_NAME, context)
        got = A.one(prompt, GEN, logprobs=5, cache_salt="region-1")
        o = outcome(got)
        self.assertEqual((o.get("outcome"), o.get("tier")), ("applied", "cluster"), o)
        self.assertEqual(o["cluster"]["fetched_tokens"], 320, o)  # the objects that fit 1 MiB
        self.assertEqual(o["tokens_reused"], 320, o)
        self.assert_like_plain(A, got, prompt)
        # kvtd A holds those 320 tokens now; the store's longer prefix does not fit the region
        # either: no second fetch of the same objects, the local tier serves.
        fetches = len(A.log_lines("kvt: cluster: fetching"))
        got = A.one(prompt, GEN, logprobs=5, cache_salt="region-2")
        o = outcome(got)
        self.assertEqual((o.get("outcome"), o.get("tier")), ("applied", "local"), o)
        self.assertEqual(o["cluster"]["result"], "miss", o)
        self.assertIn("fit cluster.fetch_region_bytes", o["cluster"]["detail"], o)
        self.assertEqual(len(A.log_lines("kvt: cluster: fetching")), fetches)
        self.assert_like_plain(A, got, prompt)

    def test_8_segment_holder_gone(self):
        A = Suite.engines["A"]
        context = text(128, 26000)
        A.one(context, 2)
        wait_in_store(A_NAME, context)
        Suite.cluster.holder.send_signal(signal.SIGKILL)
        Suite.cluster.holder.wait()
        prompt = context + text(20, 26128)
        self.fallback(prompt, "cluster_segment_unavailable")
        # The dead segment's objects stay listed until the master drops them: the same objects
        # are not fetched again for failed_key_ttl_s (another salt: not the engine's own hit).
        self.fallback(prompt, "cluster_recently_failed", cache_salt="again")

    def test_9_master_gone(self):
        Suite.cluster.master.send_signal(signal.SIGKILL)
        Suite.cluster.master.wait()
        o = self.fallback(text(128, 27000), "cluster_store_unavailable")
        self.assertEqual(o["cluster"]["result"], "error", o)


if __name__ == "__main__":
    unittest.main()
