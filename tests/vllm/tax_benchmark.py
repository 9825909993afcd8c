#!/usr/bin/env python3
"""The connector's tax: what KvtConnector costs a request it does not help, measured against the
same engine without the connector, in one run (docs/VLLM.md, "What the connector costs").

Two engines of one model run side by side (--model: kvt-tiny-L by default; qwen3-0.6b, a
model of Qwen3-0.6B's shapes and architecture with random bf16 weights written at run time by
tests/vllm/qwen3_shapes.py, where a step costs what a real small model's does): `plain` (no KV
connector) and `kvt` (KvtConnector
with its documented defaults: publishing on, shared memory). kvtd runs with the source-cache
tier on and an empty mapper store (kvtd refuses the publishes: no mapper reads the model), or,
with --reader, a store whose one mapper reads the model into another name (kvtd stores every
publish); either way nothing can ever be reused. Per shape (prompt tokens x
generated tokens) and repetition, every mode gets its own fresh prompt (no engine ever hits its
own prefix cache), and the modes take turns in a rotating order:

  plain    the engine without the connector
  forbid   the connector's engine, kv_transfer_params {"kvt": {"reuse": "forbid"}} (no lookup)
  miss     the connector's engine, default reuse: a lookup that finds nothing
  null     with --null, a third engine: tests/vllm/null_connector.py, a KV connector whose hooks
           do nothing, so it pays only what vLLM's plumbing costs any connector

--null splits the tax in every round: null / plain is vLLM's share, forbid / null and miss / null
KvtConnector's own.

Each timed request follows a pause (--settle_s) so that neither engine's idle spinning from the
previous request overlaps it. Then the concurrent case: 16 requests of mixed lengths in flight at
once per engine, throughput in generated tokens per second.

--pairs=N starts a fresh pair of engines (plain and connector, side by side as above) for each
of N rounds, so that both the instance and the time of day are drawn again and every round has
its own same-time ratio.

--sequential=N runs the engines one at a time instead: N rounds, each starting a plain engine and
a connector engine in turn (the order alternating between rounds), measuring every shape and the
concurrent case on it, and stopping it. No engine's idle polling then shares the cores with
another's request, and the rounds show how much two instances of the same engine differ.

With --sequential, the report ends with what the rounds say about the ratios: each ratio's 95%
interval when engine instances are drawn again (the rounds resampled with replacement, plain and
connector instances independently), and the plain engine against itself (its even rounds against
its odd ones): how far apart two sets of instances of one engine are on this machine, the
resolution the ratios above have. --analyze=RUN.json[,RUN2.json...] prints that part again for
saved runs, pooling their rounds.

    PATH=$PWD/.venv/bin:$PATH bazel run //tests/vllm:tax_benchmark -- [--repeat=5] [--json=OUT]
        [--sequential=2 | --pairs=8] [--null] [--model=tiny-L|qwen3-0.6b] [--analyze=RUN.json]
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Callable, NamedTuple

import engines as E
import family
import qwen3_shapes as Q

SHAPES = ((256, 1), (256, 64), (1024, 1), (1024, 64))
MODES = ("plain", "forbid", "miss")
NULL_MODES = ("plain", "null", "forbid", "miss")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--settle_s", type=float, default=1.2)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--concurrent_repeat", type=int, default=3)
    parser.add_argument("--work", default="")
    parser.add_argument("--config", default="{}",
                        help="extra kv_connector_extra_config keys (JSON) for the kvt engine")
    parser.add_argument("--reader", action="store_true",
                        help="the store holds a mapper reading kvt-tiny-L (an identity map into "
                             "a twin name), so kvtd stores every publish instead of refusing it; "
                             "lookups into L still miss")
    parser.add_argument("--json", default="")
    parser.add_argument("--sequential", type=int, default=0,
                        help="rounds of one engine at a time (0: both engines side by side)")
    parser.add_argument("--pairs", type=int, default=0,
                        help="rounds of a fresh plain and connector engine side by side (their "
                             "requests interleaved), instead of one engine at a time")
    parser.add_argument("--null", action="store_true",
                        help="a third engine with a KV connector that does nothing, next to the "
                             "others in every round: vLLM's share of the tax and KvtConnector's "
                             "own, apart")
    add_model_args(parser)
    parser.add_argument("--analyze", default="",
                        help="print the instance intervals of runs saved with --json "
                             "(comma-separated: their rounds pooled); no run")
    args = parser.parse_args()
    if args.analyze:
        rounds = []
        for path in args.analyze.split(","):  # several runs pool their rounds
            with open(path) as f:
                rounds += json.load(f)["rounds"]
        print_instance_intervals(rounds)
        return 0
    work = args.work or tempfile.mkdtemp(prefix="kvt-tax-")
    store = os.path.join(work, "store")
    os.makedirs(store, exist_ok=True)
    subject = subject_of(args.model, args.models_dir or work)
    if args.reader:
        subject.reader(store)
    port = E.free_port()
    config = {"kvtd_address": f"127.0.0.1:{port}", "model_name": subject.name,
              **json.loads(args.config)}
    def make(name, round_=0):
        return E.Engine(f"{name}-{round_}", subject.path, config if name == "kvt" else {}, work,
                        max_model_len=2048, no_connector=name == "plain",
                        null_connector=name == "null", dtype=subject.dtype,
                        env={"VLLM_CPU_KVCACHE_SPACE": str(subject.kv_space_gib)})

    kvtd = family.start_kvtd(store, port,
                             family.kvtd_yaml(os.path.join(work, "kvtd.yaml"),
                                              max_bytes=subject.kvtd_bytes)).__enter__()
    texts = Prompts()
    try:
        if args.sequential or args.pairs:
            latency, throughput, outcomes, rounds = run_rounds(make, texts, args)
        else:
            engines = {name: make(name) for name in engine_names(args)}
            try:
                E.start_engines(list(engines.values()))
                warm_up(engines, texts)
                latency = measure_latency(engines, texts, args, modes_of(args))
                throughput = measure_throughput(engines, texts, args, modes_of(args))
                outcomes = engines["kvt"].metrics()
                rounds = []
            finally:
                for engine in engines.values():
                    engine.stop()
    finally:
        kvtd.__exit__(None, None, None)
    report(latency, throughput, outcomes, args, rounds, subject.label)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": subject.label, "latency": latency, "throughput": throughput,
                       "metrics": outcomes, "rounds": rounds}, f, indent=1)


def add_model_args(parser):
    """--model and --models_dir (subject_of reads them)."""
    parser.add_argument("--model", choices=("tiny-L", "qwen3-0.6b"), default="tiny-L",
                        help="the engines' model: the bundled kvt-tiny-L (float32), or "
                             "Qwen3-0.6B's shapes (bf16, random weights written under "
                             "--models_dir)")
    parser.add_argument("--models_dir", default="",
                        help="where --model=qwen3-0.6b's weights are written (kept and reused "
                             "there; default: the work directory)")


class Subject(NamedTuple):
    """The model both engines serve, and what the run needs to know of it."""
    label: str  # for the report
    name: str  # the connector's model_name, the name kvtd keys publishes by
    path: str
    dtype: str
    kv_space_gib: int  # VLLM_CPU_KVCACHE_SPACE per engine
    kvtd_bytes: int  # kvtd's prefix_cache.max_bytes
    reader: Callable[[str], str]  # writes the --reader mapper into a store


def subject_of(model: str, models_dir: str) -> Subject:
    if model == "tiny-L":
        return Subject(
            "kvt-tiny-L (float32)", family.NAMES["L"], family.model_dir("L"), "float32", 1,
            1 << 30, lambda store: family.identity_mapper(
                store, "L-to-twin", member="L", source_name=family.NAMES["L"],
                target_name=family.TWIN_L))
    name = Q.PAIR[0]  # the Qwen3-0.6B shapes; seed 1, as qwen3_benchmark writes it
    # 114 KiB of bf16 KV per token: a 1024-token publish is 117 MB, so kvtd keeps about 17.
    return Subject(
        f"{name} (Qwen3-0.6B's shapes, random weights, bf16)", name,
        Q.write_model(models_dir, name, seed=1), "bfloat16", 2, 2 << 30,
        lambda store: Q.identity_mapper(store, f"{name}-to-twin", model=name, source_name=name,
                                        target_name=name + "-twin"))


def modes_of(args):
    return NULL_MODES if args.null else MODES


def engine_names(args):
    return ("plain", "null", "kvt") if args.null else ("plain", "kvt")


def warm_up(engines, texts):
    for name, engine in engines.items():  # the first requests of an engine are slower
        for n in (256, 1024):
            engine.one(texts.take(n), 4, kvt=({"reuse": "forbid"} if name == "kvt" else None))


def run_rounds(make, texts, args):
    """Rounds of fresh engines: one at a time (--sequential) or a pair side by side (--pairs).
    Every sample of a mode is pooled over the rounds, and each round's medians kept."""
    all_modes, names_ = modes_of(args), engine_names(args)
    latency = {f"{n}/{gen}": {mode: [] for mode in all_modes} for n, gen in SHAPES}
    throughput = {mode: [] for mode in all_modes}
    outcomes, rounds = {}, []
    for r in range(args.sequential or args.pairs):
        if args.pairs:
            groups = [names_]
        else:  # one engine at a time, the order rotating between rounds
            shift = r % len(names_)
            groups = [(name,) for name in names_[shift:] + names_[:shift]]
        for names in groups:
            engines = {name: make(name, r) for name in names}
            modes = tuple(m for m in all_modes if engine_name(m) in engines)
            try:
                E.start_engines(list(engines.values()))
                warm_up(engines, texts)
                lat = measure_latency(engines, texts, args, modes)
                thr = measure_throughput(engines, texts, args, modes)
                if "kvt" in engines:
                    for key, value in engines["kvt"].metrics().items():
                        outcomes[key] = outcomes.get(key, 0) + value
            finally:
                for engine in engines.values():
                    engine.stop()
            for shape, walls in lat.items():
                for mode in modes:
                    latency[shape][mode] += walls[mode]
            for mode in modes:
                throughput[mode] += thr[mode]
            for name in names:
                mine = [m for m in modes if engine_name(m) == name]
                rounds.append({"round": r, "engine": name,
                               "latency": {shape: {m: statistics.median(w[m]) for m in mine}
                                           for shape, w in lat.items()},
                               "throughput": {m: statistics.median(thr[m]) for m in mine}})
    return latency, throughput, outcomes, rounds


class Prompts:
    """Fresh held-out prompts: no two requests share a first block, so no engine reuses its own
    prefix cache and kvtd never holds a prefix of a prompt to come."""

    def __init__(self) -> None:
        self.offset = 0
        self.rng = random.Random(0)

    def take(self, n: int):
        text = family.heldout_text(n, self.offset)
        if len(text) < n:
            self.offset = 0
            text = family.heldout_text(n, 0)
        self.offset += n + 1
        # A distinct first token per prompt: block hashes never repeat across requests.
        return [self.rng.randrange(256)] + text[1:]


def request(mode: str, prompt, max_tokens: int) -> dict:
    kvt = {"reuse": "forbid"} if mode == "forbid" else None
    return {"prompt": prompt, "max_tokens": max_tokens, "kvt": kvt,
            "ignore_eos": True}


def engine_name(mode):
    return mode if mode in ("plain", "null") else "kvt"


def engine_of(engines, mode):
    return engines[engine_name(mode)]


def measure_latency(engines, texts, args, modes, shapes=SHAPES):
    """Per shape "prompt/generated", each mode's request latencies (ms): --repeat repetitions, one
    fresh prompt per mode, the modes in an order rotating between repetitions."""
    out = {}
    for n, gen in shapes:
        walls = {mode: [] for mode in modes}
        for rep in range(args.repeat):
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]
            for mode in order:
                time.sleep(args.settle_s)
                got = engine_of(engines, mode).generate([request(mode, texts.take(n), gen)])[0]
                assert len(got["token_ids"]) == gen, got
                if engine_name(mode) == "kvt":
                    outcome = (got.get("kv_transfer_params") or {}).get("kvt", {})
                    assert outcome.get("outcome") == "fallback_reprefill", outcome
                walls[mode].append(got["wall_s"] * 1e3)
        out[f"{n}/{gen}"] = walls
    return out


def measure_throughput(engines, texts, args, modes):
    rng = random.Random(1)
    out = {mode: [] for mode in modes}
    for rep in range(args.concurrent_repeat):
        shapes = [(rng.choice((128, 256, 512, 1024)), rng.choice((16, 32, 64)))
                  for _ in range(args.concurrent)]
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]
        for mode in order:
            time.sleep(args.settle_s)
            batch = [request(mode, texts.take(n), gen) for n, gen in shapes]
            t0 = time.monotonic()
            got = engine_of(engines, mode).generate(batch)
            wall = time.monotonic() - t0
            tokens = sum(len(g["token_ids"]) for g in got)
            out[mode].append(tokens / wall)
    return out


def report(latency, throughput, metrics, args, rounds, label):
    med = statistics.median
    rounds_run = args.sequential or args.pairs
    samples = args.repeat * max(1, rounds_run)
    how = (f"engines one at a time, {args.sequential} rounds" if args.sequential
           else f"fresh engine pairs side by side, {args.pairs} rounds" if args.pairs
           else "engines side by side")
    print(f"Connector tax on {label} (vLLM CPU, block size 32, {how}, median of {samples}; "
          "request latency in ms; ratio = mode / plain; publishes "
          f"{'stored' if args.reader else 'refused (no mapper reads the model)'})")
    others = [m for m in modes_of(args) if m != "plain"]
    print("| prompt / generated | plain engine | " + " | ".join(f"{m} | ratio" for m in others)
          + " |")
    print("|---|---:|" + "---:|---:|" * len(others))
    for shape, walls in latency.items():
        plain = med(walls["plain"])
        cells = [f"{plain:.1f}"]
        for mode in others:
            value = med(walls[mode])
            cells += [f"{value:.1f}", f"{value / plain:.3f}x ({value - plain:+.1f} ms)"]
        print(f"| {shape} | " + " | ".join(cells) + " |")
    plain = med(throughput["plain"])
    print(f"\n{args.concurrent} requests in flight, mixed lengths (128-1024 prompt, 16-64 "
          f"generated), generated tokens/s, median of "
          f"{args.concurrent_repeat * max(1, rounds_run)}")
    print("| plain engine | " + " | ".join(f"{m} | ratio" for m in others) + " |")
    print("|---:|" + "---:|---:|" * len(others))
    cells = [f"{plain:.0f}"]
    for mode in others:
        value = med(throughput[mode])
        cells += [f"{value:.0f}", f"{value / plain:.3f}x"]
    print("| " + " | ".join(cells) + " |")
    for r in rounds:
        print(f"round {r['round']} {r['engine']}: " + ", ".join(
            f"{shape} " + "/".join(f"{v:.1f}" for v in medians.values())
            for shape, medians in r["latency"].items())
            + " ms; tokens/s " + "/".join(f"{v:.0f}" for v in r["throughput"].values()))
    print("\nconnector counters:", {k.replace("vllm:kvt_", ""): v for k, v in metrics.items()
                                     if v})
    if len(rounds) >= 4:
        print_instance_intervals(rounds)


def round_medians(rounds, engine, cell, mode):
    """Per round of `engine`, its median of `mode` in `cell` (a shape, or "throughput")."""
    out = []
    for r in rounds:
        if r["engine"] != engine:
            continue
        values = r["throughput"] if cell == "throughput" else r["latency"][cell]
        out.append(values[mode])
    return out


def interval(plain, other, draws=4000, seed=7):
    """Median-of-rounds ratio other / plain and its 95% percentile interval, the instances of
    each engine drawn again with replacement."""
    med = statistics.median
    rng = random.Random(seed)
    ratios = sorted(med(rng.choices(other, k=len(other))) / med(rng.choices(plain, k=len(plain)))
                    for _ in range(draws))
    return med(other) / med(plain), ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def paired_interval(plain, other, draws=4000, seed=7):
    """Median over rounds of each round's ratio other / plain (the two engines of a round ran
    next to each other in time), with its 95% interval over rounds drawn again."""
    med = statistics.median
    ratios = [o / p for o, p in zip(other, plain)]
    rng = random.Random(seed)
    drawn = sorted(med(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return med(ratios), drawn[int(0.025 * draws)], drawn[int(0.975 * draws) - 1]


def print_instance_intervals(rounds):
    med = statistics.median
    cells = list(rounds[0]["latency"]) + ["throughput"]
    n = sum(r["engine"] == "plain" for r in rounds)
    print(f"\nInstance intervals ({n} instances per engine; ratio of the medians of the rounds' "
          "medians, 95% interval with the instances resampled; paired: median of each round's "
          "own ratio, rounds resampled) and the plain engine against itself (even rounds / odd "
          "rounds):")
    print("| cell | forbid / plain | miss / plain | paired forbid | paired miss "
          "| plain even / plain odd |")
    print("|---|---:|---:|---:|---:|---:|")
    for cell in cells:
        plain = round_medians(rounds, "plain", cell, "plain")
        row = [cell + (" (tokens/s)" if cell == "throughput" else " (ms)")]
        for how in (interval, paired_interval):
            for mode in ("forbid", "miss"):
                ratio, low, high = how(plain, round_medians(rounds, "kvt", cell, mode))
                row.append(f"{ratio:.3f}x [{low:.2f}, {high:.2f}]")
        row.append(f"{med(plain[0::2]) / med(plain[1::2]):.3f}x")
        print("| " + " | ".join(row) + " |")
    if any(r["engine"] == "null" for r in rounds):
        print_null_split(rounds, cells)


def print_null_split(rounds, cells):
    """vLLM's share (the do-nothing connector against the plain engine) and KvtConnector's own
    (against the do-nothing connector), each round's own ratio: median and 95% interval."""
    print("\nThe tax split, paired by round (vLLM's plumbing: null / plain; KvtConnector's own: "
          "forbid / null, miss / null):")
    print("| cell | null / plain | forbid / null | miss / null |")
    print("|---|---:|---:|---:|")
    for cell in cells:
        null = round_medians(rounds, "null", cell, "null")
        pairs = ((round_medians(rounds, "plain", cell, "plain"), null),
                 (null, round_medians(rounds, "kvt", cell, "forbid")),
                 (null, round_medians(rounds, "kvt", cell, "miss")))
        row = [cell + (" (tokens/s)" if cell == "throughput" else " (ms)")]
        for base, other in pairs:
            ratio, low, high = paired_interval(base, other)
            row.append(f"{ratio:.3f}x [{low:.2f}, {high:.2f}]")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    sys.exit(main())
