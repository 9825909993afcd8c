#!/usr/bin/env python3
"""Side by side: `kvt fit` variants of each ordered pair, measured as docs/EVAL.md measures.

    bazel build //eval:compare_fits && PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/compare_fits \
        --work=/tmp/kvt-compare --pairs=M:S,S:L \
        --variants='{"ridge": [], "refined": ["--refine=attention"]}'

Per pair and variant (a label and the extra `kvt fit` flags; k = 2, stride 1, one thread): the
fit's wall time, then, served by one kvtd, the context benefit recovered on the evaluation's
held-out windows (retention.evaluate_kinds: 16 windows of 384 + 96 bytes), the perplexity ratio
and kvtd's attention-output cosine per target layer; with --long_windows also the long-range
share on that many copy and lookup windows (docs/EVAL.md's measure), each figure with its 95%
paired bootstrap interval over the windows, and with --baseline each variant's difference from
that variant with its interval (16 windows resolve little: docs/EVAL.md, "How sure"). --kind=mlp fits every
variant as an MLP at the eval's budget (retention.MLP_FLAGS). The tool behind docs/FIT.md's
comparison of refinement objectives and docs/EVAL.md's refinement-budget table; a JSON line per
pair and variant on stdout. --mappers evaluates mappers fitted before (run_eval's store, another
--work) beside or instead of fitted variants, e.g. the same kind from two calibration sizes;
--reference compares them paired with conditions of an earlier run on the same windows (e.g.
docs/eval/per_window.json's token identity), and --per_window_out keeps this run's per-window CE
for the next.
"""

import argparse
import json
import os
import shutil
import time

import torch

import kvt
from kvt import adapters
import intervals
import retention as R


def kvt_fit(dumps, members, a, b, out, kind, extra):
    """retention.fit of one variant (k = 2, stride 1; kind mlp: the eval's MLP budget);
    returns its wall time."""
    start = time.time()
    R.fit(dumps[a], dumps[b], members[a].name, members[b].name, 2, out, kind=kind, extra=extra)
    return time.time() - start


def layer_cosines(client, source, target, mapper_id, windows, context):
    """Mean attention-output cosine per target layer (ValidateKV) over `windows`."""
    per = []
    for ids in windows:
        own, queries = target.prefill(ids[:context], queries=True)
        v = client.validate(adapters.from_torch(source.prefill(ids[:context])),
                            adapters.from_torch(own),
                            adapters.from_torch([(q, q) for q in queries]), mapper_id=mapper_id)
        per.append([layer.attention_cosine for layer in v.layers])
    return [round(sum(c) / len(c), 4) for c in zip(*per)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default=R.MODELS)
    p.add_argument("--pairs", required=True, help="SOURCE:TARGET,...")
    p.add_argument("--variants", default="{}",
                   help='JSON {label: [extra kvt fit flags]}, e.g. {"ridge": []}')
    p.add_argument("--mappers", default="{}",
                   help='JSON {label: mapper directory} of mappers fitted before (no fit, '
                        'e.g. by run_eval or another --work); "{a}" and "{b}" in a path are '
                        'each pair\'s source and target, e.g. '
                        '{"c64": "/tmp/kvt-eval/store/{a}-to-{b}-k2-w4-mlp-refined"}')
    p.add_argument("--work", required=True)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--kind", default="ridge", choices=("ridge", "mlp"),
                   help="kvt fit --kind of every variant (mlp: retention.MLP_FLAGS, the eval's)")
    p.add_argument("--long_windows", type=int, default=0,
                   help="also the long-range share on this many copy and lookup windows each "
                        "(retention.copy_windows, lookup_windows, seed 0, as docs/EVAL.md)")
    p.add_argument("--calib_windows", type=int, default=64,
                   help="calibration windows of 512 bytes each member dumps (the evaluation's "
                        "64 unless more data is the variable)")
    p.add_argument("--baseline", default="",
                   help="a variant label: every other variant also gets its difference from it "
                        "(benefit, copy and lookup share) with a 95% paired bootstrap interval "
                        "over the windows (eval/intervals.py)")
    p.add_argument("--reference", default="",
                   help="an earlier run's per-window CE (run_eval's docs/eval/per_window.json, or "
                        "--per_window_out of this tool) on the same windows (checked): its "
                        "--reference_labels are compared paired with every variant")
    p.add_argument("--reference_labels", default="identity",
                   help="conditions of --reference, comma-separated (e.g. identity,w_mlp_refined"
                        "); each reported as ref_LABEL, and each variant's difference from it")
    p.add_argument("--per_window_out", default="",
                   help="write this run's per-window CE here, in docs/eval/per_window.json's shape")
    args = p.parse_args()
    caller = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd())
    work = os.path.join(caller, args.work)
    os.makedirs(work, exist_ok=True)
    torch.set_num_threads(1)
    pairs = [tuple(x.split(":")) for x in args.pairs.split(",")]
    variants = json.loads(args.variants)
    mappers = json.loads(args.mappers)
    if not variants and not mappers:
        raise SystemExit("compare_fits: give --variants or --mappers")
    if set(variants) & set(mappers):
        raise SystemExit(f"compare_fits: labels in both --variants and --mappers: "
                         f"{sorted(set(variants) & set(mappers))}")
    calib = R.write_split("calib", os.path.join(work, "calib.jsonl"))
    members, dumps = {}, {}
    for m in sorted({x for pair in pairs for x in pair}):
        members[m] = R.Member(os.path.join(args.family, m))
        if not variants:  # --mappers alone: nothing to fit, no dumps
            continue
        dumps[m] = R.dump(members[m].dir, calib, os.path.join(work, "dumps", m), 512,
                          args.calib_windows,
                          queries=True)
    store = os.path.join(work, "store")
    seconds = {}
    for a, b in pairs:
        for label, extra in variants.items():
            seconds[(a, b, label)] = kvt_fit(dumps, members, a, b,
                                             os.path.join(store, f"{a}-to-{b}-{label}"),
                                             args.kind, extra)
        for label, pattern in mappers.items():
            source_dir = pattern.replace("{a}", a).replace("{b}", b)
            if not os.path.exists(os.path.join(source_dir, "manifest.yaml")):
                raise SystemExit(f"--mappers {label}: {source_dir} holds no mapper")
            dest = os.path.join(store, f"{a}-to-{b}-{label}")
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(source_dir, dest)
            seconds[(a, b, label)] = None  # fitted elsewhere
    reference = {}
    if args.reference:
        with open(os.path.join(caller, args.reference)) as f:
            reference = json.load(f)
    ref_labels = [x for x in args.reference_labels.split(",") if x] if reference else []
    per_window = {"kinds": {}, "long_range": {"copy": {}, "lookup": {}}}
    windows = R.heldout_windows(args.context + args.continuation + 1, args.windows)
    with R.start_kvtd(store) as server, kvt.Client(server.address, timeout=120) as client:
        for a, b in pairs:
            ids = {label: f"{a}-to-{b}-{label}" for label in list(variants) + list(mappers)}
            r = R.evaluate_kinds(client, members[a], members[b], ids, windows, args.context)
            long_range, long_ce = {}, {}
            for name, make in (("copy", R.copy_windows), ("lookup", R.lookup_windows)):
                if args.long_windows > 0:
                    w, c = make(args.context, args.continuation, args.long_windows)
                    lr = R.evaluate_long_range(client, members[a], members[b], ids, w, c,
                                               args.context)
                    long_range[name], long_ce[name] = lr["long_range"], lr["per_window"]["ce"]
            ce = r["per_window"]["ce"]
            per_window["kinds"][f"{a}->{b}"] = {"ce": ce}
            for name, x in long_ce.items():
                per_window["long_range"][name][f"{a}->{b}"] = {"ce": x}
            if ref_labels:
                ce, long_ce = with_reference(reference, f"{a}->{b}", ref_labels, ce, long_ce)
                for label in ref_labels:
                    print(json.dumps({
                        "pair": f"{a}->{b}", "variant": "ref_" + label,
                        "benefit_interval": rounded(intervals.benefit_interval(ce, "ref_" + label)),
                        **{f"{name}_share_interval": rounded(
                            intervals.share_interval(x, "ref_" + label))
                           for name, x in long_ce.items()}}), flush=True)
            for label, mid in ids.items():
                sure = {"benefit_interval": rounded(intervals.benefit_interval(ce, label)),
                        **{f"{name}_share_interval": rounded(intervals.share_interval(x, label))
                           for name, x in long_ce.items()}}
                if args.baseline in ids and label != args.baseline:
                    sure[f"benefit_minus_{args.baseline}"] = rounded(
                        intervals.benefit_gap(ce, label, args.baseline))
                    for name, x in long_ce.items():
                        sure[f"{name}_share_minus_{args.baseline}"] = rounded(
                            intervals.share_gap(x, label, args.baseline))
                for ref in ref_labels:
                    sure[f"benefit_minus_ref_{ref}"] = rounded(
                        intervals.benefit_gap(ce, label, "ref_" + ref))
                    for name, x in long_ce.items():
                        sure[f"{name}_share_minus_ref_{ref}"] = rounded(
                            intervals.share_gap(x, label, "ref_" + ref))
                print(json.dumps({
                    "pair": f"{a}->{b}", "variant": label, "fit_seconds": (
                        None if seconds[(a, b, label)] is None
                        else round(seconds[(a, b, label)], 2)),
                    "benefit": round(r[label]["benefit"], 4),
                    "ppl_ratio": round(r[label]["ppl_ratio"], 4),
                    "kl": round(r[label]["kl"], 4),
                    **{f"{name}_share": round(v[label], 3) for name, v in long_range.items()},
                    "attention_cosine": round(r[label]["validate"]["attention_cosine"], 4),
                    "layer_cosines": layer_cosines(client, members[a], members[b], mid,
                                                   windows[:4], args.context),
                    **sure}), flush=True)
    if args.per_window_out:
        with open(os.path.join(caller, args.per_window_out), "w") as f:
            json.dump(per_window, f, separators=(",", ":"))


def with_reference(reference, pair, labels, ce, long_ce):
    """This pair's per-window CE with `labels` of the reference run attached (ref_LABEL), on
    today's windows (the reference's k = 2 pair and kind figures) and each long-range kind; the
    windows are checked to be the same (intervals.attach_reference)."""
    pairs = reference.get("pairs", {})
    # Token identity reads the target's own bytes, so any pair into the same target has it (the
    # evaluation measures it on its matched pairs only; write_eval_md.identity_of does the same).
    into_target = [name for name in pairs
                   if name.endswith(f"->{pair.split('->')[1]} k=2") and name != f"{pair} k=2"]
    today = {**({"identity": pairs[into_target[0]]["ce"]["identity"]} if into_target else {}),
             **pairs.get(f"{pair} k=2", {}).get("ce", {}),
             **reference.get("kinds", {}).get(pair, {}).get("ce", {})}
    if not today:
        raise SystemExit(f"--reference: no per-window CE for {pair}")
    try:
        ce = intervals.attach_reference(ce, today, labels)
        long_ce = {name: intervals.attach_reference(
            x, reference["long_range"][name][pair]["ce"], labels)
            for name, x in long_ce.items()}
    except (KeyError, ValueError) as e:
        raise SystemExit(f"--reference, {pair}: {e}")
    return ce, long_ce


def rounded(interval):
    """(estimate, low, high) rounded for the JSON line."""
    return [round(x, 4) for x in interval]


if __name__ == "__main__":
    main()
