"""The cluster tier end to end with real kvtds: node A's kvtd and node B's kvtd share nothing but
a Mooncake Store (mooncake_master and a mooncake_client segment holder on loopback). Node A (this
process) publishes a source cache to its own kvtd and puts its blocks into the store; node B (a
child process, node_b.py) finds the prefix in the store, fetches it into a shared-memory region
registered with its kvtd, publishes it from the region (PrefixCache.publish_region), and runs
LookupPrefix and TranslateKV of the leased prefix there. Node B's translation must equal, bit for
bit, what node A's kvtd returns for the original cache.

The mapper is a real mapper directory that kvtd serves like a fitted one (the identity of
tests/vllm/identity_mappers.py: RoPE stripped and re-applied, W = I), so the check needs no fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

import kvt
from kvt.cache import DTYPE_NAMES
from kvt.cluster import ClusterStore, Geometry
from kvt.prefix import PrefixCache
from kvt_testing import identity_mappers
from kvt_testing.kvtd import Kvtd
from mooncake_cluster import MooncakeCluster

SOURCE, TARGET, MAPPER = "kvt-tiny-L-twin", "kvt-tiny-L", "Ltwin-to-L"
LAYERS, HEADS, DIM = 6, 2, 32
GEOMETRY = Geometry(SOURCE, LAYERS, HEADS, DIM, "fp32", block_tokens=16, chunk_blocks=4)


def kvtd_flags(work: str, store: str, name: str) -> list:
    config = os.path.join(work, f"{name}.yaml")
    with open(config, "w") as f:
        f.write("prefix_cache:\n  enabled: true\n  max_bytes: 67108864\n  ttl_seconds: 600\n"
                "  block_tokens: 16\n  lease_seconds: 30\n  min_mapper_quality: 0.0\n"
                "  min_benefit_recovered: 0.0\n"
                "  pair_min_quality: {}\nshared_memory:\n  allow_client_regions: true\n")
    return ["--listen_address=127.0.0.1:0", f"--mapper_store={store}", "--backend=cpu",
            "--cpu_threads=1", "--drain_grace_seconds=0", f"--config={config}"]


class ClusterEndToEndTest(unittest.TestCase):
    def test_prefix_published_on_node_a_translates_on_node_b_as_on_node_a(self):
        work = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        store_dir = os.path.join(work, "store")
        identity_mappers.write(os.path.join(store_dir, MAPPER), source_name=SOURCE,
                               target_name=TARGET, layers=LAYERS, heads=HEADS, dim=DIM,
                               source_theta=10000.0, target_theta=10000.0, zero_v=False,
                               created_by="tests/cluster/e2e_test.py")
        tokens = [int(t) for t in np.random.default_rng(7).integers(0, 256, 16 * 6 + 5)]
        cache = np.random.default_rng(8).standard_normal(
            (LAYERS, 2, len(tokens), HEADS, DIM)).astype(np.float32)

        with MooncakeCluster(64 << 20, "e2e") as cluster, \
                Kvtd(kvtd_flags(work, store_dir, "node-a"), "node-a-kvtd") as kvtd_a, \
                Kvtd(kvtd_flags(work, store_dir, "node-b"), "node-b-kvtd") as kvtd_b:
            # Node A: its engine's publish, to its kvtd and to the cluster tier.
            with kvt.Client(kvtd_a.address, timeout=30) as client:
                prefix = PrefixCache(client)
                prefix.publish(SOURCE, tokens, [(cache[j, 0], cache[j, 1]) for j in
                                                range(LAYERS)], dtype="fp32", layout="NHD")
                hit = prefix.lookup(TARGET, tokens, max_tokens=len(tokens) - 1)
                self.assertTrue(hit.hit, hit)
                reference = client.translate_cached(
                    hit.lease_id, hit.mapper_id, hit.matched_tokens,
                    dtype=DTYPE_NAMES[hit.dtype], output_dtype="fp32").target.to_layout("NHD")
            with ClusterStore(cluster.config()) as store:
                cluster.wait_ready(store)
                started = time.monotonic()
                self.assertEqual(store.put_prefix(GEOMETRY, tokens, cache), (2, 0))
                put_ms = (time.monotonic() - started) * 1e3

            # Node B: another process, its own kvtd.
            out = os.path.join(work, "node_b.npz")
            job = dict(mode="kvtd", kvtd=kvtd_b.address, target=TARGET, tokens=tokens, out=out,
                       geometry=dict(model=SOURCE, num_layers=LAYERS, num_kv_heads=HEADS,
                                     head_dim=DIM, dtype="fp32", block_tokens=16,
                                     chunk_blocks=4),
                       store=dict(master_server_address=cluster.master_address,
                                  metadata_server=cluster.metadata_server,
                                  global_segment_size=0))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            result = subprocess.run(
                [sys.executable, os.path.join(os.path.dirname(__file__), "node_b.py"),
                 json.dumps(job)], capture_output=True, text=True, timeout=60, env=env)
            self.assertEqual(result.returncode, 0, result.stderr[-5000:])
            report = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"put {put_ms:.1f} ms; node B: {report}", file=sys.stderr)
            self.assertEqual(report["blocks"], 6, report)
            self.assertEqual(report["stored_tokens"], 96, report)
            self.assertTrue(report["hit"], report)
            self.assertEqual(report["matched_tokens"], hit.matched_tokens, report)

        got = np.load(out)
        want_k = np.stack([np.asarray(k) for k in reference.k])
        want_v = np.stack([np.asarray(v) for v in reference.v])
        np.testing.assert_array_equal(got["k"], want_k)
        np.testing.assert_array_equal(got["v"], want_v)
        # And the translation is the identity's (not, say, zeros twice).
        n = hit.matched_tokens
        np.testing.assert_allclose(want_v, cache[:, 1, :n], rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    from kvt_testing import junit_main
    junit_main.main()
