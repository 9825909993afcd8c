#!/usr/bin/env python3
"""Head-local (per_head) ridge next to the full-layer (per_layer) ridge, measured as docs/EVAL.md
measures, on the evaluation's own windows.

    bazel build //eval:per_head_eval && PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/per_head_eval \
        --work=/tmp/kvt-perhead --calib_windows=256 --out=/tmp/kvt-perhead/results.jsonl \
        --reference=docs/eval/per_window.json

Per ordered pair (all 12 of S, M, L, U unless --pairs): one `kvt fit --granularity=both` (k = 2,
stride 1, one thread, the default objective) on run_eval's calibration dumps (the same
calibration windows, so its per_layer half is run_eval's plain ridge, checked against the
reference run's per-window CE when --reference is given), and the same fit from the untrained
source (the untrained-source control of each granularity). Served by one kvtd per pair (CPU
backend, one thread), then on the held-out windows (retention.evaluate_kinds) and on the copy
and lookup windows (retention.evaluate_long_range, seed 0): benefit recovered, KL to own, the
long-range shares and the no-target-RoPE ablation of each granularity, with 95% paired bootstrap
intervals (eval/intervals.py) and the paired difference per_head - per_layer; the mapper weight
bytes of each (the safetensors files); the translate time (median over repeats on
--timing_windows contexts, the two mappers alternating: the client's wall time of TranslateKV
over gRPC and kvtd's own compute_ms; --retime measures it again for all pairs in one pass); and
`kvt fit --granularity both`'s recommendation. Token identity depends on the target only: the
reference run's figure applies (docs/EVAL.md's ridge tables). A JSON line per pair goes to
--out (appended, so a run cut off keeps its finished pairs; pairs already there are skipped).
"""

import argparse
import json
import os
import shutil
import statistics
import time

import numpy as np
import torch

import kvt
from kvt import adapters
import intervals
import retention as R

PAIRS = ",".join(f"{a}:{b}" for a in "SMLU" for b in "SMLU" if a != b)
LABELS = ("ridge", "ridge_per_head")
HALVES = {"ridge": "per_layer", "ridge_per_head": "per_head"}


def weight_bytes(mapper_dir):
    """Bytes of a mapper's tensor files (weights and biases)."""
    return sum(os.path.getsize(os.path.join(mapper_dir, f)) for f in os.listdir(mapper_dir)
               if f.endswith(".safetensors"))


def fit_both(dumps, members, source, a, b, work, store, flags=(), tag=""):
    """`kvt fit --granularity=both` (and `flags`) of source -> b; both halves copied into the
    store as {a}-to-{b}-k2 and ...-per-head. Returns (fit_report, wall seconds)."""
    out = os.path.join(work, "both" + tag, f"{a}-to-{b}")
    t0 = time.time()
    R.fit(dumps[a], dumps[b], source.name, members[b].name, 2, out,
          extra=["--granularity=both"] + list(flags))
    seconds = time.time() - t0
    for half, tail in (("per_layer", ""), ("per_head", "-per-head")):
        dest = os.path.join(store, f"{a}-to-{b}-k2{tail}")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(os.path.join(out, half), dest)
    with open(os.path.join(out, "fit_report.json")) as f:
        return json.load(f), seconds


def translate_ms(client, source, ids, windows, context, repeats):
    """Per mapper label the median over repeats of one TranslateKV: the client's wall time
    ("wall", gRPC and staging included) and kvtd's own compute_ms ("compute", the translation
    arithmetic, from the trailer's StageTimings), in ms; the labels alternate on the same source
    caches."""
    caches = [source.prefill(w[:context]) for w in windows]
    wall = {label: [] for label in ids}
    compute = {label: [] for label in ids}
    for cache in caches:  # warm-up: the first request of a mapper loads it
        for mid in ids.values():
            R.translate(client, mid, cache)
    for _ in range(repeats):
        for cache in caches:
            request = adapters.from_torch(cache)
            for label, mid in ids.items():
                t0 = time.perf_counter()
                result = client.translate(request, mapper_id=mid)
                wall[label].append((time.perf_counter() - t0) * 1e3)
                compute[label].append(result.trailer.timings.compute_ms)
    return {"wall": {label: round(statistics.median(t), 3) for label, t in wall.items()},
            "compute": {label: round(statistics.median(t), 4) for label, t in compute.items()}}


def retime(args, work, out_path, members, windows):
    """--retime: the translate timing of every pair already in --out, again, one pair after
    another on the mappers in --work's store (the same pass for all pairs); rewrites --out."""
    with open(out_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        a, b = row["pair"].split("->")
        ids = {"ridge": f"{a}-to-{b}-k2", "ridge_per_head": f"{a}-to-{b}-k2-per-head"}
        store = os.path.join(work, "store" + args.tag, f"{a}-to-{b}")
        with R.start_kvtd(store) as server, kvt.Client(server.address, timeout=120) as client:
            t = translate_ms(client, members[a], ids, windows[:args.timing_windows],
                             args.context, args.timing_repeats)
        row["translate_ms"], row["compute_ms"] = t["wall"], t["compute"]
        print(f"per_head_eval: {row['pair']}: translate ms {t}", flush=True)
    with open(out_path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def kl_gap(kl, better, worse):
    """KL(better) - KL(worse) over the windows with its 95% paired bootstrap interval."""
    return intervals.paired_bootstrap({better: kl[better], worse: kl[worse]},
                                      lambda m: m[better] - m[worse])


def reference_diff(ce, theirs, label="ridge"):
    """The largest per-window CE difference between this run's per_layer ridge and the
    reference run's `label` (its ridge, or ridge_refined for --fit_flags=["--refine=attention"])
    on the same windows (checked by intervals.attach_reference), or the
    reason it cannot be compared."""
    if theirs is None:
        return "no reference for this pair"
    try:
        both = intervals.attach_reference(ce, theirs, [label])
    except ValueError as e:
        return str(e)
    return float(np.max(np.abs(np.asarray(both["ridge"]) - np.asarray(both["ref_" + label]))))


def rounded(interval):
    return [round(x, 4) for x in interval]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default=R.MODELS)
    p.add_argument("--pairs", default=PAIRS)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True, help="JSON lines, one per pair (appended)")
    p.add_argument("--calib_windows", type=int, default=256)
    p.add_argument("--calib_tokens", type=int, default=512)
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--long_windows", type=int, default=32)
    p.add_argument("--timing_windows", type=int, default=8)
    p.add_argument("--timing_repeats", type=int, default=5)
    p.add_argument("--fit_flags", default="[]",
                   help='JSON list of more `kvt fit` flags for both granularities and their '
                        'controls, e.g. ["--refine=attention"]')
    p.add_argument("--tag", default="",
                   help="suffix of --work's fit and store folders, so that fits with other "
                        "--fit_flags share the dumps, e.g. -refined")
    p.add_argument("--reference_label", default="ridge",
                   help="the --reference condition the per_layer half is checked against "
                        "(ridge_refined with --fit_flags='[\"--refine=attention\"]')")
    p.add_argument("--retime", action="store_true",
                   help="only measure the translate time again for every pair in --out, on "
                        "the mappers in --work's store, and rewrite --out")
    p.add_argument("--reference", default="",
                   help="run_eval's per_window.json on the same windows: the per_layer ridge "
                        "here is checked against its ridge, window by window")
    args = p.parse_args()
    caller = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd())
    work = os.path.join(caller, args.work)
    out_path = os.path.join(caller, args.out)
    os.makedirs(work, exist_ok=True)
    torch.set_num_threads(1)
    pairs = [tuple(x.split(":")) for x in args.pairs.split(",") if x]
    done = set()
    if os.path.exists(out_path):
        with open(out_path) as f:
            done = {json.loads(line)["pair"] for line in f if line.strip()}
    reference = {}
    if args.reference:
        with open(os.path.join(caller, args.reference)) as f:
            reference = json.load(f)
    calib = R.write_split("calib", os.path.join(work, "calib.jsonl"))
    names = sorted({x for pair in pairs for x in pair})
    members, untrained, dumps = {}, {}, {}
    targets = {b for _, b in pairs}
    for m in names:
        members[m] = R.Member(os.path.join(args.family, m))
        dumps[m] = R.dump(members[m].dir, calib, os.path.join(work, "dumps", m),
                          args.calib_tokens, args.calib_windows, queries=m in targets)
    for s in sorted({a for a, _ in pairs}):
        udir = R.make_untrained(members[s].dir, os.path.join(work, "untrained", s))
        untrained[s] = R.Member(udir)
        dumps[s + "0"] = R.dump(udir, calib, os.path.join(work, "dumps", s + "0"),
                                args.calib_tokens, args.calib_windows)
    windows = R.heldout_windows(args.context + args.continuation + 1, args.windows)
    long_range = {}
    if args.long_windows > 0:
        long_range = {
            "copy": R.copy_windows(args.context, args.continuation, args.long_windows),
            "lookup": R.lookup_windows(args.context, args.continuation, args.long_windows)}
    if args.retime:
        retime(args, work, out_path, members, windows)
        return
    for a, b in pairs:
        name = f"{a}->{b}"
        if name in done:
            continue
        t0 = time.time()
        store = os.path.join(work, "store" + args.tag, f"{a}-to-{b}")
        flags = json.loads(args.fit_flags)
        report, fit_seconds = fit_both(dumps, members, members[a], a, b, work, store, flags,
                                       args.tag)
        _, control_seconds = fit_both(dumps, members, untrained[a], a + "0", b, work, store,
                                      flags, args.tag)
        ids = {"ridge": f"{a}-to-{b}-k2", "ridge_per_head": f"{a}-to-{b}-k2-per-head"}
        control_ids = {label + "_untrained": mid.replace(f"{a}-to-", f"{a}0-to-")
                       for label, mid in ids.items()}
        row = {"pair": name, "fit_flags": flags, "fit_seconds": round(fit_seconds, 1),
               "control_fit_seconds": round(control_seconds, 1),
               "recommended": report["recommended"],
               "fit_cosine": {label: report[HALVES[label]]["attention_cosine_without_layer0"]
                              for label in LABELS
                              if "attention_cosine_without_layer0" in report[HALVES[label]]},
               "fit_per_head_minus_per_layer": report["per_head_minus_per_layer"],
               "bytes": {label: weight_bytes(os.path.join(store, mid))
                         for label, mid in ids.items()}}
        with R.start_kvtd(store) as server, kvt.Client(server.address, timeout=120) as client:
            r = R.evaluate_kinds(client, members[a], members[b], {**ids, **control_ids}, windows,
                                 args.context, {label: untrained[a] for label in control_ids})
            ce, kl = r["per_window"]["ce"], r["per_window"]["kl"]
            row["ce"] = r["ce"]
            row["kl_none"] = r["kl"]["none"]
            for label in list(ids) + list(control_ids):
                x = r[label]
                row[label] = {
                    "benefit": rounded(intervals.benefit_interval(ce, label)),
                    "benefit_first": round(x["benefit_first"], 4),
                    "kl": round(x["kl"], 4), "kl_first": round(x["kl_first"], 4),
                    "ppl_ratio": round(x["ppl_ratio"], 4),
                    "attention_cosine": round(x["validate"]["attention_cosine"], 4),
                    "c_k": round(x["validate"]["c_k"], 4),
                    "benefit_no_target_rope": round(x["benefit_no_target_rope"], 4),
                    "kl_no_target_rope": round(x["kl_no_target_rope"], 4)}
            row["per_head_minus_per_layer"] = {
                "benefit": rounded(intervals.benefit_gap(ce, "ridge_per_head", "ridge")),
                "kl": rounded(kl_gap(kl, "ridge_per_head", "ridge"))}
            if reference:
                row["reference_ridge_max_abs_ce_diff"] = reference_diff(
                    ce, reference["kinds"].get(name, {}).get("ce"), args.reference_label)
            for kind, (lw, lc) in long_range.items():
                lr = R.evaluate_long_range(client, members[a], members[b], ids, lw, lc,
                                           args.context, None,
                                           {label: (untrained[a], control_ids[label + "_untrained"])
                                            for label in ids})
                lce = lr["per_window"]["ce"]
                for label in list(ids) + [x + "_untrained" for x in ids] + [
                        x + R.NO_ROPE for x in ids]:
                    row.setdefault(f"{kind}_share", {})[label] = rounded(
                        intervals.share_interval(lce, label))
                row[f"{kind}_share_per_head_minus_per_layer"] = rounded(
                    intervals.share_gap(lce, "ridge_per_head", "ridge"))
                row[f"{kind}_copy_gain_own"] = round(lr["copy_gain"]["own"], 4)
                if reference:
                    row[f"{kind}_reference_ridge_max_abs_ce_diff"] = reference_diff(
                        lce, reference.get("long_range", {}).get(kind, {}).get(name, {})
                        .get("ce"), args.reference_label)
            t = translate_ms(client, members[a], ids, windows[:args.timing_windows],
                             args.context, args.timing_repeats)
            row["translate_ms"], row["compute_ms"] = t["wall"], t["compute"]
        row["seconds"] = round(time.time() - t0, 1)
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"per_head_eval: {name}: benefit per_layer {row['ridge']['benefit'][0]:.3f} "
              f"per_head {row['ridge_per_head']['benefit'][0]:.3f}, recommended "
              f"{row['recommended']} ({row['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
