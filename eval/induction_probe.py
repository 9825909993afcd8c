#!/usr/bin/env python3
"""Why the long-range goals the evaluation misses stay missed: two probes of one mapped cache,
on the evaluation's windows (docs/EVAL.md, "Two probes of the remaining gaps").

    bazel build //eval:induction_probe && PATH=$PWD/.venv/bin:$PATH \
        bazel-bin/eval/induction_probe --store=/tmp/kvt-eval/store key-scale \
        --pair=M:L --mapper=M-to-L-k2-w4-mlp-refined --layer=5 --scales=0:1.15,0:1.3

key-scale: multiplies one KV head's mapped keys at one target layer (the target's induction
layer, retention.copy_layer_probe's finding) by a factor, the rest of the translated cache
unchanged, and reports the long-range share on the copy windows beside the benefit recovered
and the KL to the target's own distribution on today's windows. Scaling a head's keys scales
its attention logits: it asks whether the mapped induction keys lose the copy by being too flat
(a temperature) or by pointing at the wrong tokens.

layer-mix: serves two mappers of one pair (the plain and the refined ridge) and measures every
mix, layer l from the refined one when l is in the subset, on today's windows (benefit
recovered, KL). Since the refinement's loss is a sum over target layers, it finds the layers
where the refinement trades benefit for KL, and whether a per-layer choice could keep both.

own-no-rope: the target's own cache served without its RoPE (keys rotated back to content
space, as the evaluation's no-target-RoPE ablation serves a mapped cache), at every layer and at
one layer at a time, on the copy, lookup and today's windows. It asks how far the ablation can
collapse at all: a mapper can only lose more than the target's own keys do. No mapper, no
kvtd: `--store` is not needed.

A research tool; nothing here is served.
"""

import argparse
import itertools
import os

import numpy as np
import torch

import kvt
import intervals
import retention as R


def ce_and_kl(target, layers, window, context, own_logp=None):
    """(mean NLL of the continuation, mean KL(own || layers)) for one window."""
    cont, tgt = window[context:-1], window[context + 1:]
    logp = target.continuation_logprobs(layers, cont)
    kl = float(R.kl_of(own_logp, logp).mean()) if own_logp is not None else float("nan")
    return float(np.mean(R.nll_of(logp, tgt))), kl


def scale_head(cache, layer, head, factor):
    """`cache` with head `head`'s keys at `layer` multiplied by `factor`."""
    out = list(cache)
    k, v = cache[layer]
    k = k.clone()
    k[:, head] *= factor
    out[layer] = (k, v)
    return out


def benefit(ce, key):
    """Benefit recovered by `key` from per-window CE lists."""
    return intervals.benefit_of({k: np.mean(ce[k]) for k in ("own", "none", key)}, key)


def key_scale(client, source, target, args):
    scales = [(int(h), float(f)) for h, f in (x.split(":") for x in args.scales.split(","))]
    conditions = [("mapped", None)] + [(f"head {h} x {f}", (h, f)) for h, f in scales]
    context = args.context
    copies, controls = R.copy_windows(context, args.continuation, args.windows, seed=0)
    today = R.heldout_windows(context + args.continuation + 1, args.windows)
    ce = {}
    kl = {}
    for group, windows in (("copy", copies), ("control", controls), ("today", today)):
        for w in windows:
            own = target.prefill(w[:context])
            own_logp = target.continuation_logprobs(own, w[context:-1])
            mapped = R.translate(client, args.mapper, source.prefill(w[:context]))
            caches = {"own": own, "none": None}
            for name, scale in conditions:
                caches[name] = mapped if scale is None else scale_head(mapped, args.layer, *scale)
            for name, layers in caches.items():
                c, d = ce_and_kl(target, layers, w, context, own_logp)
                ce.setdefault((group, name), []).append(c)
                kl.setdefault((group, name), []).append(d)
    gain = {name: np.mean(ce[("control", name)]) - np.mean(ce[("copy", name)])
            for name in ["own"] + [n for n, _ in conditions]}
    today_ce = {name: ce[("today", name)] for name in ["own", "none"] + [n for n, _ in conditions]}
    print(f"{args.pair} {args.mapper}, layer {args.layer}; {args.windows} copy windows and "
          f"{args.windows} of today's; own copy gain {gain['own']:.3f} nats/byte")
    print("| keys | long-range share (copy) | benefit recovered (today's) | KL to own (today's) |")
    print("|---|---|---|---|")
    for name, _ in conditions:
        print(f"| {name} | {gain[name] / gain['own']:.3f} | {benefit(today_ce, name):.3f} | "
              f"{np.mean(kl[('today', name)]):.4f} |")


def layer_mix(client, source, target, args):
    plain, refined = args.mappers.split(",")
    layers = target.layers
    subsets = [s for r in range(layers + 1) for s in itertools.combinations(range(layers), r)]
    context = args.context
    ce = {}
    kl = {}
    for w in R.heldout_windows(context + args.continuation + 1, args.windows):
        own = target.prefill(w[:context])
        own_logp = target.continuation_logprobs(own, w[context:-1])
        source_cache = source.prefill(w[:context])
        a = R.translate(client, plain, source_cache)
        b = R.translate(client, refined, source_cache)
        caches = {"own": own, "none": None}
        for s in subsets:
            caches[s] = [b[i] if i in s else a[i] for i in range(layers)]
        for name, cache in caches.items():
            c, d = ce_and_kl(target, cache, w, context, own_logp)
            ce.setdefault(name, []).append(c)
            kl.setdefault(name, []).append(d)
    print(f"{args.pair}: layers from {refined}, the others from {plain}; {args.windows} of "
          f"today's windows")
    print("| refined layers | benefit recovered | KL to own |")
    print("|---|---|---|")
    for s in subsets:
        label = ", ".join(map(str, s)) if s else "none"
        print(f"| {label} | {benefit(ce, s):.3f} | {np.mean(kl[s]):.4f} |")


def own_no_rope(target, args):
    context = args.context
    # The evaluation's long-range windows (run_eval --long_windows, seed 0) and today's.
    groups = {kind: make(context, args.continuation, args.long_windows, seed=0)
              for kind, make in (("copy", R.copy_windows), ("lookup", R.lookup_windows))}
    today = R.heldout_windows(context + args.continuation + 1, args.windows)
    labels = ["all"] + [f"layer {l}" for l in range(target.layers)]

    def caches(w):
        own = target.prefill(w[:context])
        stripped = R.strip_target_rope(target, own)
        out = {"own": own, "all": stripped}
        for l in range(target.layers):
            out[f"layer {l}"] = [stripped[i] if i == l else own[i] for i in range(target.layers)]
        return out

    def nll(w, layers):
        return float(np.mean(target.continuation_nll(layers, w[context:-1], w[context + 1:])))

    ce = {kind: {} for kind in ("copy", "lookup", "today")}
    for kind, (windows, controls) in groups.items():
        for prefix, group in (("", windows), ("control_", controls)):
            for w in group:
                for name, layers in caches(w).items():
                    ce[kind].setdefault(prefix + name, []).append(nll(w, layers))
    for w in today:  # benefit recovered also needs no context; the shares do not
        for name, layers in {**caches(w), "none": None}.items():
            ce["today"].setdefault(name, []).append(nll(w, layers))

    def cell(estimate):
        value, low, high = estimate
        return f"{value:.3f} [{low:.3f}, {high:.3f}]"

    print(f"{target.name}: its own cache without the target RoPE; {args.long_windows} copy and "
          f"lookup windows, {args.windows} of today's; 95% paired intervals over the windows")
    print("| RoPE stripped at | copy share | lookup share | benefit recovered (today's) |")
    print("|---|---|---|---|")
    for label in labels:
        print(f"| {label} | {cell(intervals.share_interval(ce['copy'], label))} | "
              f"{cell(intervals.share_interval(ce['lookup'], label))} | "
              f"{cell(intervals.benefit_interval(ce['today'], label))} |")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="",
                   help="a mapper store (run_eval's <work>/store); key-scale and layer-mix")
    p.add_argument("--family", default=R.MODELS)
    p.add_argument("--pair", required=True,
                   help="source:target members, e.g. M:L (own-no-rope reads the target alone)")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    sub = p.add_subparsers(dest="probe", required=True)
    ks = sub.add_parser("key-scale")
    ks.add_argument("--mapper", required=True)
    ks.add_argument("--layer", type=int, required=True, help="target layer")
    ks.add_argument("--scales", required=True, help="head:factor,... (KV heads)")
    lm = sub.add_parser("layer-mix")
    lm.add_argument("--mappers", required=True, help="plain,refined mapper ids of the pair")
    nr = sub.add_parser("own-no-rope")
    nr.add_argument("--long_windows", type=int, default=32,
                    help="copy and lookup windows each (the evaluation's 32)")
    args = p.parse_args()
    caller = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd())
    torch.set_num_threads(1)
    a, b = args.pair.split(":")
    source = R.Member(os.path.join(args.family, a))
    target = R.Member(os.path.join(args.family, b))
    if args.probe == "own-no-rope":
        own_no_rope(target, args)
        return
    if not args.store:
        raise SystemExit(f"induction_probe {args.probe}: give --store")
    args.store = os.path.join(caller, args.store)
    with R.start_kvtd(args.store) as server, kvt.Client(server.address, timeout=120) as client:
        (key_scale if args.probe == "key-scale" else layer_mix)(client, source, target, args)


if __name__ == "__main__":
    main()
