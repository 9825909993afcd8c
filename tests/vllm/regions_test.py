"""kvt.vllm.regions against a real kvtd: the publish ring's first-in first-out allocation, and
the worker's publish region end to end: a cache published from the region
(PrefixCache.publish_region) comes back through TranslateKV of the identity mapper
(family.identity_mapper) as it went in; after a kvtd restart the region registers again; a
region that needs a protocol extension registers only with a kvtd that lists it; one whose kvtd
was down registers soon after it is back; a kvtd
that refuses client regions answers with an error naming header.input.region (what the
connector's inline fallback keys on)."""

import os
import tempfile
import time
import unittest

import numpy as np

import family
import kvt
from kvt.cache import DTYPE_NAMES
from kvt.errors import KvtError
from kvt.prefix import PrefixCache
from kvt.vllm.regions import PublishRing, WorkerRegion

import engines as E

LAYERS, HEADS, DIM = 6, 2, 32  # kvt-tiny-L, the identity mapper's shape


class PublishRingTest(unittest.TestCase):
    def test_first_in_first_out_with_wrap(self):
        ring = PublishRing(100)
        self.assertEqual(ring.allocate(40), 0)
        self.assertEqual(ring.allocate(40), 40)
        self.assertIsNone(ring.allocate(40))      # 20 left at the end: no range wraps
        ring.free(0)
        self.assertEqual(ring.allocate(30), 0)    # before the oldest live range
        self.assertIsNone(ring.allocate(20))      # wrapped: only 10 between head and oldest
        self.assertEqual(ring.allocate(10), 30)
        self.assertEqual(ring.live_bytes(), 80)
        ring.free(40)
        ring.free(0)
        ring.free(30)
        self.assertEqual(ring.live_bytes(), 0)
        self.assertEqual(ring.allocate(100), 0)
        self.assertIsNone(PublishRing(10).allocate(11))

    def test_frees_out_of_order_are_refused(self):
        ring = PublishRing(100)
        ring.allocate(10)
        ring.allocate(10)
        with self.assertRaises(RuntimeError):
            ring.free(10)


class PublishRegionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="kvt-regions-")
        cls.store = os.path.join(cls.work, "store")
        family.identity_mapper(cls.store, "Ltwin-to-L")
        cls.port = E.free_port()
        cls.kvtd = None

    def start(self, **options):
        config = family.kvtd_yaml(os.path.join(self.work, "kvtd.yaml"), **options)
        self.kvtd = family.start_kvtd(self.store, self.port, config, "regions-kvtd").__enter__()

    def stop(self):
        if self.kvtd is not None:
            self.kvtd.__exit__(None, None, None)
            self.kvtd = None

    def tearDown(self):
        self.stop()

    def publish_and_read_back(self, client, region_holder, tokens):
        rng = np.random.default_rng(len(tokens))
        cache = rng.standard_normal((LAYERS, 2, len(tokens), HEADS, DIM)).astype(np.float32)
        region = region_holder.get(cache.nbytes)
        self.assertIsNotNone(region)
        np.frombuffer(region.buf, dtype=np.float32, count=cache.size).reshape(
            cache.shape)[...] = cache
        prefix = PrefixCache(client)
        response = prefix.publish_region(family.TWIN_L, tokens, region.ref(0, cache.nbytes),
                                         num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                                         dtype="fp32", timeout=30)
        self.assertEqual(response.stored_tokens, len(tokens) // 16 * 16)
        hit = prefix.lookup(family.NAMES["L"], tokens, max_tokens=len(tokens) - 1,
                            policy="force")
        self.assertTrue(hit.hit, hit)
        got = client.translate_cached(hit.lease_id, hit.mapper_id, hit.matched_tokens,
                                      dtype=DTYPE_NAMES[hit.dtype], output_dtype="fp32")
        got = got.target.to_layout("NHD")
        n = hit.matched_tokens
        for layer in range(LAYERS):
            # Identity map: RoPE stripped and re-applied at the same positions (float32).
            np.testing.assert_allclose(np.asarray(got.k[layer])[:n], cache[layer, 0, :n],
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.asarray(got.v[layer])[:n], cache[layer, 1, :n],
                                       rtol=1e-4, atol=1e-4)

    def test_publish_from_the_region_reads_back_and_survives_a_restart(self):
        self.start()
        with kvt.Client(f"127.0.0.1:{self.port}", timeout=30, channel_options=[
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500)]) as client:
            holder = WorkerRegion(lambda: client, 4 << 20, "publishes", warn=True)
            try:
                self.assertIsNone(holder.ready(1))  # nothing made yet, and ready() never makes
                self.publish_and_read_back(client, holder, list(range(1, 130)))
                self.assertIsNotNone(holder.ready(1))
                # kvtd restarted: it forgot the registration; the channel's state change marks
                # the region for registering again, and the next get() does.
                self.stop()
                self.start()
                end = time.monotonic() + 10
                while holder.ready(1) is not None and time.monotonic() < end:
                    time.sleep(0.05)
                self.assertIsNone(holder.ready(1))
                import grpc
                grpc.channel_ready_future(client._channel).result(timeout=10)
                self.publish_and_read_back(client, holder, list(range(7, 200)))
            finally:
                holder.close()

    def test_a_kvtd_that_was_down_is_tried_again_soon(self):
        # Unreachable is not a refusal: once kvtd is up the region registers within seconds,
        # not after retry_s (the engine would otherwise copy every load for that long).
        with kvt.Client(f"127.0.0.1:{self.port}", timeout=5) as client:
            holder = WorkerRegion(lambda: client, 1 << 20, "publishes", warn=False, retry_s=600)
            try:
                self.assertIsNone(holder.get(1))  # no kvtd yet: UNAVAILABLE
                self.start()
                end = time.monotonic() + 30
                while holder.get(1) is None:
                    self.assertLess(time.monotonic(), end, "the region was not registered again")
                    time.sleep(0.1)
                self.assertIsNotNone(holder.ready(1))
            finally:
                holder.close()

    def test_a_region_needing_an_extension_registers_only_where_kvtd_lists_it(self):
        # The in-place load region needs "paged_engine_order": an older kvtd would ignore the
        # engine order and write the standard one into the engine's blocks. A name this kvtd
        # does not list stands in for such a kvtd (registering would otherwise succeed).
        self.start()
        with kvt.Client(f"127.0.0.1:{self.port}", timeout=30) as client:
            listed = WorkerRegion(lambda: client, 1 << 20, "in-place loads", warn=False,
                                  requires="paged_engine_order")
            missing = WorkerRegion(lambda: client, 1 << 20, "in-place loads", warn=False,
                                   requires="no_such_extension", retry_s=60)
            try:
                region = listed.get(1)
                self.assertIsNotNone(region)
                self.assertIsNotNone(listed.ready(1))
                self.assertIsNone(missing.get(1))
                self.assertIsNone(missing.ready(1))
                self.assertIsNone(missing.get(1))  # and not asked again within retry_s
                # Registered, asked, withdrawn: kvtd holds only the region it may use.
                self.assertEqual([r.name for r in client.system_memory_status()], [region.name])
            finally:
                listed.close()
                missing.close()

    def test_a_kvtd_refusing_client_regions_names_the_field(self):
        self.start()  # registration itself is allowed here; then a kvtd that refuses
        with kvt.Client(f"127.0.0.1:{self.port}", timeout=30) as client:
            holder = WorkerRegion(lambda: client, 1 << 20, "publishes", warn=False)
            try:
                region = holder.get(1)
                self.stop()
                self.start(allow_client_regions=False)
                with self.assertRaises(KvtError) as raised:
                    PrefixCache(client).publish_region(
                        family.TWIN_L, list(range(32)), region.ref(0, LAYERS * 2 * 32 * 256),
                        num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="fp32",
                        wait_for_ready=True, timeout=30)
                self.assertIn("header.input.region", str(raised.exception))
            finally:
                holder.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
