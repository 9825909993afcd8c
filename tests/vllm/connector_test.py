"""kvt inside vLLM, end to end: real vLLM engines (S, M, L of the bundled family, each in
a process of its own, KvtConnector configured), a real kvtd (//server:kvtd with the source-cache
tier) and mappers fitted here with `kvt fit`.

  (a) handoff M -> L: M serves a prompt and publishes; L serves the prompt plus a continuation,
      reuses M's prefix translated, and its greedy tokens equal L continuing from the same
      translated cache (fetched from kvtd with the Python client) through transformers; the
      first token's log-probabilities agree within 1e-2.
  (b) a conversation alternating S and L, every turn reusing the other's published prefix.
  (c) fallbacks, each with an output identical to a plain run: kvtd stopped (lookup past its
      deadline), kvtd killed while a lookup is in flight, a pair without a mapper, reuse
      forbidden, the quality gate below its floor, a full source-cache budget; a bad
      kv_transfer_params names the key and the engine keeps serving.
  (d) the prefix-cache hazard: translated blocks are no exact hits for plain requests (default);
      the engine that opted in (allow_translated_prefix_cache) shares them.

  MechanicsTest: the connector's vLLM mechanics with exact equalities, against a test double of
      kvtd that hands the engine back its own KV (see the class).

The engines start once for the suite, in parallel with the mapper fit.
"""

import json
import os
import signal
import sys
import threading
import time
import unittest

import numpy as np
import torch

import family
import engines as E
from engines import outcome
from kvt_testing import tinyfamily as R

import kvt
from kvt import adapters
from kvt.cache import DTYPE_NAMES
from kvt.prefix import PrefixCache

WORK = os.environ.get("TEST_TMPDIR") or "/tmp/kvt-vllm-test"
# Engine logs come back with the test's outputs (bazel-testlogs/.../test.outputs) for a failure
# to be read after the run.
LOGS = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or WORK
CONTEXT = 256          # prompt bytes the source serves
CONTINUATION = 40      # extra prompt bytes the target adds
GEN = 12               # greedy tokens compared


class Suite:
    """What setUpModule builds: kvtd (restartable), engines, clients."""
    kvtd = None
    started = False
    port = 0
    store = ""
    config = ""
    engines = {}


def start_kvtd(config=None):
    restart = Suite.started
    Suite.kvtd = family.start_kvtd(Suite.store, Suite.port, config or Suite.config).__enter__()
    if restart:
        wait_engines_reach_kvtd()
    Suite.started = True
    return Suite.kvtd


_probes = iter(range(1 << 30))


def wait_engines_reach_kvtd(timeout=30.0):
    """After a kvtd restart, until every engine's lookups reach the new kvtd again (its channel
    left the reconnect backoff): a probe request per engine, repeated while its lookup fails."""
    end = time.monotonic() + timeout
    for engine in Suite.engines.values():
        while True:
            probe = list(f"reconnect probe {next(_probes)} ".encode() * 3)
            o = outcome(engine.one(probe, 1, cache_salt=f"probe-{next(_probes)}"))
            if o.get("reason") != "lookup_failed":
                break
            if time.monotonic() > end:
                raise AssertionError(f"engine {engine.name} does not reach kvtd: {o}")
            time.sleep(0.1)


def kvtd_unread_bytes(port):
    """Bytes that clients sent kvtd and it has not read (the receive queues of its established
    connections in /proc/net/tcp*): they grow when a request reaches a stopped kvtd."""
    total = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01":  # TCP_ESTABLISHED
                total += int(fields[4].split(":")[1], 16)
    return total


def stop_kvtd():
    if Suite.kvtd is not None:
        Suite.kvtd.__exit__(None, None, None)
        Suite.kvtd = None


def setUpModule():
    torch.set_num_threads(1)
    os.makedirs(WORK, exist_ok=True)
    Suite.port = E.free_port()
    address = f"127.0.0.1:{Suite.port}"
    common = {"kvtd_address": address, "lookup_timeout_s": 2.0, "translate_timeout_s": 30.0}
    specs = {
        # S keeps its cache private: its loads go through the packed load region (layer
        # notices, copies); M and L share theirs and kvtd writes loads in place.
        "S": {"model_name": family.NAMES["S"], "load_in_place": False},
        # M opts in to sharing translated blocks through its own prefix cache (test (d)).
        "M": {"model_name": family.NAMES["M"], "allow_translated_prefix_cache": True},
        "L": {"model_name": family.NAMES["L"]},
    }
    Suite.engines = {name: E.Engine(name, family.model_dir(name), {**common, **spec}, LOGS)
                     for name, spec in specs.items()}
    for engine in Suite.engines.values():
        engine.start()
    try:
        Suite.store = family.fit_store(os.path.join(WORK, "fit"))
        # The identity mappers of MechanicsTest (kvt-tiny-L-twin -> kvt-tiny-L).
        family.identity_mapper(Suite.store, "Ltwin-to-L")
        family.identity_mapper(Suite.store, "Ltwin-to-L-zero-v", zero_v=True)
        # The reverse (kvt-tiny-L -> the twin): reads back what engine L published.
        family.identity_mapper(Suite.store, "L-to-Ltwin", source_name=family.NAMES["L"],
                               target_name=family.TWIN_L)
        Suite.config = family.kvtd_yaml(os.path.join(WORK, "kvtd.yaml"))
        start_kvtd()
        for engine in Suite.engines.values():
            engine.wait_ready()
    except BaseException:
        tearDownModule()
        raise
    print("engines started in " + ", ".join(f"{n} {e.start_s:.0f} s"
                                            for n, e in Suite.engines.items()), file=sys.stderr)


def tearDownModule():
    for engine in Suite.engines.values():
        engine.stop()
    stop_kvtd()


def wait_stopped(pid, timeout=5.0):
    """Until the kernel reports the process stopped (state T in /proc/PID/stat)."""
    end = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        if time.monotonic() > end:
            raise AssertionError(f"kvtd {pid} did not stop")
        time.sleep(0.01)


_salts = iter(range(1 << 30))


def last_outcome_line(engine, reason, timeout=10.0):
    """The engine's last kvt_outcome record once it has `reason`: the lines are written off
    the scheduler loop, so the newest may still be on its way."""
    end = time.monotonic() + timeout
    while True:
        lines = engine.log_lines("kvt_outcome ")
        record = json.loads(lines[-1].split("kvt_outcome ", 1)[1]) if lines else None
        if (record is not None and record.get("reason") == reason) or time.monotonic() > end:
            assert record is not None, f"{engine.name} logged no kvt_outcome line"
            return record
        time.sleep(0.05)


def plain(engine, prompt, max_tokens=GEN, logprobs=None):
    """A plain run: no reuse, and a cache salt of its own so it shares no prefix-cache blocks."""
    return engine.one(prompt, max_tokens, kvt={"reuse": "forbid"},
                      cache_salt=f"plain-{next(_salts)}", logprobs=logprobs)


def text(n, offset):
    return family.heldout_text(n, offset)


class KvtConnectorTest(unittest.TestCase):
    maxDiff = None

    def client(self):
        return kvt.Client(Suite.kvtd.address, timeout=60)

    def publish_via(self, engine, prompt, max_tokens=4):
        """Serve `prompt` on `engine` (it publishes) and wait until kvtd holds it (a new entry:
        an older, longer one of another text must not end the wait)."""
        with self.client() as c:
            before = family.entry_ids(c, family.NAMES[engine.name])
            r = engine.one(prompt, max_tokens)
            family.wait_for_entries(c, family.NAMES[engine.name], prompt,
                                    exclude=before)
        return r

    # -- (a) ------------------------------------------------------------------------------------

    def test_a_handoff_M_to_L_matches_transformers(self):
        M, L = Suite.engines["M"], Suite.engines["L"]
        context = text(CONTEXT, 1000)
        prompt = context + text(CONTINUATION, 1000 + CONTEXT)
        self.publish_via(M, context)
        got = L.one(prompt, GEN, logprobs=20)
        o = outcome(got)
        self.assertEqual(o.get("outcome"), "applied", o)
        self.assertEqual(o["source_model"], family.NAMES["M"])
        self.assertEqual(o["mapper_id"], "M-to-L")
        reused = o["tokens_reused"]
        self.assertEqual(reused, CONTEXT // 32 * 32)  # whole vLLM blocks of M's published prefix
        for key in ("lookup_ms", "translate_ms"):
            self.assertGreater(o["timings"][key], 0.0, o)
        # kvtd allows client regions here: it wrote into L's own shared cache, so the worker
        # had nothing to copy.
        self.assertEqual(o["transport"], "in_place", o)
        self.assertEqual(o["timings"]["load_ms"], 0.0, o)
        # The same translated cache through the Python client and transformers.
        with self.client() as c:
            hit = PrefixCache(c).lookup(family.NAMES["L"], prompt, max_tokens=len(prompt) - 1)
            self.assertTrue(hit.hit, hit)
            self.assertEqual(hit.mapper_id, "M-to-L")
            result = c.translate_cached(hit.lease_id, hit.mapper_id, hit.matched_tokens,
                                        dtype=DTYPE_NAMES[hit.dtype], output_dtype="fp32")
        cache = result.target.to_layout("HND").slice_tokens(0, reused)
        member = R.Member(family.model_dir("L"))
        dyn = adapters.to_dynamic_cache(cache)
        ids = list(prompt[reused:])
        tokens = []
        first = None
        with torch.no_grad():
            feed = ids
            for _ in range(GEN):
                out = member.hf(input_ids=torch.tensor([feed]), past_key_values=dyn,
                                use_cache=True)
                logp = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
                if first is None:
                    first = logp
                nxt = int(torch.argmax(logp))
                tokens.append(nxt)
                feed = [nxt]
        self.assertEqual(got["token_ids"], tokens)
        vllm_first = got["logprobs"][0]
        ours = np.array([vllm_first[t] for t in sorted(vllm_first)])
        theirs = np.array([float(first[int(t)]) for t in sorted(vllm_first)])
        np.testing.assert_allclose(ours, theirs, rtol=1e-2, atol=1e-3)
        own = plain(L, prompt, GEN, logprobs=20)
        print(f"\n(a) M -> L: {reused} tokens reused; timings {o['timings']}; tokens "
              f"{'equal' if own['token_ids'] == got['token_ids'] else 'differ from'} L's own "
              "prefill", file=sys.stderr)

    # -- (b) ------------------------------------------------------------------------------------

    def test_b_multi_turn_alternating_S_and_L(self):
        S, L = Suite.engines["S"], Suite.engines["L"]
        conversation = []
        turns = []
        offset = 5000
        for turn, engine in enumerate((S, L, S, L)):
            conversation += text(96, offset)
            offset += 96
            with self.client() as c:
                before = family.entry_ids(c, family.NAMES[engine.name])
            r = engine.one(conversation, 24)
            o = outcome(r)
            turns.append((engine.name, o.get("outcome"), o.get("source_model"),
                          o.get("tokens_reused", 0), o.get("reason"), o.get("transport")))
            conversation += r["token_ids"]
            with self.client() as c:  # the final publish (prompt + generated) is in kvtd
                family.wait_for_entries(c, family.NAMES[engine.name],
                                        conversation[:len(conversation) // 16 * 16 - 16],
                                        exclude=before)
        print("\n(b) turns: " + json.dumps(turns), file=sys.stderr)
        self.assertNotEqual(turns[0][1], "applied")  # nothing published yet
        for name, out, source, reused, _, transport in turns[1:]:
            other = family.NAMES["S" if name == "L" else "L"]
            self.assertEqual(out, "applied", turns)
            self.assertEqual(source, other, turns)
            self.assertGreater(reused, 0)
            # Both load transports: in place into L's shared cache, the load region into S's.
            self.assertEqual(transport, "in_place" if name == "L" else "shm", turns)

    def test_a2_in_place_load_behind_a_local_prefix_hit_leaves_shared_blocks_alone(self):
        """kvtd writes only the tokens past the engine's own prefix-cache hit (first_token):
        the hit's blocks, shared with other requests, keep L's own KV."""
        M, L = Suite.engines["M"], Suite.engines["L"]
        own, more, tail = text(160, 30000), text(160, 30160), text(40, 30320)
        L.one(own, 2, kvt={"reuse": "forbid"})  # no salt: its blocks are hits for later requests
        self.publish_via(M, own + more)
        got = L.one(own + more + tail, GEN)
        o = outcome(got)
        self.assertEqual(o.get("outcome"), "applied", o)
        self.assertEqual(o["transport"], "in_place", o)
        local = len(own) // 32 * 32
        self.assertEqual(o["prefix_tokens"], len(own + more) // 32 * 32, o)
        self.assertEqual(o["tokens_reused"], o["prefix_tokens"] - local, o)
        again = L.one(own + tail, GEN, kvt={"reuse": "forbid"}, logprobs=5)
        self.assertEqual(again["num_cached_tokens"], local)
        reference = plain(L, own + tail, GEN, logprobs=5)
        self.assertEqual(again["token_ids"], reference["token_ids"])
        for mine, want in zip(again["logprobs"], reference["logprobs"]):
            for token, value in want.items():
                self.assertAlmostEqual(mine[token], value, places=4)

    # -- (c) ------------------------------------------------------------------------------------

    def assert_fallback(self, result, reference, reason, detail_contains=""):
        o = outcome(result)
        self.assertEqual(o.get("outcome"), "fallback_reprefill", o)
        self.assertEqual(o.get("reason"), reason, o)
        if detail_contains:
            self.assertIn(detail_contains, o.get("detail", ""), o)
        self.assertEqual(result["token_ids"], reference["token_ids"])

    def test_c1_kvtd_past_deadline_then_killed_mid_lookup(self):
        M, L = Suite.engines["M"], Suite.engines["L"]
        context = text(CONTEXT, 9000)
        prompt = context + text(CONTINUATION, 9000 + CONTEXT)
        self.publish_via(M, context)
        reference = plain(L, prompt)
        pid = Suite.kvtd._process.pid
        os.kill(pid, signal.SIGSTOP)
        wait_stopped(pid)
        try:
            slow = L.one(prompt, GEN, cache_salt="slow")
            # The lookup's deadline (or, had kvtd stopped between lookup and translation, the
            # translation's) ends the wait; either way a plain prefill.
            self.assertIn(outcome(slow).get("reason"), ("lookup_failed", "translate_failed"))
            self.assert_fallback(slow, reference, outcome(slow).get("reason"),
                                 "DEADLINE_EXCEEDED")
            box = {}
            unread = kvtd_unread_bytes(Suite.port)
            worker = threading.Thread(target=lambda: box.update(
                r=L.one(prompt, GEN, cache_salt="killed")))
            worker.start()
            # The lookup is in flight: its bytes wait in the stopped kvtd's receive queue.
            deadline = time.monotonic() + 30
            while kvtd_unread_bytes(Suite.port) <= unread:
                self.assertLess(time.monotonic(), deadline, "the lookup never reached kvtd")
                time.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            worker.join(120)
            self.assert_fallback(box["r"], reference, "lookup_failed")
            # kvtd down: still a plain run.
            down = L.one(prompt, GEN, cache_salt="down")
            self.assert_fallback(down, reference, "lookup_failed", "UNAVAILABLE")
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            stop_kvtd()
            start_kvtd()
        # Back up: reuse works again once something is published.
        self.publish_via(M, context)
        again = L.one(prompt, GEN, cache_salt="again")
        self.assertEqual(outcome(again).get("outcome"), "applied", outcome(again))

    def test_c2_pair_without_mapper(self):
        M, S = Suite.engines["M"], Suite.engines["S"]
        prompt = text(CONTEXT, 12000)
        self.publish_via(M, prompt[:CONTEXT - 32])  # only M holds it; there is no M -> S mapper
        reference = plain(S, prompt)
        got = S.one(prompt, GEN)
        self.assert_fallback(got, reference, "no_mapper")

    def test_c3_forbidden(self):
        M, L = Suite.engines["M"], Suite.engines["L"]
        prompt = text(CONTEXT, 14000)
        self.publish_via(M, prompt[:CONTEXT - 32])
        reference = plain(L, prompt)
        got = L.one(prompt, GEN, kvt={"reuse": "forbid"}, cache_salt="forbid")
        self.assert_fallback(got, reference, "forbidden")

    def test_c4_gate_below_threshold(self):
        M, L = Suite.engines["M"], Suite.engines["L"]
        prompt = text(CONTEXT, 16000)
        stop_kvtd()
        start_kvtd(family.kvtd_yaml(os.path.join(WORK, "kvtd-gate.yaml"),
                                    pair_min_quality={"kvt-tiny-M->kvt-tiny-L": 0.99}))
        try:
            self.publish_via(M, prompt[:CONTEXT - 32])
            reference = plain(L, prompt)
            got = L.one(prompt, GEN)
            self.assert_fallback(got, reference, "gate")
            forced = L.one(prompt, GEN, kvt={"reuse": "force"}, cache_salt="forced")
            self.assertEqual(outcome(forced).get("outcome"), "applied", outcome(forced))
            self.assertFalse(outcome(forced)["gate"]["passed"])
        finally:
            stop_kvtd()
            start_kvtd()

    def test_c5_full_source_cache_budget(self):
        M, L = Suite.engines["M"], Suite.engines["L"]
        prompt = text(CONTEXT, 18000)
        stop_kvtd()
        start_kvtd(family.kvtd_yaml(os.path.join(WORK, "kvtd-budget.yaml"), max_bytes=4096))
        try:
            M.one(prompt[:CONTEXT - 32], 4)  # its publish does not fit: RESOURCE_EXHAUSTED
            deadline = time.monotonic() + 20
            while not any("RESOURCE_EXHAUSTED" in line for line in M.log_lines("kvt: publish")):
                self.assertLess(time.monotonic(), deadline, M.log_tail())
                time.sleep(0.1)
            reference = plain(L, prompt)
            got = L.one(prompt, GEN)
            self.assert_fallback(got, reference, "no_prefix")
        finally:
            stop_kvtd()
            start_kvtd()

    def test_c6_bad_kv_transfer_params_name_the_key(self):
        L = Suite.engines["L"]
        prompt = text(100, 20000)
        reference = plain(L, prompt)
        for params, key in (({"reuse": "sometimes"}, "kv_transfer_params.kvt.reuse"),
                            ({"mapper": "M-to-L"}, "kv_transfer_params.kvt.mapper"),
                            ({"min_tokens": -1}, "kv_transfer_params.kvt.min_tokens")):
            got = L.one(prompt, GEN, kvt=params, cache_salt=f"bad-{key}")
            o = outcome(got)
            self.assertEqual(o.get("outcome"), "unsupported", o)
            self.assertIn(key, o.get("detail", ""))
            self.assertEqual(got["token_ids"], reference["token_ids"])
        from kvt.vllm.connector import validate_kv_transfer_params
        with self.assertRaisesRegex(ValueError, "kv_transfer_params.kvt.reuse"):
            validate_kv_transfer_params({"kvt": {"reuse": 3}})
        with self.assertRaisesRegex(ValueError, "kv_transfer_params.kvt.load: 'pigeon' is not "
                                                "one of auto, region, inline"):
            validate_kv_transfer_params({"kvt": {"load": "pigeon"}})

    # -- (d) ------------------------------------------------------------------------------------

    def test_d1_translated_blocks_are_no_hits_for_plain_requests(self):
        M, L = Suite.engines["M"], Suite.engines["L"]
        context = text(CONTEXT, 22000)
        prompt = context + text(CONTINUATION, 22000 + CONTEXT)
        self.publish_via(M, context)
        applied = L.one(prompt, GEN)
        self.assertEqual(outcome(applied).get("outcome"), "applied")
        self.assertEqual(outcome(applied).get("prefix_cache"), "salted")
        after = L.one(prompt, GEN, kvt={"reuse": "forbid"})
        self.assertEqual(after["num_cached_tokens"], 0, "a translated block served a plain hit")
        # Control: a plain request's own blocks do serve the next plain request.
        again = L.one(prompt, GEN, kvt={"reuse": "forbid"})
        self.assertGreater(again["num_cached_tokens"], 0)
        self.assertEqual(after["token_ids"], again["token_ids"])

    def test_d2_opt_in_shares_translated_blocks(self):
        L, M = Suite.engines["L"], Suite.engines["M"]
        context = text(CONTEXT, 26000)
        prompt = context + text(CONTINUATION, 26000 + CONTEXT)
        self.publish_via(L, context)
        applied = M.one(prompt, GEN)
        o = outcome(applied)
        self.assertEqual(o.get("outcome"), "applied", o)
        self.assertEqual(o.get("prefix_cache"), "shared")
        after = M.one(prompt, GEN, kvt={"reuse": "forbid"})
        self.assertGreaterEqual(after["num_cached_tokens"], o["tokens_reused"])
        self.assertEqual(after["token_ids"], applied["token_ids"])  # served from translated KV

    def test_e_outcome_log_lines(self):
        """Each engine logs one kvt_outcome line per request, and the counts reach vLLM's
        metrics; the test makes its own outcomes (it needs no other test to have run)."""
        M, L = Suite.engines["M"], Suite.engines["L"]
        context = text(CONTEXT, 30000)
        prompt = context + text(CONTINUATION, 30000 + CONTEXT)
        # (LLM.get_metrics names a counter family without its _total suffix.)
        def counters():
            return {k[:-len("_total")] if k.endswith("_total") else k: v
                    for k, v in L.metrics().items()}
        before = counters()
        self.publish_via(M, context)
        self.assertEqual(outcome(L.one(prompt, GEN)).get("outcome"), "applied")
        self.assertEqual(outcome(L.one(prompt, GEN, kvt={"reuse": "sometimes"})).get("outcome"),
                         "unsupported")
        for engine in Suite.engines.values():
            engine.one(prompt, 1, kvt={"reuse": "forbid"}, cache_salt=f"e-{engine.name}")
            record = last_outcome_line(engine, "forbidden")
            self.assertEqual((record["outcome"], record["reason"]),
                             ("fallback_reprefill", "forbidden"), record)
            self.assertEqual(record["model"], family.NAMES[engine.name])
        # The worker reports its counters with the next engine step's output.
        L.one(prompt[:8], 1, kvt={"reuse": "forbid"}, cache_salt="e-flush")
        after = counters()
        # publishes_in_place: kvtd read the publishes straight out of the engine's shared cache
        # (no copy in the engine, no inline chunks).
        for name in ("applied", "fallback_reprefill", "unsupported", "tokens_reused", "lookups",
                     "publishes", "publishes_in_place"):
            key = f"vllm:kvt_{name}"
            self.assertGreater(after.get(key, 0), before.get(key, 0), (name, after))


    def test_f_every_reason_a_request_can_be_steered_into(self):
        """The outcome reasons of docs/VLLM.md that a request can be steered into, each
        produced. rescheduled, not_loaded and not_scheduled come from vLLM's scheduling (an
        allocation that failed, an abort), not from a request's parameters:
        //tests/vllm:scheduler_outcomes_test produces them through the scheduler side."""
        M, L = Suite.engines["M"], Suite.engines["L"]
        context = text(CONTEXT, 34000)
        prompt = context + text(CONTINUATION, 34000 + CONTEXT)
        self.publish_via(M, context)

        def reason(result, want_outcome="fallback_reprefill"):
            o = outcome(result)
            self.assertEqual(o.get("outcome"), want_outcome, o)
            return o.get("reason")

        # The connector's too_short: not one whole block before the token vLLM computes itself.
        self.assertEqual(reason(L.one(prompt[:32], GEN, cache_salt="f-short")), "too_short")
        # kvtd's too_short: a stored prefix, but fewer tokens than the request's min_tokens.
        few = L.one(prompt, GEN, kvt={"min_tokens": 2 * len(prompt)}, cache_salt="f-few")
        self.assertEqual(reason(few), "too_short")
        # local_prefix_cache: the engine's own prefix cache already holds what kvtd offers (a
        # plain run without a salt leaves its blocks there).
        L.one(prompt, GEN, kvt={"reuse": "forbid"})
        self.assertEqual(reason(L.one(prompt, GEN)), "local_prefix_cache")
        # prefix_cache_skipped: prompt_logprobs with vLLM's default skip_reading_prefix_cache,
        # decided before any lookup (no lease is taken).
        lookups = L.metrics().get("vllm:kvt_lookups", 0)
        skipped = L.one(prompt, GEN, prompt_logprobs=0, skip_reading_prefix_cache=None,
                        cache_salt="f-plp")
        self.assertEqual(reason(skipped, "unsupported"), "prefix_cache_skipped")
        L.one(prompt[:8], 1, kvt={"reuse": "forbid"}, cache_salt="f-flush")  # counters reported
        self.assertEqual(L.metrics().get("vllm:kvt_lookups", 0), lookups)
        # disabled: a kvtd whose prefix cache is off.
        stop_kvtd()
        start_kvtd(family.kvtd_yaml(os.path.join(WORK, "kvtd-off.yaml"),
                                    prefix_cache_enabled=False))
        try:
            self.assertEqual(reason(L.one(prompt, GEN, cache_salt="f-off")), "disabled")
        finally:
            stop_kvtd()
            start_kvtd()
        # verification_sample: kvtd's live verification samples every applicable lookup
        # (fraction 1): the request prefills itself, so its output is the plain run's, and its
        # prompt publish is what kvtd compares the translation with.
        stop_kvtd()
        start_kvtd(family.kvtd_yaml(os.path.join(WORK, "kvtd-verify.yaml"),
                                    verify_sample_fraction=1.0))
        try:
            self.publish_via(M, context)  # a fresh kvtd holds nothing yet
            sampled = L.one(prompt, GEN, cache_salt="f-verify")
            self.assertEqual(reason(sampled), "verification_sample")
            plain_run = L.one(prompt, GEN, kvt={"reuse": "forbid"}, cache_salt="f-verify-plain")
            self.assertEqual(sampled["token_ids"], plain_run["token_ids"])
        finally:
            stop_kvtd()
            start_kvtd()


class MechanicsTest(unittest.TestCase):
    """The connector's vLLM mechanics on engine L against the real kvtd, through identity mappers
    (family.identity_mapper: kvt-tiny-L-twin -> kvt-tiny-L, W = I, b = 0; real mapper files kvtd
    serves like fitted ones), which makes equalities testable independently of any fitted
    mapper's quality. The test publishes L's own cache of the prompt, computed by transformers,
    under the twin's name; then

      * reusing it through the connector (LookupPrefix, TranslateKV of the lease, paged scatter
        into the request's blocks) gives the tokens of a plain run and its log-probabilities
        within float rounding (transformers' and vLLM's kernels differ in the last bits);
      * the same through the zero-V identity changes the output (the load is really used);
      * a translation failing after the scheduler committed the tokens (kvtd restarted with a
        1 ms prefix_cache.lease_seconds: the lease is gone when TranslateKV comes) goes through
        vLLM's load-failure path (recompute): the output equals a plain run;
      * kvtd stopped (SIGSTOP) while publishes queue up: the bounded queue drops and counts,
        and every request is served;
      * what engine L publishes (copied from its paged blocks into the worker's publish region,
        read there by kvtd) is L's own cache: read back through the reverse identity
        (kvt-tiny-L -> the twin), it equals transformers' cache of the prompt within float
        rounding.
    A lookup past its deadline and the salting of translated blocks are tests c1 and d1.
    """

    PROMPT = list(b"The Python tutorial: an informal introduction. Numbers, strings and lists; "
                  b"control flow with if, for and while; functions with default arguments. " * 3)
    IDENTITY = {"mapper_id": "Ltwin-to-L"}
    ZERO_V = {"mapper_id": "Ltwin-to-L-zero-v"}

    @classmethod
    def setUpClass(cls):
        cls.engine = Suite.engines["L"]
        # The reference: a plain run.
        cls.reference = plain(cls.engine, cls.PROMPT, logprobs=5)

    def publish_twin(self):
        """L's cache of PROMPT (transformers, fp32) published under the twin's name."""
        member = R.Member(family.model_dir("L"))
        with torch.no_grad():
            out = member.hf(input_ids=torch.tensor([self.PROMPT]), use_cache=True)
        cache = adapters.from_dynamic_cache(out.past_key_values, dtype="fp32")
        with kvt.Client(Suite.kvtd.address, timeout=60) as c:
            PrefixCache(c).publish(family.TWIN_L, self.PROMPT, cache)
            family.wait_for_entries(c, family.TWIN_L, self.PROMPT)

    def run_salted(self, salt, kvt_params):
        return self.engine.one(self.PROMPT, GEN, cache_salt=f"mech-{salt}", logprobs=5,
                               kvt=kvt_params)

    def assert_like_reference(self, r):
        self.assertEqual(r["token_ids"], self.reference["token_ids"])
        for got, want in zip(r["logprobs"], self.reference["logprobs"]):
            for token, value in want.items():
                self.assertAlmostEqual(got[token], value, places=3)

    def test_own_cache_through_the_identity_mapper_equals_a_plain_run(self):
        """Every load path puts each element where L's attention kernels read it: in place
        (kvtd writes the blocks), the load region (the worker copies), inline chunks."""
        self.publish_twin()
        for load, transport in (("auto", "in_place"), ("region", "shm"), ("inline", "inline")):
            r = self.run_salted(f"exact-{load}", {**self.IDENTITY, "load": load})
            o = outcome(r)
            self.assertEqual(o.get("outcome"), "applied", o)
            self.assertEqual(o["transport"], transport, o)
            self.assertEqual(o["source_model"], family.TWIN_L)
            self.assertEqual(o["tokens_reused"], (len(self.PROMPT) - 1) // 32 * 32)
            self.assertEqual(r["num_cached_tokens"], o["tokens_reused"])
            self.assert_like_reference(r)

    def test_zeroed_values_change_the_output(self):
        self.publish_twin()
        r = self.run_salted("zero", self.ZERO_V)
        self.assertEqual(outcome(r).get("outcome"), "applied", outcome(r))
        self.assertEqual(outcome(r)["mapper_id"], self.ZERO_V["mapper_id"])
        self.assertNotEqual(r["logprobs"], self.reference["logprobs"])

    def test_translate_failing_after_the_commit_recomputes(self):
        stop_kvtd()
        start_kvtd(family.kvtd_yaml(os.path.join(WORK, "kvtd-lease.yaml"), lease_seconds=0.001))
        try:
            self.publish_twin()
            r = self.run_salted("fail", self.IDENTITY)
            o = outcome(r)
            self.assertEqual(o.get("outcome"), "fallback_reprefill", o)
            self.assertEqual(o.get("reason"), "translate_failed", o)
            self.assertIn("lease", o.get("detail", ""), o)
            self.assertEqual(r["num_cached_tokens"], 0)  # vLLM recomputed the whole prompt
            self.assert_like_reference(r)
        finally:
            stop_kvtd()
            start_kvtd()

    def test_engine_publish_through_shared_memory_is_its_own_cache(self):
        before = self.engine.metrics().get("vllm:kvt_publishes_in_place", 0)
        prompt = list(b"Shared memory publish: " * 4) + self.PROMPT[:100]
        with kvt.Client(Suite.kvtd.address, timeout=60) as c:
            known = family.entry_ids(c, family.NAMES["L"])
            self.engine.one(prompt, 2, kvt={"reuse": "forbid"}, cache_salt="mech-publish")
            family.wait_for_entries(c, family.NAMES["L"], prompt, exclude=known)
            hit = PrefixCache(c).lookup(family.TWIN_L, prompt, mapper_id="L-to-Ltwin",
                                        max_tokens=len(prompt) - 1, policy="force")
            self.assertTrue(hit.hit, hit)
            got = c.translate_cached(hit.lease_id, hit.mapper_id, hit.matched_tokens,
                                     dtype=DTYPE_NAMES[hit.dtype], output_dtype="fp32").target
        # The worker reports its counters with the next engine step's output.
        self.engine.one(self.PROMPT[:8], 1, kvt={"reuse": "forbid"}, cache_salt="mech-flush")
        self.assertGreater(self.engine.metrics().get("vllm:kvt_publishes_in_place", 0), before)
        member = R.Member(family.model_dir("L"))
        with torch.no_grad():
            out = member.hf(input_ids=torch.tensor([prompt]), use_cache=True)
        want = adapters.from_dynamic_cache(out.past_key_values, dtype="fp32").to_layout("NHD")
        got = got.to_layout("NHD")
        n = hit.matched_tokens
        for layer in range(want.num_layers):
            for ours, theirs in ((got.k[layer], want.k[layer]), (got.v[layer], want.v[layer])):
                np.testing.assert_allclose(np.asarray(ours)[:n], np.asarray(theirs)[:n],
                                           rtol=1e-3, atol=1e-3)

    def test_publish_queue_full_drops_and_counts(self):
        before = self.engine.metrics().get("vllm:kvt_publish_dropped", 0)
        pid = Suite.kvtd._process.pid
        os.kill(pid, signal.SIGSTOP)  # kvtd takes no publish: the publisher waits on the first
        wait_stopped(pid)
        try:
            prompts = [list(f"{i:03d} ".encode()) + self.PROMPT[:160] for i in range(12)]
            results = self.engine.generate([
                {"prompt": p, "max_tokens": 4, "kvt": {"reuse": "forbid"},
                 "cache_salt": f"mech-queue-{i}"} for i, p in enumerate(prompts)])
        finally:
            os.kill(pid, signal.SIGCONT)
        self.assertEqual(len(results), 12)  # every request served
        for r in results:
            self.assertEqual(outcome(r).get("reason"), "forbidden")
        # 12 publishes against a publisher stuck on the first and a queue of 8: some dropped.
        after = self.engine.metrics().get("vllm:kvt_publish_dropped", 0)
        self.assertGreater(after, before)
        self.assertTrue(self.engine.log_lines("publish queue full"))


if __name__ == "__main__":
    unittest.main(verbosity=2)
