"""The outcomes of docs/VLLM.md that vLLM's scheduling produces, not a request's parameters:
KvtScheduler (the connector's scheduler side) driven through the calls vLLM 0.32's scheduler
makes (vllm/v1/core/sched/scheduler.py: on_new_request when a request arrives;
get_num_new_matched_tokens with the engine's block-aligned local prefix-cache hit, asked again
in a later step while it answers None or when allocate_slots fails; update_state_after_alloc
once its blocks are allocated; build_connector_meta each step; update_connector_output with the
workers' answers; request_finished when it ends or is aborted), on vLLM's own Request objects
(block hashes from vLLM's hasher), against a real kvtd that holds a prefix to lease (published
under kvt-tiny-L-twin, leased through the identity mapper kvt-tiny-L-twin -> kvt-tiny-L, real
mapper files). The test plays the worker: it runs TranslateKV of the lease itself and answers
with the LoadResult the worker would.

  * rescheduled: the allocation of a decided load failed and, when asked again, the engine's
    own prefix-cache hit had changed: the lease is dropped, the cache salt and block hashes
    are the request's own again, nothing is loaded;
  * not_loaded: the request ended after its load was handed to the workers but before their
    result came back (and nothing of it is published: the load may still be writing), or
    before its blocks were allocated at all;
  * not_scheduled: the request ended while its lookup was still in flight (kvtd stopped);
  * translate_failed: the TranslateKV of the lease failed (kvtd restarted between lookup and
    load: the lease is gone); the salt is dropped, vLLM recomputes;
  * lookup_failed: kvtd not listening (UNAVAILABLE in the detail);
  * live_quality: kvtd's live verification took the mapper out of service (a kvtd sampling
    every lookup, window 1; the engine's own publish of the sampled prompt far from what the
    mapper makes of the source's cache), and the connector passes kvtd's reason on;
  * applied: the same sequence with a load that succeeded (the sequence itself is right).

Counters go through the real KvtConnectorStats (an unknown name would show up in its data)."""

import hashlib
import os
import signal
import tempfile
import time
import unittest

import numpy as np

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

import family
import kvt
from kvt.cache import DTYPE_NAMES
from kvt.prefix import PrefixCache
from kvt.vllm.connector import KvtdLink
from kvt.vllm.metadata import KvtConnectorMetadata, KvtWorkerMetadata, LoadResult
from kvt.vllm.options import ConnectorConfig
from kvt.vllm.regions import describe_error
from kvt.vllm.scheduler_side import KvtScheduler
from kvt.vllm.stats import KvtConnectorStats

import engines as E

BLOCK = 16                              # vLLM's block size here and kvtd's block_tokens
LAYERS, HEADS, DIM = 6, 2, 32           # kvt-tiny-L, the identity mapper's shape
PROMPT = [int(t) for t in np.random.default_rng(7).integers(1, 250, size=4 * BLOCK + 5)]
LOADABLE = (len(PROMPT) - 1) // BLOCK * BLOCK   # whole blocks before the token vLLM computes

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def new_request(req_id, salt=None, kvt_params=None, prompt=PROMPT):
    extra = {"kv_transfer_params": {"kvt": kvt_params}} if kvt_params is not None else None
    return Request(req_id, list(prompt), SamplingParams(max_tokens=8, extra_args=extra), None,
                   cache_salt=salt, block_hasher=HASHER)


def blocks(n):
    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=100 + i) for i in range(n)],))


def empty_step():
    """A step that schedules no tokens (a request waiting for its load is not scheduled)."""
    return SchedulerOutput.make_empty()


class SchedulerOutcomesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.work = tempfile.mkdtemp(prefix="kvt-sched-outcomes-")
        cls.store = os.path.join(cls.work, "store")
        family.identity_mapper(cls.store, "Ltwin-to-L")
        cls.config_path = family.kvtd_yaml(os.path.join(cls.work, "kvtd.yaml"))
        cls.kvtd = None
        cls.start_kvtd()

    @classmethod
    def start_kvtd(cls):
        cls.kvtd = family.start_kvtd(cls.store, E.free_port(), cls.config_path,
                                     "sched-outcomes-kvtd").__enter__()
        # The source member's cache of the prompt, so that kvt-tiny-L's lookups hit.
        rng = np.random.default_rng(1)
        cache = rng.standard_normal((LAYERS, 2, len(PROMPT), HEADS, DIM)).astype(np.float32)
        with kvt.Client(cls.kvtd.address, timeout=30) as client:
            stored = PrefixCache(client).publish(
                family.TWIN_L, PROMPT, [(cache[i, 0], cache[i, 1]) for i in range(LAYERS)],
                wait_for_ready=True)
        assert stored.stored_tokens == len(PROMPT) // BLOCK * BLOCK, stored

    @classmethod
    def stop_kvtd(cls):
        if cls.kvtd is not None:
            cls.kvtd.__exit__(None, None, None)
            cls.kvtd = None

    @classmethod
    def tearDownClass(cls):
        cls.stop_kvtd()

    def setUp(self):
        self.schedulers = []

    def tearDown(self):
        for scheduler, link in self.schedulers:
            scheduler.shutdown()
            link.close()

    def scheduler(self, address=None, **extra):
        config = ConnectorConfig.from_extra({
            "kvtd_address": address or self.kvtd.address, "model_name": family.NAMES["L"],
            "block_tokens": BLOCK, "lookup_wait_s": 0.0, "lookup_timeout_s": 10.0, **extra})
        self.stats = KvtConnectorStats()
        link = KvtdLink(config.kvtd_address)
        scheduler = KvtScheduler(config, BLOCK, link, self.stats.add)
        self.schedulers.append((scheduler, link))
        return scheduler

    def counters(self):
        unknown = set(self.stats.data) - set(KvtConnectorStats().reduce())
        self.assertFalse(unknown, f"counted under names vLLM never reports: {unknown}")
        return {k: v for k, v in self.stats.data.items() if v}

    def matched(self, scheduler, request, local_hit=0, timeout=20.0):
        """get_num_new_matched_tokens the way the scheduler asks it: again each step while it
        answers None (the lookup still in flight)."""
        end = time.monotonic() + timeout
        while True:
            tokens, load_async = scheduler.get_num_new_matched_tokens(request, local_hit)
            if tokens is not None:
                return tokens, load_async
            self.assertLess(time.monotonic(), end, "the lookup never finished")
            time.sleep(0.01)

    def decided_load(self, scheduler, request, local_hit=0):
        """A request that kvtd's lease was decided for: returns its hashes before the salt."""
        own_hashes = list(request.block_hashes)
        scheduler.on_new_request(request)
        tokens, load_async = self.matched(scheduler, request, local_hit)
        self.assertEqual((tokens, load_async), (LOADABLE - local_hit, True))
        self.assertNotEqual(request.block_hashes, own_hashes)  # salted: no exact-prefix hits
        self.assertTrue(request.cache_salt.endswith("kvt-translated:Ltwin-to-L"))
        return own_hashes

    def alloc_and_send(self, scheduler, request, local_hit=0):
        """allocate_slots succeeded: update_state_after_alloc, then the step's metadata."""
        ext = LOADABLE - local_hit
        scheduler.update_state_after_alloc(request, blocks(LOADABLE // BLOCK + 1), ext)
        meta = scheduler.build_connector_meta(empty_step(), lambda req_id: [])
        self.assertIsInstance(meta, KvtConnectorMetadata)
        self.assertEqual([load.req_id for load in meta.loads], [request.request_id])
        return meta.loads[0]

    def finish(self, scheduler, request, block_ids=()):
        hold, params = scheduler.request_finished(request, list(block_ids))
        return hold, params["kvt"]

    # -- the sequence with a load that worked ------------------------------------------------

    def test_applied(self):
        s = self.scheduler()
        request = new_request("applied")
        self.decided_load(s, request)
        load = self.alloc_and_send(s, request)
        self.assertEqual((load.start, load.end, load.matched_tokens), (0, LOADABLE, LOADABLE))
        with kvt.Client(self.kvtd.address, timeout=30) as client:
            got = client.translate_cached(load.lease_id, load.mapper_id, load.matched_tokens,
                                          dtype=load.dtype, output_dtype="fp32")
        self.assertEqual(got.target.num_tokens, LOADABLE)
        s.update_connector_output(KvtWorkerMetadata(loads={"applied": LoadResult(ok=True)}))
        _, o = self.finish(s, request)
        self.assertEqual(o["outcome"], "applied", o)
        self.assertEqual(o["tokens_reused"], LOADABLE)
        self.assertEqual(self.counters(), {"requests": 1, "lookups": 1, "hits": 1, "applied": 1,
                                           "tokens_reused": LOADABLE})

    # -- no_prefix from kvtd's prefix digest, without a lookup ---------------------------------

    def test_no_prefix_from_the_digest_sends_no_lookup(self):
        s = self.scheduler()
        end = time.monotonic() + 20
        while not s.digest.ready():  # resolved on a lookup thread when the scheduler starts
            self.assertLess(time.monotonic(), end, "the prefix digest was never resolved")
            time.sleep(0.01)
        # Resolved once, on the lookup thread the scheduler started it on: the channel's first
        # connectivity report must not have dropped that resolve and cost another.
        self.assertEqual(s.digest.resolves, 1)
        # The stored prompt's first block reads "maybe": its lookup goes to kvtd (test_applied).
        self.assertFalse(s.digest.certain_miss(PROMPT))
        fresh = [t + 1 for t in PROMPT]  # no stored prefix starts like it
        request = new_request("digest-miss", prompt=fresh)
        s.on_new_request(request)
        self.assertEqual(s.get_num_new_matched_tokens(request, 0), (0, False))
        _, o = self.finish(s, request)
        self.assertEqual((o["outcome"], o["reason"]), ("fallback_reprefill", "no_prefix"), o)
        self.assertIn("prefix digest", o["detail"])
        self.assertEqual(self.counters(), {"requests": 1, "digest_misses": 1,
                                           "fallback_reprefill": 1})
        # Without the digest the same request costs a LookupPrefix, with kvtd's own answer.
        s = self.scheduler(lookup_digest=False)
        self.assertIsNone(s.digest)
        request = new_request("digest-off", prompt=fresh)
        s.on_new_request(request)
        self.assertEqual(self.matched(s, request), (0, False))
        _, o = self.finish(s, request)
        self.assertEqual((o["outcome"], o["reason"]), ("fallback_reprefill", "no_prefix"), o)
        self.assertEqual(self.counters(), {"requests": 1, "lookups": 1,
                                           "fallback_reprefill": 1})

    # -- rescheduled -------------------------------------------------------------------------

    def test_rescheduled_when_the_local_hit_changed_before_the_allocation(self):
        for salt in (None, "tenant-7"):
            with self.subTest(cache_salt=salt):
                s = self.scheduler()
                request = new_request(f"resched-{salt}", salt=salt)
                own_hashes = self.decided_load(s, request)
                # allocate_slots returned None: no update_state_after_alloc; the request stays
                # waiting. Asked again with the same local hit: the same decision, no second
                # lookup.
                self.assertEqual(s.get_num_new_matched_tokens(request, 0), (LOADABLE, True))
                # Meanwhile another request put the prompt's first block in the engine's prefix
                # cache: asked again with a local hit of one block.
                self.assertEqual(s.get_num_new_matched_tokens(request, BLOCK), (0, False))
                self.assertEqual(request.cache_salt, salt)  # the lease's salt is dropped
                self.assertEqual(request.block_hashes, own_hashes)
                s.update_state_after_alloc(request, blocks(LOADABLE // BLOCK + 1), 0)
                meta = s.build_connector_meta(empty_step(), lambda req_id: [])
                self.assertEqual(meta.loads, [])  # nothing is loaded from the dropped lease
                hold, o = self.finish(s, request)
                self.assertFalse(hold)
                self.assertEqual((o["outcome"], o["reason"]),
                                 ("fallback_reprefill", "rescheduled"), o)
                self.assertIn("prefix-cache hit changed", o["detail"])
                self.assertEqual(self.counters(), {"requests": 1, "lookups": 1, "hits": 1,
                                                   "fallback_reprefill": 1})

    # -- not_loaded --------------------------------------------------------------------------

    def test_not_loaded_when_aborted_while_its_load_is_in_flight(self):
        s = self.scheduler()
        request = new_request("aborted-loading")
        self.decided_load(s, request)
        self.alloc_and_send(s, request)
        # Aborted before the workers' answer: request_finished comes first.
        request.num_computed_tokens = LOADABLE  # vLLM counts the external tokens already
        hold, o = self.finish(s, request, [100 + i for i in range(LOADABLE // BLOCK + 1)])
        self.assertEqual((o["outcome"], o["reason"]), ("fallback_reprefill", "not_loaded"), o)
        # Its blocks may still be written by the load: no final publish of them, no hold.
        self.assertFalse(hold)
        meta = s.build_connector_meta(empty_step(), lambda req_id: [])
        self.assertEqual((meta.publishes, meta.releases), ([], []))
        # The late answer of the workers is ignored (the request is gone).
        s.update_connector_output(KvtWorkerMetadata(
            loads={"aborted-loading": LoadResult(ok=True)}))
        self.assertEqual(self.counters(), {"requests": 1, "lookups": 1, "hits": 1,
                                           "fallback_reprefill": 1})

    def test_not_loaded_when_aborted_before_its_blocks_were_allocated(self):
        s = self.scheduler()
        request = new_request("aborted-waiting")
        self.decided_load(s, request)
        # allocate_slots failed; the request is aborted while waiting.
        _, o = self.finish(s, request)
        self.assertEqual((o["outcome"], o["reason"]), ("fallback_reprefill", "not_loaded"), o)
        self.assertEqual(s.build_connector_meta(empty_step(), lambda req_id: []).loads, [])

    # -- not_scheduled -----------------------------------------------------------------------

    def test_not_scheduled_when_aborted_while_its_lookup_is_in_flight(self):
        s = self.scheduler()
        request = new_request("aborted-looking-up")
        s.on_new_request(request)
        # The channel is connected before kvtd stops answering (a channel is made lazily: one
        # still connecting when kvtd stops fails the lookup at once, UNAVAILABLE).
        s.kvt()[0].health(timeout=10)
        pid = self.kvtd._process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            for _ in range(3):  # three steps: the scheduler skips the request each time
                self.assertEqual(s.get_num_new_matched_tokens(request, 0), (None, False),
                                 s._reqs[request.request_id].outcome)
                time.sleep(0.05)
            hold, o = self.finish(s, request)
        finally:
            os.kill(pid, signal.SIGCONT)
        self.assertFalse(hold)
        self.assertEqual((o["outcome"], o["reason"]), ("fallback_reprefill", "not_scheduled"),
                         o)
        self.assertIsNone(request.cache_salt)
        self.assertEqual(self.counters(), {"requests": 1, "lookups": 1,
                                           "fallback_reprefill": 1})

    # -- translate_failed --------------------------------------------------------------------

    def test_translate_failed_when_the_lease_is_gone(self):
        s = self.scheduler()
        request = new_request("lease-gone", salt="tenant-3")
        own_hashes = self.decided_load(s, request)
        load = self.alloc_and_send(s, request)
        # kvtd restarted between the lookup and the worker's TranslateKV: the lease is gone.
        type(self).stop_kvtd()
        type(self).start_kvtd()
        with kvt.Client(self.kvtd.address, timeout=30) as client:
            with self.assertRaises(Exception) as raised:
                client.translate_cached(load.lease_id, load.mapper_id, load.matched_tokens,
                                        dtype=load.dtype, output_dtype="fp32")
        error = describe_error(raised.exception)
        s.update_connector_output(KvtWorkerMetadata(
            loads={"lease-gone": LoadResult(ok=False, error=error)}))
        # vLLM recomputes the request: its blocks are exact again.
        self.assertEqual(request.cache_salt, "tenant-3")
        self.assertEqual(request.block_hashes, own_hashes)
        _, o = self.finish(s, request)
        self.assertEqual((o["outcome"], o["reason"]),
                         ("fallback_reprefill", "translate_failed"), o)
        self.assertEqual(o["detail"], error)
        self.assertIn("lease", error)
        self.assertEqual(self.counters(), {"requests": 1, "lookups": 1, "hits": 1,
                                           "load_failures": 1, "fallback_reprefill": 1})

    # -- lookup_failed -----------------------------------------------------------------------

    def test_lookup_failed_when_kvtd_is_not_listening(self):
        s = self.scheduler(address=f"127.0.0.1:{E.free_port()}", lookup_timeout_s=5.0)
        request = new_request("no-kvtd")
        s.on_new_request(request)
        self.assertEqual(self.matched(s, request), (0, False))
        _, o = self.finish(s, request)
        self.assertEqual((o["outcome"], o["reason"]), ("fallback_reprefill", "lookup_failed"),
                         o)
        self.assertIn("UNAVAILABLE", o["detail"])
        self.assertEqual(self.counters(), {"requests": 1, "lookups": 1, "lookup_errors": 1,
                                           "fallback_reprefill": 1})


class LiveQualityTest(unittest.TestCase):
    """kvtd's live_quality miss through the scheduler side."""

    def setUp(self):
        self.work = tempfile.mkdtemp(prefix="kvt-sched-live-")
        store = os.path.join(self.work, "store")
        # The identity mapper with a recorded kv_cosine_heldout (live verification's floor),
        # and the reverse one, so that kvt-tiny-L's own publish is accepted.
        out = family.identity_mapper(store, "Ltwin-to-L")
        manifest = os.path.join(out, "manifest.yaml")
        with open(manifest) as f:
            text = f.read()
        assert "quality: {attention_cosine_heldout: 1.0}" in text, text
        with open(manifest, "w") as f:
            f.write(text.replace("quality: {attention_cosine_heldout: 1.0}",
                                 "quality: {attention_cosine_heldout: 1.0, "
                                 "kv_cosine_heldout: 0.99}"))
        sums = []
        for name in ("manifest.yaml", "weights.safetensors"):
            with open(os.path.join(out, name), "rb") as f:
                sums.append(f"{hashlib.sha256(f.read()).hexdigest()}  {name}")
        with open(os.path.join(out, "SHA256SUMS"), "w") as f:
            f.write("\n".join(sums) + "\n")
        family.identity_mapper(store, "L-to-Ltwin", source_name=family.NAMES["L"],
                               target_name=family.TWIN_L)
        config = family.kvtd_yaml(os.path.join(self.work, "kvtd.yaml"),
                                  verify_sample_fraction=1.0)
        with open(config) as f:
            text = f.read()
        with open(config, "w") as f:
            f.write(text.replace("prefix_cache:\n", "prefix_cache:\n  verify_window: 1\n"))
        self.kvtd = family.start_kvtd(store, E.free_port(), config, "sched-live-kvtd")
        self.kvtd.__enter__()
        self.addCleanup(self.kvtd.__exit__, None, None, None)

    def test_live_quality_when_live_verification_took_the_mapper_out_of_service(self):
        stats = KvtConnectorStats()
        link = KvtdLink(self.kvtd.address)
        config = ConnectorConfig.from_extra({
            "kvtd_address": self.kvtd.address, "model_name": family.NAMES["L"],
            "block_tokens": BLOCK, "lookup_wait_s": 0.5, "lookup_timeout_s": 10.0})
        s = KvtScheduler(config, BLOCK, link, stats.add)
        self.addCleanup(link.close)
        self.addCleanup(s.shutdown)
        rng = np.random.default_rng(2)
        source, own = (rng.standard_normal((LAYERS, 2, len(PROMPT), HEADS, DIM))
                       .astype(np.float32) for _ in range(2))
        client, prefix = link()
        prefix.publish(family.TWIN_L, PROMPT, [(source[i, 0], source[i, 1])
                                               for i in range(LAYERS)], wait_for_ready=True,
                       timeout=30)

        def run(req_id):
            request = new_request(req_id)
            s.on_new_request(request)
            end = time.monotonic() + 20
            while True:
                answer = s.get_num_new_matched_tokens(request, 0)
                if answer[0] is not None:
                    break
                self.assertLess(time.monotonic(), end)
            self.assertEqual(answer, (0, False))
            return s.request_finished(request, [])[1]["kvt"]

        sampled = run("sampled")
        self.assertEqual(sampled["reason"], "verification_sample", sampled)
        # The engine prefills the sampled request and publishes its own cache of the prompt:
        # unrelated to the source's, so the live cosine is far below 0.99 - 0.05.
        prefix.publish(family.NAMES["L"], PROMPT, [(own[i, 0], own[i, 1])
                                                   for i in range(LAYERS)], timeout=30)
        end = time.monotonic() + 30
        while prefix.lookup(family.NAMES["L"], PROMPT, max_tokens=LOADABLE,
                            timeout=10).miss_reason != "live_quality":
            self.assertLess(time.monotonic(), end, "the mapper was never taken out of service")
            time.sleep(0.1)
        o = run("refused")
        self.assertEqual((o["outcome"], o["reason"]), ("fallback_reprefill", "live_quality"), o)
        self.assertIn("live_quality", o.get("detail", ""), o)
        self.assertEqual({k: v for k, v in stats.data.items() if v},
                         {"requests": 2, "lookups": 2, "verification_samples": 1,
                          "fallback_reprefill": 2})


if __name__ == "__main__":
    unittest.main(verbosity=2)
