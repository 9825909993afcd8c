"""The connector's per-step hooks, which every engine step pays for whether or not anything is
reused: what they still do on the steps that matter once they return early on the steps that do
not. KvtScheduler.build_connector_meta on vLLM's own SchedulerOutput / NewRequestData /
CachedRequestData for a prompt prefilled in two chunks and then decoded; KvtWorker's
get_transfer_results with nothing pending, with a load that ended and with blocks held;
KvtConnector's stats and per-layer hooks; and the outcome lines, written off the scheduler
loop. No kvtd is asked anything: the scheduler side is built with lookups off, the worker side
with transport inline."""

import dataclasses
import json
import threading
import unittest

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kvt.vllm.connector import KvtConnector
from kvt.vllm.metadata import KvtConnectorMetadata, LoadResult
from kvt.vllm.options import ConnectorConfig
from kvt.vllm.scheduler_side import KvtScheduler
from kvt.vllm.stats import KvtConnectorStats
from kvt.vllm.worker_side import KvtWorker

BLOCK = 16
PROMPT = list(range(1, 3 * BLOCK + 6))  # 53 tokens: 3 whole kvtd blocks
BLOCK_IDS = [7, 8, 9, 10]

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def config(**extra):
    return ConnectorConfig.from_extra({"kvtd_address": "127.0.0.1:1", "model_name": "m",
                                       "block_tokens": BLOCK, "lookup_digest": False,
                                       "transport": "inline", **extra})


def new_request(req_id):
    return Request(req_id, list(PROMPT), SamplingParams(max_tokens=4), None,
                   block_hasher=HASHER)


def first_chunk(request, tokens):
    """The step that schedules a new request's first `tokens` prompt tokens."""
    return dataclasses.replace(
        SchedulerOutput.make_empty(),
        scheduled_new_reqs=[NewRequestData.from_request(request, (BLOCK_IDS,))],
        num_scheduled_tokens={request.request_id: tokens}, total_num_scheduled_tokens=tokens)


def later_step(request, computed, tokens):
    """A step that schedules `tokens` more tokens of a running request."""
    cached = dataclasses.replace(CachedRequestData.make_empty(), req_ids=[request.request_id],
                                 num_computed_tokens=[computed], num_output_tokens=[0],
                                 new_block_ids=[None], new_token_ids=[[]])
    return dataclasses.replace(
        SchedulerOutput.make_empty(), scheduled_cached_reqs=cached,
        num_scheduled_tokens={request.request_id: tokens}, total_num_scheduled_tokens=tokens)


class SchedulerStepTest(unittest.TestCase):
    def setUp(self):
        self.stats = KvtConnectorStats()
        self.scheduler = KvtScheduler(config(), BLOCK, lambda: (None, None), self.stats.add)
        self.addCleanup(self.scheduler.shutdown)

    def meta(self, step):
        meta = self.scheduler.build_connector_meta(step, lambda req_id: list(BLOCK_IDS))
        self.assertIsInstance(meta, KvtConnectorMetadata)
        return meta

    def test_the_prompt_is_published_once_in_the_step_that_completes_it(self):
        request = new_request("r")
        self.scheduler.on_new_request(request)
        self.assertEqual(self.meta(first_chunk(request, 32)).publishes, [])
        (publish,) = self.meta(later_step(request, 32, len(PROMPT) - 32)).publishes
        self.assertEqual((publish.req_id, publish.final), ("r", False))
        self.assertEqual(publish.token_ids, PROMPT[:3 * BLOCK])
        self.assertEqual(publish.block_ids, BLOCK_IDS[:3])
        for computed in range(len(PROMPT), len(PROMPT) + 3):  # decode steps
            meta = self.meta(later_step(request, computed, 1))
            self.assertEqual((meta.publishes, meta.loads, meta.releases, meta.fence),
                             ([], [], [], []))
        hold, _ = self.scheduler.request_finished(request, list(BLOCK_IDS))
        self.assertTrue(hold)  # its prompt publish may still read the blocks
        self.assertEqual(self.meta(SchedulerOutput.make_empty()).releases, ["r"])

    def test_a_request_that_ends_before_its_prompt_is_computed_publishes_nothing(self):
        request = new_request("r")
        self.scheduler.on_new_request(request)
        self.meta(first_chunk(request, 32))
        hold, params = self.scheduler.request_finished(request, list(BLOCK_IDS))
        self.assertFalse(hold)
        self.assertEqual(params["kvt"]["outcome"], "fallback_reprefill")
        # Scheduled again under the same id (a new request): treated as new, nothing stale.
        again = new_request("r")
        self.scheduler.on_new_request(again)
        (publish,) = self.meta(first_chunk(again, len(PROMPT))).publishes
        self.assertEqual(publish.token_ids, PROMPT[:3 * BLOCK])

    def test_without_publishing_no_step_publishes(self):
        scheduler = KvtScheduler(config(publish=False), BLOCK, lambda: (None, None),
                                 self.stats.add)
        self.addCleanup(scheduler.shutdown)
        request = new_request("r")
        scheduler.on_new_request(request)
        meta = scheduler.build_connector_meta(first_chunk(request, len(PROMPT)),
                                              lambda req_id: list(BLOCK_IDS))
        self.assertEqual(meta.publishes, [])

    def test_outcome_lines_are_written_off_the_loop_in_order_and_flushed_at_shutdown(self):
        with self.assertLogs("vllm.kvt", level="INFO") as logs:
            for i in range(5):
                request = new_request(f"r{i}")
                self.scheduler.on_new_request(request)
                self.scheduler.request_finished(request, [])
            self.scheduler.shutdown()
        records = [r for r in logs.records if r.getMessage().startswith("kvt_outcome ")]
        self.assertEqual([json.loads(r.getMessage().split(" ", 1)[1])["request_id"]
                          for r in records], [f"r{i}" for i in range(5)])
        self.assertEqual({r.threadName.split("_")[0] for r in records}, {"kvt-log"})

    def test_a_preempted_request_that_published_is_fenced(self):
        request = new_request("r")
        self.scheduler.on_new_request(request)
        self.meta(first_chunk(request, len(PROMPT)))
        step = dataclasses.replace(SchedulerOutput.make_empty(), preempted_req_ids={"r", "x"})
        self.assertEqual(self.meta(step).fence, ["r"])


class WorkerStepTest(unittest.TestCase):
    def setUp(self):
        self.worker = KvtWorker(config(), 2, 32, "fp32", 1024, lambda: (None, None),
                                lambda *a: None)
        self.addCleanup(self.worker.shutdown)

    def test_nothing_pending_reports_nothing(self):
        results = self.worker.get_transfer_results(KvtConnectorMetadata())
        self.assertEqual((results.finished_sending, results.finished_recving,
                          results.failed_recving), (set(), set(), set()))
        self.assertIsNone(self.worker.build_worker_meta())

    def test_an_ended_load_is_reported_once(self):
        with self.worker._lock:
            self.worker._loads_done["a"] = LoadResult(ok=True)
            self.worker._loads_done["b"] = LoadResult(ok=False, error="gone")
        results = self.worker.get_transfer_results(KvtConnectorMetadata())
        self.assertEqual(results.finished_recving, {"a", "b"})
        self.assertEqual(results.failed_recving, {"b"})
        self.assertEqual(set(self.worker.build_worker_meta().loads), {"a", "b"})
        results = self.worker.get_transfer_results(KvtConnectorMetadata())
        self.assertEqual((results.finished_recving, results.failed_recving), (set(), set()))

    def test_held_blocks_are_released_in_the_next_report(self):
        self.worker.start_load_kv(KvtConnectorMetadata(releases=["r"]))
        results = self.worker.get_transfer_results(KvtConnectorMetadata())
        self.assertEqual(results.finished_sending, {"r"})
        results = self.worker.get_transfer_results(KvtConnectorMetadata())
        self.assertEqual(results.finished_sending, set())


class ConnectorHooksTest(unittest.TestCase):
    # Built without vLLM's config (__new__): these hooks read only the state set here.
    def test_no_per_layer_hooks(self):
        connector = KvtConnector.__new__(KvtConnector)
        self.assertFalse(connector.has_connector_metadata())

    def test_stats_only_when_something_was_counted(self):
        connector = KvtConnector.__new__(KvtConnector)
        connector._stats, connector._stats_lock = KvtConnectorStats(), threading.Lock()
        connector._stats_counted = False
        self.assertIsNone(connector.get_kv_connector_stats())
        connector._count("requests")
        connector._count("digest_misses", 2)
        stats = connector.get_kv_connector_stats()
        self.assertEqual((stats.data["requests"], stats.data["digest_misses"]), (1, 2))
        self.assertIsNone(connector.get_kv_connector_stats())


if __name__ == "__main__":
    unittest.main()
