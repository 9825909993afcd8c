"""The cluster tier's failure reasons that no engine run produces on its own, each produced for
real: the connector's ClusterLookup (scheduler side) and ClusterPut (worker side) driven the way
vLLM drives them, against a real Mooncake Store (mooncake_master and a mooncake_client segment
holder on loopback) and real kvtds; no mocks, no engine.

  cluster_publish_failed  request fallback: the fetch from the store worked, but kvtd did not
                          take the fetched prefix (its prefix_cache.max_bytes cannot hold it).
  cluster_store_error     request fallback: the store's objects cannot be fetched on this node
                          (one object is larger than cluster.fetch_region_bytes; kvtd refuses
                          the fetch region: shared_memory.allow_client_regions off).
  store_full              publish side only (a put is the only call that allocates store
                          space): counted as cluster_put_failed and cluster_error_store_full
                          when no segment has room for an object; never a request's reason.

Each request case checks the outcome (fallback_reprefill, the reason exactly as docs/VLLM.md
names it) and the counters, and a control run of the same request against a kvtd and options
without the fault applies the fetched prefix."""

from __future__ import annotations

import os
import tempfile
import time
import unittest

import numpy as np
import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

import family
from kvt.cluster import ClusterStore, Geometry
from kvt.vllm.cluster_tier import ClusterLookup, ClusterPut
from kvt.vllm.connector import KvtdLink
from kvt.vllm.engine_kv import EngineKv
from kvt.vllm.metadata import KvtWorkerMetadata, LoadResult
from kvt.vllm.options import ConnectorConfig
from kvt.vllm.scheduler_side import KvtScheduler
from kvt.vllm.stats import KvtConnectorStats
from mooncake_cluster import MooncakeCluster, free_port

BLOCK = 16
LAYERS, HEADS, DIM = 6, 2, 32  # kvt-tiny-L, the identity mapper's shape
TARGET = family.NAMES["L"]
SOURCE = family.TWIN_L
PROMPT = [int(t) for t in np.random.default_rng(11).integers(1, 250, size=4 * BLOCK + 5)]
LOADABLE = (len(PROMPT) - 1) // BLOCK * BLOCK
# One object of the source's prefix: header + 4 blocks of 6 layers' K and V (fp32).
OBJECT_BYTES = 64 + 2 * LAYERS * 4 * BLOCK * HEADS * DIM * 4

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def new_request(req_id):
    return Request(req_id, list(PROMPT), SamplingParams(max_tokens=8), None,
                   block_hasher=HASHER)


class ClusterReasonsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="kvt-cluster-reasons-",
                                    dir=os.environ.get("TEST_TMPDIR"))
        cls.mappers = os.path.join(cls.work, "store")
        family.identity_mapper(cls.mappers, "Ltwin-to-L")
        cls.cluster = MooncakeCluster(64 << 20, "cluster-reasons").__enter__()
        cls.kvtds = {}
        cls.links = []
        cls.schedulers = []
        cls.lookups = []
        # Node A's publish: the source model's cache of the prompt, in the store.
        cls.source = ClusterStore(cls.cluster.config())
        cls.cluster.wait_ready(cls.source)
        cache = np.random.default_rng(12).standard_normal(
            (LAYERS, 2, len(PROMPT), HEADS, DIM)).astype(np.float32)
        geometry = Geometry(SOURCE, LAYERS, HEADS, DIM, "fp32", BLOCK, 4)
        assert cls.source.put_prefix(geometry, PROMPT, cache) == (1, 0)

    @classmethod
    def tearDownClass(cls):
        for scheduler in cls.schedulers:
            scheduler.shutdown()
        for lookup in cls.lookups:
            store = lookup.handle.get()
            lookup._drop_region(store)  # the fetch region: unregistered, its memory freed
            store.close(timeout=2.0)
        for link in cls.links:
            link.close()
        for kvtd in cls.kvtds.values():
            kvtd.__exit__(None, None, None)
        cls.source.close()
        cls.cluster.__exit__()

    def kvtd(self, name, **yaml):
        """A kvtd serving the identity mapper Ltwin-to-L, holding nothing: its lookups miss
        with no_prefix, so the store is asked."""
        if name not in self.kvtds:
            config = family.kvtd_yaml(os.path.join(self.work, f"{name}.yaml"), **yaml)
            self.kvtds[name] = family.start_kvtd(self.mappers, free_port(), config,
                                                 f"reasons-{name}").__enter__()
        return self.kvtds[name]

    def connector_config(self, kvtd, **cluster):
        return ConnectorConfig.from_extra({
            "kvtd_address": kvtd.address, "model_name": TARGET, "block_tokens": BLOCK,
            "lookup_wait_s": 0.0, "lookup_timeout_s": 10.0,
            "cluster": {"master_server_address": self.cluster.master_address,
                        "metadata_server": self.cluster.metadata_server,
                        "local_hostname": "127.0.0.1", "lookup_timeout_s": 2.0,
                        "fetch_timeout_s": 5.0, **cluster}})

    def scheduler(self, kvtd, **cluster):
        """KvtScheduler with the ClusterLookup the connector makes for a cluster section (as
        KvtConnector does), its store client set up."""
        config = self.connector_config(kvtd, **cluster)
        self.stats = KvtConnectorStats()
        link = KvtdLink(config.kvtd_address)
        self.links.append(link)
        lookup = ClusterLookup(config.cluster, config.model_name, "fp32", BLOCK, link,
                               self.stats.add)
        self.lookups.append(lookup)
        self.assertIsNotNone(lookup.handle.wait_ready(20.0), lookup.handle.state)
        scheduler = KvtScheduler(config, BLOCK, link, self.stats.add, lookup)
        self.schedulers.append(scheduler)
        return scheduler

    def outcome(self, scheduler, req_id):
        """The request's outcome after vLLM's calls: get_num_new_matched_tokens again each
        step while the lookup is in flight; for a decided load, the allocation, the step's
        metadata and the worker's report that the load worked; then request_finished."""
        request = new_request(req_id)
        scheduler.on_new_request(request)
        end = time.monotonic() + 30
        while True:
            tokens, load_async = scheduler.get_num_new_matched_tokens(request, 0)
            if tokens is not None:
                break
            self.assertLess(time.monotonic(), end, "the lookup never finished")
            time.sleep(0.01)
        if load_async:
            scheduler.update_state_after_alloc(request, KVCacheBlocks(blocks=(
                [KVCacheBlock(block_id=100 + i) for i in range(tokens // BLOCK + 1)],)), tokens)
            meta = scheduler.build_connector_meta(SchedulerOutput.make_empty(), lambda _: [])
            self.assertEqual([load.req_id for load in meta.loads], [req_id])
            scheduler.update_connector_output(
                KvtWorkerMetadata(loads={req_id: LoadResult(ok=True)}))
        _, params = scheduler.request_finished(request, [])
        return tokens, load_async, params["kvt"]

    def counters(self):
        unknown = set(self.stats.data) - set(KvtConnectorStats().reduce())
        self.assertFalse(unknown, f"counted under names vLLM never reports: {unknown}")
        return {k: v for k, v in self.stats.data.items() if v}

    def assert_fallback(self, outcome, reason, result, detail):
        self.assertEqual(outcome["outcome"], "fallback_reprefill", outcome)
        self.assertEqual(outcome["reason"], reason, outcome)
        self.assertIn(detail, outcome["detail"], outcome)
        self.assertEqual(outcome["cluster"]["result"], result, outcome)
        self.assertEqual(outcome["cluster"]["local_reason"], "no_prefix", outcome)

    def test_control_the_fetched_prefix_applies(self):
        s = self.scheduler(self.kvtd("plain"))
        tokens, load_async, o = self.outcome(s, "control")
        self.assertEqual((tokens, load_async), (LOADABLE, True), o)
        self.assertEqual((o["outcome"], o["tier"]), ("applied", "cluster"), o)
        self.assertEqual(o["cluster"]["result"], "fetched", o)
        self.assertEqual(o["cluster"]["fetched_tokens"], 4 * BLOCK, o)
        counts = self.counters()
        self.assertEqual({k: counts.get(k) for k in ("cluster_lookups", "cluster_hits",
                                                      "cluster_fetches", "hits")},
                         {"cluster_lookups": 1, "cluster_hits": 1, "cluster_fetches": 1,
                          "hits": 1}, counts)

    def test_publish_failed_when_kvtd_cannot_hold_the_fetched_prefix(self):
        # The store holds a prefix longer than this node's kvtd tier can ever hold (another
        # node's kvtd has a larger prefix_cache.max_bytes): the fetch works, kvtd's Publish from
        # the region answers RESOURCE_EXHAUSTED.
        s = self.scheduler(self.kvtd("small-tier", max_bytes=64 << 10))
        tokens, load_async, o = self.outcome(s, "publish-failed")
        self.assertEqual((tokens, load_async), (0, False))
        self.assert_fallback(o, "cluster_publish_failed", "error", "max_bytes")
        self.assertEqual(o["cluster"]["reason"], "publish_failed", o)
        self.assertEqual(o["cluster"]["source_model"], SOURCE, o)
        counts = self.counters()
        counts.pop("cluster_fetch_us", None)
        # Fetched, then refused: no store error is counted (the store did its part).
        self.assertEqual(counts, {"requests": 1, "lookups": 1, "cluster_lookups": 1,
                                  "cluster_hits": 1, "cluster_fetches": 1,
                                  "cluster_fetch_bytes": OBJECT_BYTES - 64,
                                  "fallback_reprefill": 1}, counts)

    def test_store_error_when_one_object_exceeds_fetch_region_bytes(self):
        s = self.scheduler(self.kvtd("plain-2"), fetch_region_bytes=OBJECT_BYTES // 2)
        tokens, load_async, o = self.outcome(s, "region-too-small")
        self.assertEqual((tokens, load_async), (0, False))
        self.assert_fallback(o, "cluster_store_error", "error",
                             "exceeds cluster.fetch_region_bytes")
        self.assertEqual(self.counters(), {"requests": 1, "lookups": 1, "cluster_lookups": 1,
                                           "cluster_error_store_error": 1,
                                           "fallback_reprefill": 1})

    def test_store_error_when_kvtd_refuses_the_fetch_region(self):
        s = self.scheduler(self.kvtd("no-regions", allow_client_regions=False))
        tokens, load_async, o = self.outcome(s, "region-refused")
        self.assertEqual((tokens, load_async), (0, False))
        self.assert_fallback(o, "cluster_store_error", "error", "allow_client_regions")
        self.assertEqual(self.counters(), {"requests": 1, "lookups": 1, "cluster_lookups": 1,
                                           "cluster_hits": 1, "cluster_error_store_error": 1,
                                           "fallback_reprefill": 1})


class ClusterPutStoreFullTest(unittest.TestCase):
    """store_full on the publish side: ClusterPut (the worker's publisher thread) puts a
    published prefix from a real EngineKv (vLLM's paged layout on CPU) into a store whose only
    segment (16 MiB, Mooncake's smallest) is smaller than one object."""

    LAYERS, HEADS, DIM, CHUNK = 8, 8, 128, 16  # one object of 16 blocks: 16 MiB + its header

    def test_store_full_is_counted_on_the_put_side(self):
        with MooncakeCluster(16 << 20, "cluster-full") as cluster:
            config = ConnectorConfig.from_extra({
                "kvtd_address": "127.0.0.1:1", "model_name": "kvt-wide", "block_tokens": BLOCK,
                "cluster": {"master_server_address": cluster.master_address,
                            "metadata_server": cluster.metadata_server,
                            "local_hostname": "127.0.0.1", "chunk_blocks": self.CHUNK}})
            stats = KvtConnectorStats()
            put = ClusterPut(config.cluster, config.model_name, stats.add)
            store = put.handle.wait_ready(20.0)
            self.assertIsNotNone(store, put.handle.state)
            cluster.wait_ready(store)
            blocks = self.CHUNK + 1
            caches = {f"model.layers.{i}.self_attn.attn": torch.randn(
                2, blocks, BLOCK, self.HEADS, self.DIM) for i in range(self.LAYERS)}
            kv = EngineKv(caches, self.HEADS, self.DIM, "fp32")
            block_ids = list(range(blocks))
            # A prefix shorter than a chunk is one smaller object (4 MiB): it fits.
            put.put(kv, block_ids[:4], list(range(4 * BLOCK)), BLOCK)
            self.assertEqual({k: v for k, v in stats.data.items() if v},
                             {"cluster_puts": 1, "cluster_put_objects": 1})
            # A whole chunk: an object larger than any segment. Counted, logged, not raised.
            with self.assertLogs("vllm.kvt", "WARNING") as logs:
                put.put(kv, block_ids[:self.CHUNK], list(range(self.CHUNK * BLOCK)), BLOCK)
            self.assertIn("store_full", "\n".join(logs.output))
            self.assertEqual({k: v for k, v in stats.data.items() if v},
                             {"cluster_puts": 1, "cluster_put_objects": 1,
                              "cluster_put_failed": 1, "cluster_error_store_full": 1})
            store.close()


if __name__ == "__main__":
    from kvt_testing import junit_main
    junit_main.main()
