"""Two evaluation runs on the same windows, compared kind by kind with paired intervals.

run_eval writes each run's per-window CE (docs/eval/per_window.json). When a later run refits
the mappers with other settings (more calibration windows, another budget) but scores them on
the same held-out and long-range windows, the difference per pair and kind is paired: this tool
reports benefit recovered on today's windows and the long-range share on each long-range kind,
before -> after, with the 95% paired interval of after - before (eval/intervals.py), and counts
per kind where the change is beyond noise. The windows are checked to be the same
(intervals.attach_reference: the target's own, no-context and control CE agree window by window).

    bazel build //eval:compare_runs && bazel-bin/eval/compare_runs --before=<old per_window.json> \
        --after=docs/eval/per_window.json

(the bootstrap is kvt.intervals: run through Bazel, or with the kvt package on PYTHONPATH.)
"""

import argparse
import json
import sys

import numpy as np

import intervals

KINDS = ("ridge", "ridge_refined", "mlp", "mlp_refined",
         "w_ridge", "w_ridge_refined", "w_mlp", "w_mlp_refined")
KIND_NAMES = {"ridge": "ridge", "ridge_refined": "ridge refined", "mlp": "MLP",
              "mlp_refined": "MLP refined", "w_ridge": "window ridge",
              "w_ridge_refined": "window ridge refined", "w_mlp": "window MLP",
              "w_mlp_refined": "window MLP refined"}
BEFORE = "before_"


def compare(before, after, kinds=KINDS):
    """{measure: {pair: {kind: (before, after, gap, low, high)}}} for every pair and kind both
    runs scored; measure is "benefit" (today's windows) or "<long-range kind> share"."""
    out = {}
    for pair, entry in after["kinds"].items():
        if pair not in before.get("kinds", {}):
            continue
        rows = _gaps(entry["ce"], before["kinds"][pair]["ce"], kinds, intervals.benefit_of,
                     intervals.benefit_gap)
        if rows:
            out.setdefault("benefit", {})[pair] = rows
    for window_kind, pairs in after.get("long_range", {}).items():
        for pair, entry in pairs.items():
            theirs = before.get("long_range", {}).get(window_kind, {}).get(pair)
            if theirs is None:
                continue
            rows = _gaps(entry["ce"], theirs["ce"], kinds, intervals.share_of,
                         intervals.share_gap)
            if rows:
                out.setdefault(f"{window_kind} share", {})[pair] = rows
    return out


def _gaps(ce, before_ce, kinds, measure, gap):
    """Per kind (before, after, after - before, low, high): measure (intervals.benefit_of or
    share_of) on all windows of each run, the change with its paired interval."""
    shared = [k for k in kinds if k in ce and k in before_ce]
    if not shared:
        return {}
    both = intervals.attach_reference(ce, before_ce, shared, prefix=BEFORE)
    means = {key: float(np.mean(values)) for key, values in both.items()}
    rows = {}
    for kind in shared:
        est, low, high = gap(both, kind, BEFORE + kind)
        rows[kind] = (measure(means, BEFORE + kind), measure(means, kind), est, low, high)
    return rows


def counts(rows):
    """{kind: (above, below, tie)} over the pairs of one measure."""
    out = {}
    for per_kind in rows.values():
        for kind, (_, _, _, low, high) in per_kind.items():
            tally = out.setdefault(kind, [0, 0, 0])
            tally[("above", "below", "tie").index(intervals.verdict(low, high))] += 1
    return {kind: tuple(v) for kind, v in out.items()}


def markdown(result, before_label="before", after_label="after"):
    lines = []
    for measure, rows in result.items():
        kinds = [k for k in KINDS if any(k in r for r in rows.values())]
        lines += [f"\n{measure}, {before_label} -> {after_label}, and the change with its 95% "
                  "paired interval:\n",
                  "| pair | " + " | ".join(KIND_NAMES[k] for k in kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        for pair, per_kind in rows.items():
            cells = []
            for kind in kinds:
                if kind not in per_kind:
                    cells.append("-")
                    continue
                b, a, est, low, high = per_kind[kind]
                mark = {"above": " **up**", "below": " **down**", "tie": ""}[
                    intervals.verdict(low, high)]
                cells.append(f"{b:.3f} -> {a:.3f} ({est:+.3f} [{low:+.3f}, {high:+.3f}]{mark})")
            lines.append(f"| {pair} | " + " | ".join(cells) + " |")
        tallies = counts(rows)
        lines.append("\nBeyond noise: " + "; ".join(
            f"{KIND_NAMES[k]} up on {tallies[k][0]}, down on {tallies[k][1]}" for k in kinds)
            + f" (of {len(rows)} pairs).")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the earlier run's per_window.json")
    p.add_argument("--after", required=True, help="the later run's per_window.json")
    p.add_argument("--before_label", default="before")
    p.add_argument("--after_label", default="after")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to compare")
    p.add_argument("--json_out", default="", help="also write the figures here")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"--kinds: unknown {unknown}; known {list(KINDS)}")
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    try:
        result = compare(before, after, kinds)
    except ValueError as e:
        sys.exit(f"compare_runs: {e}")
    if not result:
        sys.exit("compare_runs: the two runs share no pair and kind")
    sys.stdout.write(markdown(result, args.before_label, args.after_label))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
