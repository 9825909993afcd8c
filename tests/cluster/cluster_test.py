"""kvt.cluster against a real Mooncake Store (mooncake_master and a mooncake_client segment
holder on loopback, tests/cluster/mooncake_cluster.py); no mocks. Node A is this process (a pure
client: no segment of its own); node B is a child process (node_b.py) that shares no memory with
it. Checked: put -> longest_prefix -> fetch returns the bytes exactly on node B; a chunk of a
longer publisher's prefix is matched at chunk granularity; a key of another scheme version is not
read, and an object under a kvt key that is not what the key promises is refused
(version_mismatch); a removed object gives evicted; a store status of no other reason gives
store_error; the segment holder killed gives segment_unavailable; the master down gives
store_unavailable, and a master that does not answer (SIGSTOP) gives store_timeout, each within
the call's deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

from kvt.cluster import (HEADER_BYTES, ClusterError, ClusterStore, Geometry, chain_hashes,
                         object_ends)
from kvt.prefix import first_block_hash
from mooncake_cluster import MooncakeCluster

GEOMETRY = Geometry("org/kvt-tiny-M", num_layers=3, num_kv_heads=2, head_dim=8, dtype="fp32",
                    block_tokens=16, chunk_blocks=4)


def packed_cache(tokens: int, seed: int) -> np.ndarray:
    """A cache in the packed region format: (layers, K/V, tokens, heads, head_dim)."""
    g = GEOMETRY
    return np.random.default_rng(seed).standard_normal(
        (g.num_layers, 2, tokens, g.num_kv_heads, g.head_dim)).astype(np.float32)


def run_node_b(job: dict, timeout: float = 45.0) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "node_b.py"),
                          json.dumps(job)], capture_output=True, text=True, timeout=timeout,
                         env=env)
    if out.returncode != 0:
        raise AssertionError(f"node B failed ({out.returncode}):\n{out.stderr[-5000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class ClusterStoreTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cluster = MooncakeCluster(64 << 20, "cluster-test").__enter__()
        cls.store = ClusterStore(cls.cluster.config())
        cls.cluster.wait_ready(cls.store)
        cls.work = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))

    @classmethod
    def tearDownClass(cls):
        cls.store.close()
        cls.cluster.__exit__()

    def store_config(self) -> dict:
        c = self.cluster.config()
        return dict(master_server_address=c.master_server_address,
                    metadata_server=c.metadata_server, global_segment_size=0)

    def geometry_json(self) -> dict:
        g = GEOMETRY
        return dict(model=g.model, num_layers=g.num_layers, num_kv_heads=g.num_kv_heads,
                    head_dim=g.head_dim, dtype=g.dtype, block_tokens=g.block_tokens,
                    chunk_blocks=g.chunk_blocks)

    def test_round_trip_to_another_process(self):
        tokens = [int(t) for t in np.random.default_rng(1).integers(0, 50000, 16 * 7 + 5)]
        cache = packed_cache(len(tokens), 1)
        written, held = self.store.put_prefix(GEOMETRY, tokens, cache)
        self.assertEqual((written, held), (2, 0))  # blocks [0, 4) and [4, 7)
        self.assertEqual(self.store.put_prefix(GEOMETRY, tokens, cache), (0, 2))
        out = os.path.join(self.work, "round_trip.bin")
        report = run_node_b(dict(mode="fetch", geometry=self.geometry_json(), tokens=tokens,
                                 store=self.store_config(), out=out))
        self.assertEqual(report["blocks"], 7, report)
        self.assertNotIn("reason", report)
        with open(out, "rb") as f:
            got = np.frombuffer(f.read(), np.float32).reshape(
                GEOMETRY.num_layers, 2, 7 * 16, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
        np.testing.assert_array_equal(got, cache[:, :, :7 * 16])

        # Another prompt sharing 6 blocks, then diverging: the chunk [0, 4) is held, the object
        # [4, 7) ends past the shared part, so 4 blocks (chunk granularity) are found.
        other = tokens[:16 * 6] + [50001] * 40
        match = self.store.longest_prefix([GEOMETRY], other)[GEOMETRY.model]
        self.assertEqual((match.blocks, [o[1:] for o in match.objects]), (4, [(0, 4)]))
        # Another model's cache of the same tokens is not there.
        twin = Geometry("kvt-tiny-L", 3, 2, 8)
        self.assertEqual(self.store.longest_prefix([twin], tokens)["kvt-tiny-L"].blocks, 0)
        # max_tokens bounds the match.
        match = self.store.longest_prefix([GEOMETRY], tokens, max_tokens=16 * 5 + 3)
        self.assertEqual(match[GEOMETRY.model].blocks, 4)

    def test_another_scheme_version_is_not_read(self):
        tokens = list(range(100, 100 + 16 * 4))
        cache = packed_cache(len(tokens), 2)
        hashes = chain_hashes(GEOMETRY.model, tokens, 16)
        # The same object under a v2 key: invisible to this scheme.
        payload = GEOMETRY.header(0, 4, hashes[3]) + cache.tobytes()
        self.store.put_raw(GEOMETRY.key(4, hashes[3], version="v2"), payload)
        match = self.store.longest_prefix([GEOMETRY], tokens)[GEOMETRY.model]
        self.assertEqual(match.blocks, 0)

        buffer = np.zeros(GEOMETRY.packed_bytes(64), np.uint8)
        address, _ = self.store.register(buffer)
        try:
            # Under the v1 key, an object whose header names another version...
            forged = bytearray(payload)
            forged[4:6] = (2).to_bytes(2, "little")
            key = GEOMETRY.key(4, hashes[3])
            self.store.put_raw(key, bytes(forged))
            match = self.store.longest_prefix([GEOMETRY], tokens)[GEOMETRY.model]
            self.assertEqual(match.blocks, 4)
            with self.assertRaises(ClusterError) as error:
                self.store.fetch(match, buffer)
            self.assertEqual(error.exception.reason, "version_mismatch", error.exception)
            # ... or whose size is not the key's geometry.
            self.store.remove([key])
            self.store.put_raw(key, payload[:HEADER_BYTES] + cache.tobytes()[:-64])
            with self.assertRaises(ClusterError) as error:
                self.store.fetch(match, buffer)
            self.assertEqual(error.exception.reason, "version_mismatch", error.exception)
        finally:
            self.store.unregister(address)

    def test_removed_object_gives_evicted(self):
        tokens = list(range(7, 7 + 16 * 9))
        self.store.put_prefix(GEOMETRY, tokens, packed_cache(len(tokens), 3))
        match = self.store.longest_prefix([GEOMETRY], tokens)[GEOMETRY.model]
        self.assertEqual([o[1:] for o in match.objects], [(0, 4), (4, 8), (8, 9)])
        self.assertEqual(self.store.remove([match.objects[1][0]]), [0])
        buffer = np.zeros(match.nbytes, np.uint8)
        address, _ = self.store.register(buffer)
        try:
            with self.assertRaises(ClusterError) as error:
                self.store.fetch(match, buffer)
            self.assertEqual(error.exception.reason, "evicted", error.exception)
        finally:
            self.store.unregister(address)
        # Nothing past the hole is offered any more.
        self.assertEqual(self.store.longest_prefix([GEOMETRY], tokens)[GEOMETRY.model].blocks, 4)

    def test_many_objects_in_one_call(self):
        # 64 objects of 33 slices each: one batched call of 2112 slices hangs in Mooncake
        # 0.3.13.post1; kvt.cluster cuts it into calls of at most MAX_SLICES_PER_CALL.
        g = Geometry("many-slices", num_layers=16, num_kv_heads=1, head_dim=8, chunk_blocks=1)
        tokens = list(range(16 * 64))
        cache = np.random.default_rng(5).standard_normal((16, 2, len(tokens), 1, 8)).astype(
            np.float32)
        self.assertEqual(self.store.put_prefix(g, tokens, cache, timeout=20), (64, 0))
        match = self.store.longest_prefix([g], tokens)[g.model]
        self.assertEqual(len(match.objects), 64)
        buffer = np.zeros(match.nbytes // 4, np.float32)
        address, _ = self.store.register(buffer)
        try:
            self.store.fetch(match, buffer, timeout=20)
        finally:
            self.store.unregister(address)
        np.testing.assert_array_equal(buffer.reshape(cache.shape), cache)

    def test_a_status_of_no_other_reason_gives_store_error(self):
        # The store client refuses a put of more bytes than its local buffer (put copies
        # through it) with INVALID_PARAMS: neither space, nor reachability, nor a gone object.
        size = self.store.config.local_buffer_size + (1 << 20)
        with self.assertRaises(ClusterError) as error:
            self.store.put_raw(f"kvt-test/too-large/{os.getpid()}", bytes(size))
        self.assertEqual((error.exception.reason, error.exception.code), ("store_error", -600),
                         error.exception)
        self.assertIn("-600", error.exception.detail)

    def test_chain_hashes_are_kvtds(self):
        # prefix_cache/chain_hash_test.cc's known answers.
        self.assertEqual([h.hex() for h in chain_hashes("m", [1, 2], 1)],
                         ["72b34a06e735cdd67aef4784ea29ab5b", "42ca87956b71a8350fc3e076673d2586"])
        self.assertEqual(chain_hashes("m", list(range(40)), 16)[0].hex(),
                         first_block_hash("m", list(range(40)), 16))
        self.assertEqual(len(chain_hashes("m", list(range(40)), 16)), 2)  # whole blocks only

    def test_object_ends(self):
        self.assertEqual(object_ends(9, 4), [4, 8, 9])
        self.assertEqual(object_ends(8, 4), [4, 8])
        self.assertEqual(object_ends(0, 4), [])
        # The key names everything that makes the bytes incompatible.
        key = GEOMETRY.key(9, bytes(range(16)))
        self.assertEqual(key, "kvt/v1/org%2Fkvt-tiny-M/fp32/bt16.c4/l3.h2.d8/nhd/8-9/"
                              "000102030405060708090a0b0c0d0e0f")


class StoreFailureTest(unittest.TestCase):
    """Each case gets a cluster of its own: it breaks the master."""

    def setUp(self):
        self.cluster = MooncakeCluster(32 << 20, "cluster-failure").__enter__()
        self.store = ClusterStore(self.cluster.config())
        self.cluster.wait_ready(self.store)
        self.tokens = list(range(1, 1 + 16 * 5))
        self.store.put_prefix(GEOMETRY, self.tokens, packed_cache(len(self.tokens), 4))
        self.match = self.store.longest_prefix([GEOMETRY], self.tokens)[GEOMETRY.model]
        self.assertEqual(self.match.blocks, 5)
        self.buffer = np.zeros(self.match.nbytes, np.uint8)
        self.store.register(self.buffer)

    def tearDown(self):
        self.store.close(timeout=2)
        self.cluster.__exit__()

    def assert_fails(self, reason, call, deadline):
        started = time.monotonic()
        with self.assertRaises(ClusterError) as error:
            call()
        elapsed = time.monotonic() - started
        self.assertEqual(error.exception.reason, reason, error.exception)
        self.assertLess(elapsed, deadline + 0.5, f"{error.exception} after {elapsed:.3f} s")
        return error.exception

    def test_master_down_gives_store_unavailable(self):
        from mooncake_cluster import stop
        stop(self.cluster.master)
        self.assert_fails("store_unavailable",
                          lambda: self.store.longest_prefix([GEOMETRY], self.tokens, timeout=1.0),
                          1.0)
        self.assert_fails("store_unavailable",
                          lambda: self.store.fetch(self.match, self.buffer, timeout=1.0), 1.0)
        # A node whose store client cannot reach a master at all.
        self.assert_fails("store_unavailable",
                          lambda: ClusterStore(self.cluster.config(), timeout=5.0), 5.0)

    def test_segment_holder_gone_gives_segment_unavailable(self):
        # The node that holds the objects dies between lookup and fetch; the master still
        # answers, so lookups keep working (the store is not marked down).
        self.cluster.holder.send_signal(signal.SIGKILL)
        self.cluster.holder.wait()
        self.assert_fails("segment_unavailable",
                          lambda: self.store.fetch(self.match, self.buffer, timeout=3.0), 3.0)
        self.store.longest_prefix([GEOMETRY], self.tokens, timeout=1.0)

    def test_master_not_answering_gives_store_timeout(self):
        os.kill(self.cluster.master.pid, signal.SIGSTOP)
        try:
            # Tokens this client never put or asked about: the answer must come from the
            # master (seen once in four loaded runs: the keys it had just put were answered
            # without it).
            unseen = [t + 1000 for t in self.tokens]
            self.assert_fails(
                "store_timeout",
                lambda: self.store.longest_prefix([GEOMETRY], unseen, timeout=0.3), 0.3)
            error = self.assert_fails(
                "store_timeout", lambda: self.store.fetch(self.match, self.buffer, timeout=0.3),
                0.3)
            # The read may still land in the buffer: the caller waits for it before reuse.
            self.assertIsNotNone(error.pending)
        finally:
            os.kill(self.cluster.master.pid, signal.SIGCONT)
        # The master answers again: the store recovers (the overdue calls finish meanwhile).
        end = time.monotonic() + 20
        while True:
            try:
                match = self.store.longest_prefix([GEOMETRY], self.tokens, timeout=2.0)
                self.assertEqual(match[GEOMETRY.model].blocks, 5)
                break
            except ClusterError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)


if __name__ == "__main__":
    from kvt_testing import junit_main
    junit_main.main()
