#!/usr/bin/env python3
"""Writes the generated tables of docs/EVAL.md from docs/eval/results.json (run_eval.py calls
it; the prose outside the GENERATED markers is kept as is).

    python3 eval/write_eval_md.py docs/eval/results.json docs/EVAL.md
"""

import json
import sys

BEGIN = "<!-- BEGIN GENERATED (eval/write_eval_md.py) -->"
END = "<!-- END GENERATED -->"
CONTROLS = ["identity", "untrained", "untranslated", "no_target_rope"]


def f(x, d=3):
    return "n/a" if x is None or x != x else f"{x:.{d}f}"


def tables(r):
    k = r["settings"]["main_k"]
    out = []
    out.append("### The family\n")
    out.append("| member | layers | hidden | heads | KV heads x head_dim | parameters | "
               "training tokens | teacher | held-out bits/byte |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for m, s in r["family"].items():
        out.append(f"| {m} ({s['name']}) | {s['layers']} | {s['hidden']} | {s['heads']} | "
                   f"{s['kv_heads']} x {s['head_dim']} | {s['parameters']:,} | "
                   f"{s['tokens'] / 1e6:.2f}M | {s['teacher']} | {s['bpb']:.3f} |")
    st = r["settings"]
    out.append(f"\nHeld-out: {st['windows']} windows of {st['context']} context + "
               f"{st['continuation']} continuation bytes from held-out documents; calibration: "
               f"{st['calib_windows']} windows x {st['calib_tokens']} bytes from calibration "
               f"documents. CE in nats per byte.\n")
    out.append(f"### Context benefit recovered (k = {k})\n")
    out.append("Benefit recovered = (CE_none - CE_x) / (CE_none - CE_own); in parentheses: on the "
               f"first 16 bytes after the boundary.\n")
    out.append("| pair | CE own | CE none | CE mapped | **mapped** | token identity | "
               "untrained source | untranslated | no target RoPE | ppl ratio mapped |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, p in r["pairs"].items():
        if not name.endswith(f"k={k}"):
            continue
        b, ce = p["benefit"], p["ce"]

        def cell(key):
            if key not in b:
                return "(shapes differ)"
            return f"{f(b[key]['all'])} ({f(b[key]['first'])})"
        out.append(f"| {name.split(' ')[0]} | {f(ce['own']['all'])} | {f(ce['none']['all'])} | "
                   f"{f(ce['mapped']['all'])} | **{cell('mapped')}** | " +
                   " | ".join(cell(c) for c in CONTROLS) +
                   f" | {f(p['ppl_ratio']['mapped'], 4)} |")
    out.append("\n### Every k: benefit and ValidateKV quality on held-out windows\n")
    out.append("| pair | k | benefit (first 16) | ppl ratio | R^2 K / V | R^2 K / V without "
               "layer 0 | attention-output cosine | c_K | c_V |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for name, p in r["pairs"].items():
        pair, kk = name.split(" ")
        v, v0 = p["validate"]["overall"], p["validate"]["overall_without_layer0"]
        out.append(f"| {pair} | {kk[2:]} | {f(p['benefit']['mapped']['all'])} "
                   f"({f(p['benefit']['mapped']['first'])}) | {f(p['ppl_ratio']['mapped'], 4)} | "
                   f"{f(v['r2_k'])} / {f(v['r2_v'])} | {f(v0['r2_k'])} / {f(v0['r2_v'])} | "
                   f"{f(v['attention_cosine'], 4)} | {f(v['c_k'])} | {f(v['c_v'])} |")
    if r.get("kinds"):
        out.append(f"\n### Ridge vs MLP (k = {k})\n")
        out.append(
            f"`kvt fit --kind both` per ordered pair: ridge and an MLP mapper (per layer, hidden "
            f"{st.get('mlp_hidden')}, {st.get('mlp_epochs')} epochs, batch {st.get('mlp_batch')}, "
            f"at most {st.get('mlp_max_observations')} training rows per chain; "
            f"{r.get('kind_fit_seconds', 'n/a')} s for all pairs' fits, one core), both served "
            f"by kvtd and measured on the same held-out windows as above. \"fit cos\" is the "
            f"held-out attention-output cosine `kvt fit` measures on held-out *calibration* "
            f"sequences and recommends from; the other columns are on held-out documents. "
            f"Each cell: ridge / MLP; **bold**: the better of the two.\n")
        out.append("| pair | benefit recovered | (first 16) | ppl ratio | attention-output cosine | "
                   "c_K | fit cos (held-out calib.) | recommended | better benefit |")
        out.append("|---|---|---|---|---|---|---|---|---|")

        def pair_cell(a, b, d=3, higher=True):
            if a is None or b is None or a != a or b != b:
                return f"{f(a, d)} / {f(b, d)}"
            if abs(a - b) < 10 ** -d:
                return f"{f(a, d)} / {f(b, d)}"
            if (a > b) == higher:
                return f"**{f(a, d)}** / {f(b, d)}"
            return f"{f(a, d)} / **{f(b, d)}**"
        for name, p in r["kinds"].items():
            rr, mm, fr = p["ridge"], p["mlp"], p["fit_report"]
            winner = "mlp" if mm["benefit"] > rr["benefit"] else "ridge"
            agree = "yes" if winner == fr["recommended"] else "no"
            out.append(
                f"| {name} | {pair_cell(rr['benefit'], mm['benefit'])} | "
                f"{pair_cell(rr['benefit_first'], mm['benefit_first'])} | "
                f"{pair_cell(rr['ppl_ratio'], mm['ppl_ratio'], 4, higher=False)} | "
                f"{pair_cell(rr['validate']['attention_cosine'], mm['validate']['attention_cosine'], 4)} | "
                f"{f(rr['validate']['c_k'])} / {f(mm['validate']['c_k'])} | "
                f"{pair_cell(fr['ridge']['attention_cosine'], fr['mlp']['attention_cosine'], 4)} | "
                f"{fr['recommended']} | {winner} (recommendation {'agrees' if agree == 'yes' else 'differs'}) |")
        controls = {n: p["mlp_untrained"] for n, p in r["kinds"].items() if "mlp_untrained" in p}
        if controls:
            out.append("\nThe MLP's untrained-source control: the same MLP fit from an untrained "
                       "model of the source's shape (random weights); a trained source's MLP must "
                       "beat it to be transferring more than token identity.\n")
            out.append("| pair | MLP benefit (first 16) | untrained-source MLP benefit (first 16) | "
                       "token identity (ridge table) |")
            out.append("|---|---|---|---|")
            for n, c in controls.items():
                m = r["kinds"][n]["mlp"]
                ident = r["pairs"].get(f"{n} k={k}", {}).get("benefit", {}).get("identity")
                out.append(f"| {n} | {f(m['benefit'])} ({f(m['benefit_first'])}) | "
                           f"{f(c['benefit'])} ({f(c['benefit_first'])}) | "
                           f"{f(ident['all']) if ident else 'n/a'} |")
    d = r["drift"]
    out.append(f"\n### Multi-turn drift ({st['drift_pair'].replace(':', ' <-> ')}, "
               f"{st['turns']} alternating handoffs, {st['segment']}-byte segments, "
               f"{st['drift_windows']} windows)\n")
    out.append("| turn | receiver | CE own | CE none | CE mapped | benefit recovered |")
    out.append("|---|---|---|---|---|---|")
    for t in d:
        ce = t["ce"]
        out.append(f"| {t['turn']} | {t['receiver']} | {f(ce['own']['all'])} | "
                   f"{f(ce['none']['all'])} | {f(ce['mapped']['all'])} | {f(t['benefit'])} |")
    out.append("\n![benefit recovered](eval/benefit.svg)\n\n![drift](eval/drift.svg)\n")
    out.append(f"Generated in {r['seconds']} s by `{st.get('command', 'eval/run_eval.py')}`.")
    return "\n".join(out)


def main():
    results, md = sys.argv[1], sys.argv[2]
    with open(results) as fh:
        r = json.load(fh)
    try:
        with open(md) as fh:
            text = fh.read()
    except FileNotFoundError:
        text = f"# Retention evaluation\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{md}: no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(md, "w") as fh:
        fh.write(head + BEGIN + "\n" + tables(r) + "\n" + END + tail)


if __name__ == "__main__":
    main()
