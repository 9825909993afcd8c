#!/usr/bin/env python3
"""Markdown tables of eval/per_head_eval.py's results (docs/EVAL.md, "Head-local (per_head)
ridge"): numpy-free, so the rendering is tested without the models.

    python3 eval/per_head_md.py docs/eval/per_head.jsonl

Prints two tables: per pair and granularity the measures with their 95% intervals; per pair the
paired difference per_head - per_layer, the bytes and time ratios, `kvt fit --granularity
both`'s recommendation and whether the measurement agrees with it (measured_choice).
"""

import json
import sys

ORDER = [f"{a}->{b}" for a in "SMLU" for b in "SMLU" if a != b]
GRANULARITY = {"ridge": "per_layer", "ridge_per_head": "per_head"}


def load(path):
    """The JSON lines of per_head_eval, in the evaluation's pair order."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: ORDER.index(r["pair"]) if r["pair"] in ORDER else 99)


def interval(x, digits=3):
    """[estimate, low, high] -> "0.123 [0.100, 0.150]"."""
    e, lo, hi = x
    return f"{e:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def signed(x, digits=3):
    e, lo, hi = x
    return f"{e:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def verdict(x):
    """"above" / "below" when the whole interval is on one side of 0, else "tie"."""
    _, lo, hi = x
    return "above" if lo > 0 else "below" if hi < 0 else "tie"


def measured_choice(row):
    """per_layer where per_head loses beyond noise on benefit recovered (interval below 0) or
    on KL to own (interval above 0); per_head (the cheaper map) otherwise: the recommendation's
    rule, applied to what the target does with the translated cache."""
    gap = row["per_head_minus_per_layer"]
    if verdict(gap["benefit"]) == "below" or verdict(gap["kl"]) == "above":
        return "per_layer"
    return "per_head"


def compute_of(row, label):
    """kvtd's compute_ms of a label, or "-" where the row has none."""
    c = row.get("compute_ms")
    return f"{c[label]:.3f}" if c else "-"


def compute_ratio(row):
    c = row.get("compute_ms")
    return f"{c['ridge_per_head'] / c['ridge']:.2f}" if c and c["ridge"] > 0 else "-"


def measures_table(rows):
    out = ["| pair | granularity | benefit recovered [95%] (first 16) | KL to own (first 16) | "
           "copy share [95%] | lookup share [95%] | untrained source: benefit / copy share | "
           "no target RoPE: benefit / KL | weight bytes | translate ms: wall / kvtd compute |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        copy, lookup = r.get("copy_share", {}), r.get("lookup_share", {})
        for label, name in GRANULARITY.items():
            x, u = r[label], r[label + "_untrained"]
            u_copy = copy.get(label + "_untrained")
            out.append(
                f"| {r['pair']} | {name} | {interval(x['benefit'])} ({x['benefit_first']:.3f}) | "
                f"{x['kl']:.3f} ({x['kl_first']:.3f}) | "
                f"{interval(copy[label]) if label in copy else '-'} | "
                f"{interval(lookup[label]) if label in lookup else '-'} | "
                f"{u['benefit'][0]:.3f} / {f'{u_copy[0]:.3f}' if u_copy else '-'} | "
                f"{x['benefit_no_target_rope']:.3f} / {x['kl_no_target_rope']:.3f} | "
                f"{r['bytes'][label]:,} | {r['translate_ms'][label]:.2f} / "
                f"{compute_of(r, label)} |")
    return "\n".join(out)


def difference_table(rows):
    out = ["| pair | benefit per_head - per_layer [95%] | KL per_head - per_layer [95%] | "
           "copy share diff [95%] | lookup share diff [95%] | bytes per_head / per_layer | "
           "translate time per_head / per_layer: wall / kvtd compute | "
           "fit cos per_layer / per_head "
           "(recommended) | measured | agrees |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = r["per_head_minus_per_layer"]
        cos = r.get("fit_cosine", {})
        choice = measured_choice(r)
        copy = r.get("copy_share_per_head_minus_per_layer")
        lookup = r.get("lookup_share_per_head_minus_per_layer")
        out.append(
            f"| {r['pair']} | {signed(gap['benefit'])} | {signed(gap['kl'])} | "
            f"{signed(copy) if copy else '-'} | {signed(lookup) if lookup else '-'} | "
            f"{r['bytes']['ridge_per_head'] / r['bytes']['ridge']:.3f} | "
            f"{r['translate_ms']['ridge_per_head'] / r['translate_ms']['ridge']:.2f} / "
            f"{compute_ratio(r)} | "
            f"{cos.get('ridge', float('nan')):.4f} / {cos.get('ridge_per_head', float('nan')):.4f}"
            f" ({r['recommended']}) | {choice} | {'yes' if choice == r['recommended'] else 'no'} |")
    return "\n".join(out)


def main():
    rows = load(sys.argv[1])
    print(measures_table(rows))
    print()
    print(difference_table(rows))


if __name__ == "__main__":
    main()
