"""kvt.prefix_digest against a real kvtd with the prefix cache: the digest it announces in
ServerMetadata, read from its shared-memory object, agrees with LookupPrefix (every "no" is a
no_prefix miss, every stored prompt reads "maybe"), follows publishes and evictions, and goes dead
when kvtd stops; DigestFollower finds it off the caller's thread and again after a restart."""

from __future__ import annotations

import os
import signal
import stat
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import kvt
from kvt.prefix import PrefixCache
from kvt.prefix_digest import DigestFollower, PrefixDigest
from kvt_testing import junit_main
from kvt_testing.kvtd import Kvtd
from kvt_testing.runfiles import test_tmpdir

from client_test import make_store, write

SOURCE, TARGET = "kvt-demo/tiny-4l", "kvt-demo/tiny-6l"   # the demo mapper's pair
LAYERS, HEADS, DIM = 4, 2, 32
BLOCK = 16
CONFIG = f"""prefix_cache:
  enabled: true
  block_tokens: {BLOCK}
  digest_slots: 4096
  min_benefit_recovered: 0
"""


def start_kvtd(name: str) -> Kvtd:
    config = write(os.path.join(test_tmpdir(), f"{name}.yaml"), CONFIG)
    return Kvtd(["--listen_address=127.0.0.1:0", f"--mapper_store={make_store(name)}",
                 "--backend=cpu", "--cpu_threads=1", "--drain_grace_seconds=0",
                 f"--config={config}"], name).__enter__()


def wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class PrefixDigestTest(unittest.TestCase):
    def setUp(self) -> None:
        self.kvtd = start_kvtd("digest-kvtd")
        self.client = kvt.Client(self.kvtd.address, timeout=30)
        self.prefix = PrefixCache(self.client)
        self.rng = np.random.default_rng(3)

    def tearDown(self) -> None:
        self.client.close()
        self.kvtd.__exit__()

    def publish(self, tokens) -> None:
        cache = self.rng.standard_normal((LAYERS, 2, len(tokens), HEADS, DIM)).astype(np.float32)
        self.prefix.publish(SOURCE, tokens, [(cache[i, 0], cache[i, 1]) for i in range(LAYERS)])

    def prompt(self, n: int = 3 * BLOCK + 5):
        return [int(t) for t in self.rng.integers(1, 50000, size=n)]

    def test_announced_and_mapped_as_announced(self) -> None:
        metadata = self.client.server_metadata()
        self.assertIn("prefix_digest", metadata.extensions)
        info = metadata.prefix_digest
        self.assertEqual((info.slots, info.block_tokens, info.hashes), (4096, BLOCK, 3))
        self.assertTrue(info.shm_name.startswith("/kvt-prefix-digest-"))
        mode = stat.S_IMODE(os.stat("/dev/shm" + info.shm_name).st_mode)
        self.assertEqual(mode, 0o644)  # no auth: any engine on the host may read it
        digest = PrefixDigest.of(self.client)
        self.assertTrue(digest.live())
        self.assertLess(digest.heartbeat_age_s(), 3.0)
        self.assertEqual(digest.keys(), 0)

    def test_every_no_is_a_no_prefix_miss_and_stored_prompts_read_maybe(self) -> None:
        digest = PrefixDigest.of(self.client)
        stored = [self.prompt() for _ in range(40)]
        for tokens in stored:
            self.assertFalse(digest.might_hold(tokens))
            self.publish(tokens)
            # Visible as soon as Publish returns: kvtd updates the digest before answering.
            self.assertTrue(digest.might_hold(tokens))
        self.assertEqual(digest.keys(), 40)
        # Another continuation of a stored first block reads "maybe" too: a lookup may match.
        self.assertTrue(digest.might_hold(stored[0][:BLOCK] + self.prompt()))
        noes = 0
        for _ in range(200):
            tokens = self.prompt()
            if digest.might_hold(tokens):
                continue
            noes += 1
            answer = self.prefix.lookup(TARGET, tokens, max_tokens=len(tokens) - 1)
            self.assertFalse(answer.hit)
            self.assertEqual(answer.miss_reason, "no_prefix")
        self.assertGreater(noes, 150)  # 40 keys in 4096 counters: few false "maybe"s
        # Shorter than one block: nothing can match.
        self.assertFalse(digest.might_hold(stored[0][:BLOCK - 1]))

    def test_follows_eviction(self) -> None:
        digest = PrefixDigest.of(self.client)
        kept, dropped = self.prompt(), self.prompt()
        self.publish(kept)
        self.publish(dropped)
        entry = next(e for e in self.prefix.list(SOURCE).entries
                     if e.first_block_hash == kvt.prefix.first_block_hash(SOURCE, dropped, BLOCK))
        self.prefix.evict(SOURCE, entry.entry_id)
        self.assertFalse(digest.might_hold(dropped))
        self.assertTrue(digest.might_hold(kept))
        self.prefix.evict(SOURCE)
        self.assertFalse(digest.might_hold(kept))
        self.assertEqual(digest.keys(), 0)

    def test_dead_once_kvtd_stops(self) -> None:
        digest = PrefixDigest.of(self.client)
        path = "/dev/shm" + digest.name
        self.kvtd._process.send_signal(signal.SIGTERM)  # graceful: kvtd marks it and unlinks it
        self.kvtd._process.wait(timeout=30)
        self.assertFalse(digest.live())
        self.assertFalse(os.path.exists(path))

    def test_follower_resolves_off_thread_and_again_after_a_restart(self) -> None:
        stored = self.prompt()
        self.publish(stored)
        other = self.prompt()
        with ThreadPoolExecutor(max_workers=1) as pool:
            follower = DigestFollower(lambda: self.client, pool.submit, retry_s=0.05)
            # Not resolved yet: never claims a miss.
            self.assertFalse(follower.certain_miss(other))
            self.assertTrue(wait_until(follower.ready))
            self.assertTrue(follower.certain_miss(other))
            self.assertFalse(follower.certain_miss(stored))
            # kvtd is killed (its heartbeat still looks fresh for seconds): the lost connection
            # drops the digest at once. It restarts on the same port with an empty cache and a
            # digest of its own.
            port = self.kvtd.port
            self.kvtd._process.send_signal(signal.SIGKILL)
            self.kvtd._process.wait(timeout=30)
            self.assertTrue(wait_until(lambda: not follower.ready(), timeout=2.0))
            self.assertFalse(follower.certain_miss(other))  # dead digest: ask kvtd
            config = write(os.path.join(test_tmpdir(), "restarted.yaml"), CONFIG)
            self.kvtd = Kvtd([f"--listen_address=127.0.0.1:{port}",
                              f"--mapper_store={make_store('restarted')}", "--backend=cpu",
                              "--cpu_threads=1", "--drain_grace_seconds=0",
                              f"--config={config}"], "restarted").__enter__()
            self.assertTrue(wait_until(follower.ready, timeout=30))
            self.assertTrue(follower.certain_miss(stored))  # the new kvtd holds nothing
            self.publish(stored)
            self.assertFalse(follower.certain_miss(stored))
            follower.close()
            self.assertFalse(follower.certain_miss(other))


class DigestOffTest(unittest.TestCase):
    def test_not_announced_when_off(self) -> None:
        config = write(os.path.join(test_tmpdir(), "off.yaml"),
                       CONFIG.replace("digest_slots: 4096", "digest_slots: 0"))
        with Kvtd(["--listen_address=127.0.0.1:0", f"--mapper_store={make_store('off')}",
                   "--backend=cpu", f"--config={config}"], "off") as kvtd, \
                kvt.Client(kvtd.address, timeout=30) as client:
            self.assertNotIn("prefix_digest", client.server_metadata().extensions)
            self.assertFalse(client.server_metadata().HasField("prefix_digest"))
            self.assertIsNone(PrefixDigest.of(client))


if __name__ == "__main__":
    junit_main.main()
