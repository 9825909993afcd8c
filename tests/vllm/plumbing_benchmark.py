#!/usr/bin/env python3
"""How much of the connector's tax is vLLM's and how much is KvtConnector's (docs/VLLM.md, "What
the connector costs").

Three engines of kvt-tiny-L side by side, as tax_benchmark runs two: `plain` (no KV connector),
`null` (tests/vllm/null_connector.py: a connector that does nothing, so the engine pays only
vLLM's connector plumbing: its per-step hooks, the per-layer wrapper, the connector output of
every step) and `kvt` (KvtConnector with its documented defaults, reuse forbidden). Each
repetition sends one fresh prompt to each engine in rotating order, after a pause so that no
engine's idle spinning overlaps another's request. Printed: each connector engine's median
latency against the plain engine's, the ratio of the medians and the median of the per-repetition
ratios with its 95% interval (repetitions resampled), and KvtConnector against the null one.
One shape, many repetitions on one set of engines; `tax_benchmark --null` splits the tax the same
way for every shape, over rounds of fresh engines.

    PATH=$PWD/.venv/bin:$PATH bazel run //tests/vllm:plumbing_benchmark -- [--repeat=40]
        [--shape=256/64] [--config='{"publish": false}']
"""

import argparse
import json
import os
import statistics
import tempfile

import engines as E
import family
from tax_benchmark import Prompts, measure_latency, paired_interval, warm_up

NAMES = ("plain", "null", "kvt")


def compare(walls, name, base):
    mine, theirs = statistics.median(walls[name]), statistics.median(walls[base])
    paired, low, high = paired_interval(walls[base], walls[name])
    print(f"  {name} / {base}: {mine:.1f} / {theirs:.1f} ms ({mine - theirs:+.1f} ms), "
          f"ratio of medians {mine / theirs:.3f}x, paired {paired:.3f}x [{low:.3f}, {high:.3f}]")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--shape", default="256/64", help="prompt tokens / generated tokens")
    parser.add_argument("--config", default="{}", help="KvtConnector extra config overrides")
    parser.add_argument("--settle_s", type=float, default=1.2)
    args = parser.parse_args()
    prompt_tokens, generated = map(int, args.shape.split("/"))
    work = tempfile.mkdtemp(prefix="kvt-plumbing-")
    os.makedirs(os.path.join(work, "store"))
    port = E.free_port()
    config = {"kvtd_address": f"127.0.0.1:{port}", "model_name": family.NAMES["L"],
              **json.loads(args.config)}
    kvtd = family.start_kvtd(os.path.join(work, "store"), port,
                             family.kvtd_yaml(os.path.join(work, "kvtd.yaml"))).__enter__()
    engines = {name: E.Engine(name, family.model_dir("L"), config if name == "kvt" else {},
                              work, max_model_len=2048, no_connector=name == "plain",
                              null_connector=name == "null") for name in NAMES}
    texts = Prompts()
    try:
        E.start_engines(list(engines.values()))
        warm_up(engines, texts)
        walls = measure_latency(engines, texts, args, ("plain", "null", "forbid"),
                                shapes=[(prompt_tokens, generated)])[f"{prompt_tokens}/{generated}"]
        walls["kvt"] = walls.pop("forbid")
    finally:
        for engine in engines.values():
            engine.stop()
        kvtd.__exit__(None, None, None)
    print(f"{args.shape} on kvt-tiny-L, {args.repeat} repetitions, engines side by side "
          f"(KvtConnector config {args.config}, reuse forbidden):")
    compare(walls, "null", "plain")
    compare(walls, "kvt", "plain")
    compare(walls, "kvt", "null")


if __name__ == "__main__":
    main()
