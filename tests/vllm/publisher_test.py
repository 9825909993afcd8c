"""The publisher thread's timing (kvt/vllm/publisher.py): a publish waits `publish_delay_ms` after
the step that queued it, a fence (wait_for with hurry, a preempted request's blocks about to be
reused) cuts that wait short, and busy() covers the wait (vLLM keeps the blocks until then). A
final publish that arrives while its request's prompt publish still waits takes its place.

The worker here records when a publish starts and ends instead of reading an engine's cache: what
is tested is when the thread publishes, not how (the end-to-end publishes, in place, through a
region and inline, are tests/vllm/connector_test.py's)."""

import time
import unittest

from kvt.vllm.metadata import PublishSpec
from kvt.vllm.publisher import Publisher


class RecordingKv:
    """Stands where KvtWorker.kv is: its first call marks the publish's start (and its tokens)."""

    def __init__(self, starts, tokens):
        self.starts, self.tokens = starts, tokens

    def cache_bytes(self, tokens):
        self.starts.append(time.monotonic())
        self.tokens.append(tokens)
        raise RuntimeError("recorded")  # the publisher counts it as a failed publish


class Worker:
    def __init__(self):
        self.starts, self.tokens = [], []
        self.kv = RecordingKv(self.starts, self.tokens)


class PublisherDelayTest(unittest.TestCase):
    def publisher(self, delay_s):
        worker, counts = Worker(), {}

        def count(name, value=1):
            counts[name] = counts.get(name, 0) + value

        pub = Publisher(worker, 8, count, delay_s=delay_s)
        self.addCleanup(pub.close)
        return pub, worker, counts

    def spec(self, req_id, final=False):
        n = 64 if final else 32  # prompt and output; the prompt alone
        return PublishSpec(req_id=req_id, final=final, token_ids=list(range(n)),
                           block_ids=list(range(n // 16)))

    def test_a_publish_waits_its_delay_and_stays_busy_meanwhile(self):
        pub, worker, counts = self.publisher(0.3)
        t0 = time.monotonic()
        pub.submit(self.spec("r1"))
        time.sleep(0.1)
        self.assertEqual(worker.starts, [])
        self.assertTrue(pub.busy("r1"))  # vLLM must keep the blocks
        self.assertTrue(pub.wait_for(["r1"], 5.0))
        self.assertGreaterEqual(worker.starts[0] - t0, 0.3)
        self.assertFalse(pub.busy("r1"))
        self.assertEqual(counts.get("publish_failed"), 1)

    def test_a_fence_cuts_the_delay_short(self):
        pub, worker, _ = self.publisher(30.0)
        t0 = time.monotonic()
        pub.submit(self.spec("r1"))
        self.assertTrue(pub.wait_for(["r1"], 5.0, hurry=True))
        self.assertLess(worker.starts[0] - t0, 2.0)
        # The next publish waits its delay again (the fence is over).
        pub.submit(self.spec("r2"))
        self.assertFalse(pub.wait_for(["r2"], 0.3))
        self.assertEqual(len(worker.starts), 1)

    def test_an_idle_wait_does_not_hurry(self):
        pub, worker, _ = self.publisher(0.5)
        pub.submit(self.spec("r1"))
        self.assertFalse(pub.wait_for(["r1"], 0.1))  # as the worker's idle step waits
        self.assertEqual(worker.starts, [])
        self.assertTrue(pub.wait_for(["r1"], 5.0))

    def test_no_delay_publishes_at_once(self):
        pub, worker, _ = self.publisher(0.0)
        t0 = time.monotonic()
        pub.submit(self.spec("r1"))
        self.assertTrue(pub.wait_for(["r1"], 5.0))
        self.assertLess(worker.starts[0] - t0, 1.0)

    def test_publishes_keep_their_order(self):
        pub, worker, _ = self.publisher(0.05)
        for i in range(3):
            pub.submit(self.spec(f"r{i}"))
        self.assertTrue(pub.wait_for([f"r{i}" for i in range(3)], 5.0))
        self.assertEqual(worker.starts, sorted(worker.starts))
        self.assertEqual(len(worker.starts), 3)

    def test_a_final_publish_takes_the_place_of_its_waiting_prompt_publish(self):
        pub, worker, counts = self.publisher(0.3)
        pub.submit(self.spec("r1"))
        pub.submit(self.spec("r2"))
        time.sleep(0.1)
        t_final = time.monotonic()
        pub.submit(self.spec("r1", final=True))  # r1's prompt publish has not started
        self.assertTrue(pub.busy("r1"))
        self.assertTrue(pub.wait_for(["r1", "r2"], 5.0))
        # One publish of r1, the final one, in the prompt one's place (before r2's), after the
        # delay counted from the final one's arrival.
        self.assertEqual(worker.tokens, [64, 32])
        self.assertGreaterEqual(worker.starts[0] - t_final, 0.3)
        self.assertEqual(counts.get("publish_coalesced"), 1)
        self.assertEqual(counts.get("publish_failed"), 2)
        self.assertFalse(pub.busy("r1"))

    def test_a_started_prompt_publish_is_not_replaced(self):
        pub, worker, counts = self.publisher(0.0)
        pub.submit(self.spec("r1"))
        self.assertTrue(pub.wait_for(["r1"], 5.0))
        pub.submit(self.spec("r1", final=True))
        self.assertTrue(pub.wait_for(["r1"], 5.0))
        self.assertEqual(worker.tokens, [32, 64])
        self.assertNotIn("publish_coalesced", counts)

    def test_a_fenced_prompt_publish_runs_before_a_later_final_one(self):
        # A preempted request's prompt publish is hurried out; its final publish comes later
        # and is published on its own.
        pub, worker, counts = self.publisher(30.0)
        pub.submit(self.spec("r1"))
        self.assertTrue(pub.wait_for(["r1"], 5.0, hurry=True))
        pub.submit(self.spec("r1", final=True))
        self.assertTrue(pub.wait_for(["r1"], 5.0, hurry=True))
        self.assertEqual(worker.tokens, [32, 64])
        self.assertNotIn("publish_coalesced", counts)


if __name__ == "__main__":
    unittest.main()
