#!/usr/bin/env python3
"""The k = 2 mapper's context benefit recovered on a second text source next to the family's own
held-out windows (docs/EVAL.md, "A second text source"): the ridge, or with --kind=mlp the MLP.

    bazel build //eval:second_source && PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/second_source \
        --work=/tmp/kvt-source2 --out=/tmp/kvt-source2/results.jsonl --md=/tmp/kvt-source2/table.md

Per ordered pair (all 12 of S, M, L, U unless --pairs): the plain ridge (or the MSE-trained MLP),
k = 2, fitted as run_eval fits it (retention.fit: `kvt fit`, stride 1, one thread, on run_eval's
calibration dumps with the target's queries, --calib_windows windows of --calib_tokens bytes),
served by one kvtd
(CPU backend, one thread), scored by retention.evaluate_pair on two sets of windows of the same
geometry (--context + --continuation + 1 bytes): the family's held-out windows (run_eval's) and
windows of Debian's license texts (eval/license_text.py: texts whose word 8-grams mostly occur
in the Python documentation, or in a license kept before them, are left out). Per source and
pair: the benefit recovered by the translated cache and by the token-identity control (ridge
from the current and previous byte, fitted on the calibration windows) with 95% paired bootstrap
intervals (eval/intervals.py), and the target's own context gain CE_none - CE_own. Per mapper:
the manifest's quality.attention_cosine_heldout_lower95 and whether kvtd's quality gate
(--gate, server/kvtd.yaml min_mapper_quality) passes it. A JSON line per pair goes to --out
(appended; pairs already there are skipped), then the Markdown table of every pair in --out to
--md.
"""

import argparse
import json
import os
import time

import torch
import yaml

import corpus  # eval/tinyfamily
import dump_kv  # tools/dump_kv.py
import intervals
import kvt
import license_text
import retention as R

PAIRS = ",".join(f"{a}:{b}" for a in "SMLU" for b in "SMLU" if a != b)
SOURCES = ("own", "licenses")
# --kind: (kvt fit --kind, mapper id suffix, --refine=attention)
KINDS = {"ridge": ("ridge", "", False), "mlp": ("mlp", "-mlp", False),
         "mlp_refined": ("mlp", "-mlp-refined", True)}


def corpus_grams():
    """Word 8-grams of every Python documentation source (all splits: the license windows must
    be independent of the training text too)."""
    grams = set()
    for split in corpus.splits().values():
        for d in split:
            grams |= license_text.word_grams(d["text"])
    return grams


def read_rows(path):
    """The JSON lines of a results file ([] when it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def rounded(interval):
    return [round(x, 4) for x in interval]


def gate_bound(mapper_dir):
    """The manifest's one-sided 95% lower bound of the held-out attention cosine (None if not
    recorded)."""
    with open(os.path.join(mapper_dir, "manifest.yaml")) as f:
        return (yaml.safe_load(f).get("quality") or {}).get("attention_cosine_heldout_lower95")


def table(rows, gate):
    """Markdown: one line per pair and kind, benefit [95% interval] per source for the mapper,
    token identity and their paired difference, the own context gain, the gate's bound and
    verdict."""
    order = {p: i for i, p in enumerate(PAIRS.replace(":", "->").split(","))}
    rows = sorted(rows, key=lambda r: (list(KINDS).index(r.get("kind", "ridge")),
                                       order.get(r["pair"], 99)))

    def cell(x):
        b, lo, hi = x
        mark = "" if lo <= 0 <= hi else " *"
        return f"{b:.2f} [{lo:.2f}, {hi:.2f}]{mark}"
    head = "| pair | mapper | gate bound (>= %.2f?) |" % gate + "".join(
        f" {s}: mapper | {s}: token identity | {s}: mapper - identity | {s}: gain |"
        for s in SOURCES)
    lines = [head, "|" + "---|" * (3 + 4 * len(SOURCES))]
    for r in rows:
        g = r["gate_bound"]
        gcell = "n/a" if g is None else f"{g:.3f} ({'pass' if g >= gate else 'fail'})"
        cells = [r["pair"], r.get("kind", "ridge"), gcell]
        for s in SOURCES:
            x = r[s]
            cells += [cell(x["mapped"]), cell(x["identity"]), cell(x["mapped_minus_identity"]),
                      f"{x['own_gain']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Benefit recovered [95% paired bootstrap interval] (mapper - identity: "
                 "the paired difference); * the interval excludes 0. "
                 "Gain: CE_none - CE_own, nats/byte. Gate bound: the manifest's "
                 "attention_cosine_heldout_lower95 against kvtd's min_mapper_quality, the cosine "
                 "half of the gate (its benefit half: eval/gate_check.py).")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default=R.MODELS)
    p.add_argument("--pairs", default=PAIRS)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True, help="JSON lines, one per pair (appended)")
    p.add_argument("--md", default="", help="the Markdown table of every pair in --out")
    p.add_argument("--calib_windows", type=int, default=256)
    p.add_argument("--calib_tokens", type=int, default=512)
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--licenses", default=license_text.DIRECTORY)
    p.add_argument("--gate", type=float, default=0.87, help="kvtd's min_mapper_quality")
    p.add_argument("--kind", default="ridge", choices=tuple(KINDS),
                   help="mlp: the MSE-trained MLP (kvt fit --kind mlp, retention.MLP_FLAGS, no "
                        "refinement; minutes per pair) instead of the ridge; mlp_refined: that "
                        "MLP refined on the target's attention outputs (--refine=attention, its "
                        "default budget), the kind `kvt fit --kind both` recommends on every "
                        "pair of docs/EVAL.md")
    args = p.parse_args()
    caller = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd())
    work = os.path.join(caller, args.work)
    out_path = os.path.join(caller, args.out)
    os.makedirs(work, exist_ok=True)
    torch.set_num_threads(1)
    start = time.time()
    pairs = [tuple(x.split(":")) for x in args.pairs.split(",") if x]
    done = {(r["pair"], r.get("kind", "ridge")) for r in read_rows(out_path)}

    length = args.context + args.continuation + 1
    kept, selection = license_text.select(license_text.read_texts(args.licenses),
                                          corpus_grams())
    tok = dump_kv.ByteTokenizer()
    windows = {"own": R.heldout_windows(length, args.windows),
               "licenses": license_text.spread_windows(
                   license_text.stream(kept, tok.encode, tok.eos_token_id), length,
                   args.windows)}
    print(f"second_source: licenses kept {[n for n, _ in kept]}; "
          f"{len(windows['licenses'])} windows", flush=True)

    calib = R.write_split("calib", os.path.join(work, "calib.jsonl"))
    names = sorted({x for pair in pairs for x in pair})
    members, dumps = {}, {}
    for m in names:
        members[m] = R.Member(os.path.join(args.family, m))
        # Every member's dump carries its queries (kvt fit records the gate's cosine bound from
        # the target's), whatever --pairs: the dumps of runs with other --pairs are the same
        # files, so runs in one --work never rewrite a dump another run's fit is reading.
        dumps[m] = R.dump(members[m].dir, calib, os.path.join(work, "dumps", m),
                          args.calib_tokens, args.calib_windows, queries=True)
    calib_windows = R.calib_windows(args.calib_tokens, args.calib_windows)
    store = os.path.join(work, "store")
    identity = {}
    for a, b in pairs:
        name = f"{a}->{b}"
        if (name, args.kind) in done:
            continue
        t0 = time.time()
        fit_kind, suffix, refine = KINDS[args.kind]
        mid = f"{a}-to-{b}-k2{suffix}"
        mapper_dir = os.path.join(store, mid)
        if not os.path.exists(os.path.join(mapper_dir, "manifest.yaml")):
            R.fit(dumps[a], dumps[b], members[a].name, members[b].name, 2, mapper_dir,
                  kind=fit_kind, refine=refine)
        fit_seconds = time.time() - t0
        if b not in identity:
            identity[b] = R.TokenIdentityMap(members[b], calib_windows)
        bound = gate_bound(mapper_dir)
        row = {"pair": name, "kind": args.kind, "gate_bound": bound,
               "gate_passes": bound is not None and bound >= args.gate,
               "fit_seconds": round(fit_seconds, 1)}
        with R.start_kvtd(store) as server, kvt.Client(server.address, timeout=120) as client:
            for source in SOURCES:
                r = R.evaluate_pair(client, members[a], members[b], mid, windows[source],
                                    args.context, {"identity": identity[b]})
                ce = r["per_window"]["ce"]
                row[source] = {
                    "mapped": rounded(intervals.benefit_interval(ce, "mapped")),
                    "identity": rounded(intervals.benefit_interval(ce, "identity")),
                    "mapped_minus_identity": rounded(intervals.benefit_gap(ce, "mapped",
                                                                          "identity")),
                    "benefit_first": round(r["benefit"]["mapped"]["first"], 4),
                    "own_gain": round(r["ce"]["none"]["all"] - r["ce"]["own"]["all"], 4),
                    "ce": {k: round(v["all"], 4) for k, v in r["ce"].items()},
                    "attention_cosine": round(r["validate"]["overall_without_layer0"]
                                              ["attention_cosine"], 4),
                    "windows": r["windows"]}
        row["seconds"] = round(time.time() - t0, 1)
        row["settings"] = {"calib_windows": args.calib_windows,
                           "calib_tokens": args.calib_tokens, "windows": args.windows,
                           "context": args.context, "continuation": args.continuation,
                           "licenses": [n for n, _ in kept], "license_selection": selection}
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"second_source: {name} {args.kind}: own {row['own']['mapped']} licenses "
              f"{row['licenses']['mapped']} gate {bound} ({row['seconds']:.0f} s, "
              f"{time.time() - start:.0f} s in all)", flush=True)
    if args.md:
        with open(os.path.join(caller, args.md), "w") as f:
            f.write(table(read_rows(out_path), args.gate))


if __name__ == "__main__":
    main()
