#!/usr/bin/env python3
"""Does kvtd's quality gate keep its promise? (docs/EVAL.md, "The gate against the evaluation")

For every mapper that eval/second_source.py evaluated (its --out JSON lines: the ridge of each
ordered pair, MLPs, refined MLPs, fitted into its --work store), this program qualifies a copy
of the mapper the way an operator would (kvt.qualify on two texts, `kvt record-benefit` into the
copy's manifest), asks a real kvtd with its default configuration whether it would serve the
pair (a source prefix published, the target's LookupPrefix: the gate's verdict), and sets that
verdict beside the benefit the evaluation measured on its own windows of both sources. The
promise is that no mapper whose measured benefit is below prefix_cache.min_benefit_recovered
passes.

The qualification texts are the evaluation's two sources with their documents in reverse order,
so the windows spread over them are other cuts of the same text than the evaluation's windows:
the gate is checked on windows it was not qualified on.

    bazel build //eval:gate_check //cli:kvt
    PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/gate_check --work=/tmp/kvt-source2 \\
        --results=/tmp/kvt-source2/results.jsonl --out=/tmp/kvt-source2/gate.jsonl \\
        --md=/tmp/kvt-source2/gate.md
"""

import argparse
import json
import os
import shutil
import time

import torch

import kvt
import license_text
import retention as R
import second_source
from kvt import adapters, qualify
from kvt.prefix import PrefixCache
from kvt_testing.runfiles import runfile

FLOOR = 0.5  # kvtd's default prefix_cache.min_benefit_recovered (server/kvtd.yaml)


def reversed_texts(work, licenses_dir):
    """[(name, path)]: the held-out documents and the kept license texts, each in reverse order,
    as JSON lines kvt.qualify reads."""
    kept, _ = license_text.select(license_text.read_texts(licenses_dir),
                                  second_source.corpus_grams())
    return [("python-docs-heldout", R.write_split(
                "heldout", os.path.join(work, "heldout-reversed.jsonl"), reverse=True)),
            ("debian-licenses", R.write_documents(
                os.path.join(work, "licenses-reversed.jsonl"), [t for _, t in kept][::-1]))]


def verdict(store, source, target, context):
    """kvtd's gate verdict (default configuration, source-cache tier on) on the one mapper in
    `store`, for a held-out prefix the source published."""
    config = os.path.join(store, "..", "kvtd-gate.yaml")
    with open(config, "w") as f:
        f.write("prefix_cache:\n  enabled: true\n")
    ctx = R.heldout_windows(context + 1, 1)[0][:context]
    with R.start_kvtd(store, config) as server, kvt.Client(server.address, timeout=60) as client:
        prefix = PrefixCache(client)
        prefix.publish(source.name, ctx, adapters.from_torch(source.prefill(ctx)))
        hit = prefix.lookup(target.name, ctx)
    return hit.gate


def check(row, args, texts, members, kvt_binary):
    """Qualifies, records and asks kvtd about one evaluated mapper; the table row."""
    a, b = row["pair"].split("->")
    _, suffix, _ = second_source.KINDS[row["kind"]]
    mid = f"{a}-to-{b}-k2{suffix}"
    store = os.path.join(args.work, "gate", mid, "store")
    shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    shutil.copytree(os.path.join(args.work, "store", mid), os.path.join(store, mid))
    t0 = time.time()
    with R.start_kvtd(store) as server:
        result = qualify.qualify(server.address, mid, members[a].dir, members[b].dir, texts,
                                 tokenizer="bytes", windows=args.windows, context=args.context,
                                 continuation=args.continuation)
    qualify.record(result, os.path.join(store, mid), kvt_binary)
    gate = verdict(store, members[a], members[b], args.context)
    measured = {s: row[s]["mapped"][0] for s in second_source.SOURCES}
    return {"pair": row["pair"], "kind": row["kind"], "mapper_id": mid,
            "qualified": {e["text"]: [round(e[k], 4) for k in ("recovered", "lower95",
                                                                 "upper95")]
                          for e in result["benefit"]},
            "gate_passed": gate.passed, "gate_reason": gate.reason,
            "cosine_bound": round(gate.mapper_quality, 4),
            "measured": measured,
            "broken_promise": gate.passed and min(measured.values()) < FLOOR,
            "seconds": round(time.time() - t0, 1)}


def table(rows):
    order = {p: i for i, p in enumerate(second_source.PAIRS.replace(":", "->").split(","))}
    rows = sorted(rows, key=lambda r: (list(second_source.KINDS).index(r["kind"]),
                                       order.get(r["pair"], 99)))
    lines = ["| pair | mapper | qualified: Python docs (reversed) | qualified: licenses "
             "(reversed) | kvtd's gate | evaluation: own held-out | evaluation: licenses |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        q = [r["qualified"][t] for t in ("python-docs-heldout", "debian-licenses")]
        gate = "**serves**" if r["gate_passed"] else "refuses (" + (
            "benefit" if "benefit" in r["gate_reason"] else "cosine") + ")"
        lines.append("| " + " | ".join(
            [r["pair"], r["kind"]] + [f"{x[0]:.2f} [{x[1]:.3f}, {x[2]:.2f}]" for x in q] +
            [gate] + [f"{r['measured'][s]:.2f}" for s in second_source.SOURCES]) + " |")
    broken = [r for r in rows if r["broken_promise"]]
    lines += ["", f"{sum(r['gate_passed'] for r in rows)} of {len(rows)} mappers served; "
              f"served with a measured benefit below {FLOOR} on either source: "
              f"{len(broken)}" + (" (" + ", ".join(f"{r['pair']} {r['kind']}" for r in broken)
                                  + ")" if broken else "") + "."]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="eval/second_source.py's --work")
    p.add_argument("--results", required=True, help="eval/second_source.py's --out")
    p.add_argument("--out", required=True, help="JSON lines, one per mapper (appended)")
    p.add_argument("--md", default="")
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--licenses", default=license_text.DIRECTORY)
    args = p.parse_args()
    caller = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd())
    args.work = os.path.join(caller, args.work)
    out_path = os.path.join(caller, args.out)
    torch.set_num_threads(1)
    evaluated = second_source.read_rows(os.path.join(caller, args.results))
    done = {(r["pair"], r["kind"]) for r in second_source.read_rows(out_path)}
    texts = reversed_texts(args.work, args.licenses)
    members = {m: R.Member(os.path.join(R.MODELS, m)) for m in "SMLU"}
    kvt_binary = runfile("cli/kvt")
    for row in evaluated:
        if (row["pair"], row["kind"]) in done:
            continue
        result = check(row, args, texts, members, kvt_binary)
        with open(out_path, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"gate_check: {result['pair']} {result['kind']}: qualified {result['qualified']} "
              f"gate {'serves' if result['gate_passed'] else 'refuses'}; measured "
              f"{result['measured']} ({result['seconds']:.0f} s)", flush=True)
    if args.md:
        with open(os.path.join(caller, args.md), "w") as f:
            f.write(table(second_source.read_rows(out_path)))


if __name__ == "__main__":
    main()
