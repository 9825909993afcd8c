#!/usr/bin/env python3
"""Writes the generated tables of docs/EVAL.md from docs/eval/results.json (run_eval.py calls
it; the prose outside the GENERATED markers is kept as is).

    bazel build //clients/python:kvt && PATH=$PWD/.venv/bin:$PATH \
        PYTHONPATH=clients/python:bazel-bin/clients/python/gen \
        python3 eval/write_eval_md.py docs/eval/results.json docs/EVAL.md

(numpy, and the kvt package for the intervals' bootstrap, kvt.intervals.)
"""

import json
import os
import sys

import intervals

BEGIN = "<!-- BEGIN GENERATED (eval/write_eval_md.py) -->"
END = "<!-- END GENERATED -->"
CONTROLS = ["identity", "untrained", "untranslated", "no_target_rope"]



def refinement_budget(r, kind, before_recorded):
    """The refinement budget the evaluation's `kvt fit --kind both` ran for `kind` ("ridge",
    "mlp"), as its fit_report.json records it ("refinement"; one budget on every pair, else
    each is named); results from before kvt fit recorded it: `before_recorded`, that day's
    default."""
    seen = {}
    for name, pair in r["kinds"].items():
        rec = (pair.get("fit_report") or {}).get(kind, {}).get("refinement")
        if rec:
            q = rec["queries"] if rec["queries"] > 0 else "all"
            seen.setdefault(f"{rec['steps']} steps x {rec['batch']} sequences x {q} queries",
                            []).append(name)
    if not seen:
        return before_recorded
    if len(seen) == 1:
        return next(iter(seen))
    return "; ".join(f"{b} ({', '.join(p)})" for b, p in seen.items())

def rows_per_chain(limit):
    """kvt fit --mlp_max_observations in words (0: every calibration row)."""
    return "every training row" if not limit else f"at most {limit} training rows per chain"


def f(x, d=3):
    return "n/a" if x is None or x != x else f"{x:.{d}f}"


def tables(r, per_window=None):
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
        out.extend(kinds_tables(r, k, st))
    if r.get("long_range"):
        out.extend(long_range_tables(r))
    if per_window and r.get("kinds"):
        out.extend(interval_section(r, per_window, k))
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

KINDS = ["ridge", "ridge_refined", "mlp", "mlp_refined"]
# The same four as window mappers (run_eval --window; docs/MAPPER_FORMAT.md).
W = "w_"
W_KINDS = [W + c for c in KINDS]
KIND_NAMES = {"ridge": "ridge", "ridge_refined": "ridge refined", "mlp": "MLP",
              "mlp_refined": "MLP refined"}
KIND_NAMES.update({W + c: "window " + name for c, name in KIND_NAMES.items()})


def kinds_in(r):
    """The kind lists these results have: the token-wise four, and the window four if fitted."""
    window = any(W + "ridge" in p for p in r.get("kinds", {}).values())
    return [KINDS] + ([W_KINDS] if window else [])


def served(p):
    """Every served kind of a pair's results (token-wise and window)."""
    return [c for c in KINDS + W_KINDS if c in p]


def mlp_candidate(p, prefix=""):
    """The MLP that `kvt fit --kind both` compared with the refined ridge: the refined MLP where
    the pair has one (both halves refined), else the plain MLP (results from before it)."""
    return prefix + ("mlp_refined" if prefix + "mlp_refined" in p else "mlp")
# Below this copy gain of the target's own cache (nats/byte) the share of the long-range
# benefit a mapper recovers is a ratio of noise: it is shown as undefined.
MIN_COPY_GAIN = 0.1
# Likewise the benefit recovered where the target's own cache beats no context by less than this
# (nats/byte; on today's windows the members gain 0.05-0.11).
MIN_BENEFIT = 0.02


def triple(vals, d=3, higher=True):
    """a / b / c ("-" where a kind was not fitted) with the best in bold (none when all are
    equal at the printed precision)."""
    shown = ["-" if v is None else f(v, d) for v in vals]
    finite = [i for i, v in enumerate(vals) if v is not None and v == v]
    if len(finite) > 1 and len({shown[i] for i in finite}) > 1:
        best = (max if higher else min)(finite, key=lambda i: vals[i])
        shown[best] = f"**{shown[best]}**"
    return " / ".join(shown)


def field(p, kind, key, sub=None):
    """p[kind][key] (or [sub] of it), None where the kind was not fitted for the pair."""
    if kind not in p:
        return None
    return p[kind][key] if sub is None else p[kind][key][sub]


def identity_of(r, target, k, measure="benefit"):
    """The token-identity figure into `target` on today's windows (it depends on the target
    only): from any ridge-table pair into it. measure: "benefit" or "kl"."""
    for name, p in r["pairs"].items():
        if name.split(" ")[0].endswith("->" + target) and name.endswith(f"k={k}"):
            return p.get(measure, {}).get("identity")
    return None


def kinds_tables(r, k, st):
    out = [f"\n### Ridge, ridge refined, MLP, MLP refined (k = {k})\n"]
    mlp_pairs = [n for n, p in r["kinds"].items() if "mlp" in p]
    # A resumed run (run_eval --reuse_fits) did not time the fits an earlier run made.
    resumed = (" (a resumed run: each fit's own wall time, summed, over the processes at once)"
               if r.get("kind_fit_seconds_resumed") else "")
    mlp_where = ("every pair" if len(mlp_pairs) == len(r["kinds"]) else
                 f"{', '.join(mlp_pairs)} only (`--mlp_pairs`; the other pairs: `--kind ridge "
                 f"--refine=attention`)")
    ridge_budget = refinement_budget(r, "ridge", "100 steps x 2 sequences x 16 queries")
    mlp_budget = refinement_budget(r, "mlp", "300 steps x 4 sequences x 64 queries")
    out.append(
        f"Per ordered pair the plain closed-form ridge and the ridge refined on the target's "
        f"attention outputs (`kvt fit --refine=attention`, its defaults: the handoff objective, "
        f"{ridge_budget}, the start kept unless the held-out objective "
        f"falls, docs/FIT.md); the MLP trained on K/V MSE (per layer, hidden "
        f"{st.get('mlp_hidden')}, {st.get('mlp_epochs')} epochs, batch {st.get('mlp_batch')}, "
        f"{rows_per_chain(st.get('mlp_max_observations'))}) and the same MLP then "
        f"refined on the attention outputs (the same objective and guard on a budget of its "
        f"own, `--refine_mlp_*`: {mlp_budget}), both from one `kvt fit "
        f"--kind both --refine=attention --unrefined_mlp_out=...` per pair (one MSE training; the plain MLP is its start), on "
        f"{mlp_where}. {r.get('kind_fit_seconds', 'n/a')} s{resumed} for these fits and their "
        f"controls{' (and the window mappers below)' if len(kinds_in(r)) > 1 else ''} "
        f"({st.get('jobs', 1)} `kvt fit` processes at once, one thread each). All "
        f"served by kvtd and measured on the same held-out windows as above. Each cell: ridge / "
        f"ridge refined / MLP / MLP refined (\"-\": not fitted), **bold** the best. Token "
        f"identity depends on the target only (the ridge table's figure for that target). "
        f"Untrained source: the same kind fitted from an untrained model of the source's shape "
        f"({controls_where(r, KINDS)}).\n")
    out.extend(kind_section(r, k, KINDS))
    if len(kinds_in(r)) > 1:
        window = st.get("window")
        out.append(f"\n### Window mappers (window {window}, k = {k})\n")
        out.append(
            f"The same four kinds as window mappers (`kvt fit --window={window}`, "
            f"docs/MAPPER_FORMAT.md \"Window mappers\"): each output token reads the k chosen "
            f"source layers at itself and the {window - 1} tokens before it, {window} times the "
            f"ridge's inputs (the MLP's first layer likewise); fitted, refined, recommended and "
            f"served exactly as above (`kvt fit --kind both --refine=attention --window={window}` "
            f"per pair, and `--kind ridge --window={window}`), measured on the same windows. "
            f"Each cell: window ridge / window ridge refined / window MLP / window MLP refined. "
            f"Untrained source: the same window kind fitted from the untrained source "
            f"({controls_where(r, W_KINDS)}): a window of an untrained network's cache carries "
            f"the identity of the last {window} bytes, so it is the control that says whether "
            f"a window mapper transfers more than that.\n")
        out.extend(kind_section(r, k, W_KINDS))
    out.append("\nThe evaluation's goals on today's windows, as measured:\n")
    out.extend(goal_lines(r, k))
    return out


def controls_where(r, kinds):
    """Which pairs have an untrained-source control of each kind in `kinds`."""
    parts = []
    for c in kinds:
        where = [n for n, p in r["kinds"].items() if c + "_untrained" in p]
        parts.append(f"{KIND_NAMES[c]}: "
                     f"{'every pair' if len(where) == len(r['kinds']) else ', '.join(where) or 'none'}")
    return "; ".join(parts)


def kind_section(r, k, kinds):
    """The benefit, quality / recommendation and KL tables of one kind list (token-wise or
    window), every pair."""
    prefix = W if kinds is W_KINDS else ""
    report_key = "fit_report_window" if prefix else "fit_report"
    out = ["| pair | CE own / none | benefit recovered | (first 16) | token identity (first 16) "
           "| untrained source | no target RoPE |",
           "|---|---|---|---|---|---|---|"]
    for name, p in r["kinds"].items():
        ident = identity_of(r, name.split("->")[1], k)
        untrained = " / ".join(f(p[c + "_untrained"]["benefit"]) if c + "_untrained" in p
                               else "-" for c in kinds)
        out.append(
            f"| {name} | {f(p['ce']['own'])} / {f(p['ce']['none'])} | "
            f"{triple([field(p, c, 'benefit') for c in kinds])} | "
            f"{triple([field(p, c, 'benefit_first') for c in kinds])} | "
            f"{f(ident['all']) + ' (' + f(ident['first']) + ')' if ident else 'n/a'} | "
            f"{untrained} | "
            f"{triple([field(p, c, 'benefit_no_target_rope') for c in kinds])} |")
    out.append("\nQuality on the same windows (kvtd's ValidateKV) and `kvt fit --kind both`'s "
               "recommendation, now between the refined ridge and the refined MLP, from its "
               "held-out "
               "*calibration* attention-output cosine (\"fit cos\"), checked against the "
               "measured benefit of the two.\n")
    out.append("| pair | ppl ratio | attention-output cosine | c_K | "
               "fit cos ridge refined / MLP refined | "
               "recommended | better measured benefit |")
    out.append("|---|---|---|---|---|---|---|")
    for name, p in r["kinds"].items():
        row = (f"| {name} | {triple([field(p, c, 'ppl_ratio') for c in kinds], 4, higher=False)}"
               f" | {triple([field(p, c, 'validate', 'attention_cosine') for c in kinds], 4)} | "
               f"{triple([field(p, c, 'validate', 'c_k') for c in kinds], higher=False)} | ")
        fr = p.get(report_key)
        if fr is None:
            out.append(row + "- | (no MLP fitted) | - |")
            continue
        out.append(row + f"{f(fr['ridge']['attention_cosine'], 4)} / "
                   f"{f(fr['mlp']['attention_cosine'], 4)} | {fr['recommended']} | "
                   f"{recommendation_check(p, prefix, fr)[1]} |")
    if all("kl" in p.get(prefix + "ridge", {}) for p in r["kinds"].values()):
        out.extend(kl_table(r, k, kinds))
    return out


def recommendation_check(p, prefix, report):
    """(agrees, text): whether kvt fit's recommendation is the kind (refined ridge or the MLP
    candidate) with the better measured benefit."""
    m = mlp_candidate(p, prefix)
    better = "mlp" if p[m]["benefit"] > p[prefix + "ridge_refined"]["benefit"] else "ridge"
    agrees = better == report["recommended"]
    name = KIND_NAMES[prefix + "ridge_refined"] if better == "ridge" else KIND_NAMES[m]
    return agrees, f"{name} (recommendation {'agrees' if agrees else 'differs'})"


def kl_table(r, k, kinds=KINDS):
    heading = " / ".join(KIND_NAMES[c] for c in kinds)
    out = ["\nFidelity to the target's own next-token distribution on the same windows: "
           "KL(own || x) in nats per byte, the divergence of the target's next-token "
           "distribution after cache x from the one after its own prefill, averaged over the "
           "continuation (in parentheses: the first 16 bytes). 0 is a perfect translation; "
           "lower is better. Unlike CE on the text, it cannot reward a cache for a shift that "
           "happens to suit the text (\"Reading the numbers\").\n",
           f"| pair | KL none | KL {heading} | (first 16) | "
           "token identity | no target RoPE |",
           "|---|---|---|---|---|---|"]
    for name, p in r["kinds"].items():
        ident = identity_of(r, name.split("->")[1], k, "kl")
        out.append(
            f"| {name} | {f(p['kl']['none'])} | "
            f"{triple([field(p, c, 'kl') for c in kinds], higher=False)} | "
            f"{triple([field(p, c, 'kl_first') for c in kinds], higher=False)} | "
            f"{f(ident['all']) + ' (' + f(ident['first']) + ')' if ident else 'n/a'} | "
            f"{triple([field(p, c, 'kl_no_target_rope') for c in kinds], higher=False)} |")
    return out


def goal_lines(r, k):
    kinds = r["kinds"]
    n = len(kinds)
    beat_identity = []
    for name, p in kinds.items():
        ident = identity_of(r, name.split("->")[1], k)
        best = max(served(p), key=lambda c: p[c]["benefit"])
        beat_identity.append((name, best, p[best]["benefit"], ident["all"] if ident else None))
    wins = [x for x in beat_identity if x[3] is not None and x[2] > x[3]]
    misses = [x for x in beat_identity if x not in wins]
    with_mlp = sum("mlp" in p for p in kinds.values())
    names = " or ".join(", ".join(KIND_NAMES[c] for c in group) for group in kinds_in(r))
    lines = [f"- Best served mapper ({names if with_mlp == n else f'MLP fitted on {with_mlp} of the pairs'})"
             f" beats token identity: **{len(wins)} of {n}** pairs" +
             ("." if not misses else "; not on " + ", ".join(
                 f"{x[0]} ({KIND_NAMES[x[1]]} {f(x[2])} vs {f(x[3])})" for x in misses) + ".")]
    if len(kinds_in(r)) > 1:
        best_kinds = sorted({x[1] for x in beat_identity}, key=(KINDS + W_KINDS).index)
        lines.append("- The best served mapper per pair is " + ", ".join(
            f"{KIND_NAMES[c]} on {sum(x[1] == c for x in beat_identity)}" for c in best_kinds)
            + f" of {n} pairs; a window kind beats every token-wise kind on **"
            f"{sum(max(p[c]['benefit'] for c in W_KINDS if c in p) > max(p[c]['benefit'] for c in KINDS if c in p) for p in kinds.values())}"
            f" of {n}** pairs.")
    if len(kinds_in(r)) > 1:
        lines.append(window_control_line(kinds, "benefit"))
    for group in kinds_in(r):
        prefix = W if group is W_KINDS else ""
        what = "window " if prefix else ""
        pairs = [(name, p[prefix + "ridge"]["benefit"], p[prefix + "ridge_refined"]["benefit"])
                 for name, p in kinds.items() if prefix + "ridge_refined" in p]
        lines.append(refined_line(f"Refined {what}ridge beats plain {what}ridge", pairs,
                                  len(pairs), "the closed form"))
        pairs = [(name, p[prefix + "mlp"]["benefit"], p[prefix + "mlp_refined"]["benefit"])
                 for name, p in kinds.items() if prefix + "mlp" in p and prefix + "mlp_refined" in p]
        if pairs:
            lines.append(refined_line(f"Refined {what}MLP beats the MSE-trained {what}MLP", pairs,
                                      len(pairs), "the MSE-trained MLP"))
        else:
            lines.append(f"- {what}MLP refined: not in these results.")
    if all("kl" in p.get("ridge", {}) for p in kinds.values()):
        lines.extend(kl_goal_lines(r, k))
    for group in kinds_in(r):
        prefix = W if group is W_KINDS else ""
        report_key = "fit_report_window" if prefix else "fit_report"
        agree = [recommendation_check(p, prefix, p[report_key])[0] for p in kinds.values()
                 if report_key in p]
        lines.append(f"- `kvt fit --kind both{' --window' if prefix else ''}` recommendation "
                     f"(refined {'window ' if prefix else ''}ridge vs refined "
                     f"{'window ' if prefix else ''}MLP) agrees with the measured benefit on "
                     f"**{sum(agree)} of {len(agree)}** pairs with an MLP.")
    return lines


def window_control_line(pairs, key):
    """Whether the best window mapper beats the best of its untrained-source window controls
    (which carry the identity of the last `window` bytes): pairs {name: {label: figures}} with
    figure `key` (higher is better)."""
    wins, misses, n = 0, [], 0
    for name, p in pairs.items():
        mapped = [c for c in W_KINDS if c in p]
        controls = [c + "_untrained" for c in W_KINDS if c + "_untrained" in p]
        if not mapped or not controls:
            continue
        n += 1
        value = (lambda c: p[c][key]) if isinstance(p[mapped[0]], dict) else (lambda c: p[c])
        best = max(mapped, key=value)
        control = max(controls, key=value)
        if value(best) > value(control):
            wins += 1
        else:
            misses.append(f"{name} ({KIND_NAMES[best]} {f(value(best))} vs "
                          f"{KIND_NAMES[control[:-len('_untrained')]]} from the untrained source "
                          f"{f(value(control))})")
    return (f"- Best window mapper beats the best window mapper fitted from the untrained source "
            f"(the identity of the last bytes, the window mappers' own control): **{wins} of {n}**"
            f" pairs" + ("." if not misses else "; not on " + ", ".join(misses) + "."))


def kl_goal_lines(r, k):
    """The same goals measured by KL to the target's own distribution (lower is better)."""
    kinds = r["kinds"]
    n = len(kinds)
    beat, misses = 0, []
    for name, p in kinds.items():
        ident = identity_of(r, name.split("->")[1], k, "kl")
        best = min(served(p), key=lambda c: p[c]["kl"])
        if ident and p[best]["kl"] < ident["all"]:
            beat += 1
        else:
            misses.append(f"{name} ({KIND_NAMES[best]} {f(p[best]['kl'])} vs "
                          f"{f(ident['all'] if ident else None)})")
    lines = [f"- By KL to the target's own distribution, the best served mapper is closer than "
             f"token identity on **{beat} of {n}** pairs" +
             ("." if not misses else "; not on " + ", ".join(misses) + ".")]
    for group in kinds_in(r):
        prefix = W if group is W_KINDS else ""
        what = "window " if prefix else ""
        for title, start, refined, start_name in (
                (f"the refined {what}ridge is closer than the plain {what}ridge", "ridge",
                 "ridge_refined", "the closed form"),
                (f"the refined {what}MLP is closer than the MSE-trained {what}MLP", "mlp",
                 "mlp_refined", "the MSE-trained MLP")):
            # Negated so that refined_line's "higher is better" reads "lower KL is better".
            pairs = [(name, -p[prefix + start]["kl"], -p[prefix + refined]["kl"])
                     for name, p in kinds.items() if prefix + start in p and prefix + refined in p]
            if pairs:
                lines.append(refined_line(f"By KL, {title}", pairs, len(pairs), start_name,
                                          "change in KL", sign=-1))
    return lines


def refined_line(title, pairs, n, start, measure="change in benefit recovered", sign=1):
    """pairs: (name, start figure, refined figure), higher better (a lower-is-better measure
    passes its negation and sign=-1, which turns the figures back for printing). Equal figures
    are the same mapper: kvt fit keeps its start when the refinement does not lower the held-out
    objective (docs/FIT.md)."""
    ups = [x for x in pairs if x[2] > x[1]]
    kept = [x for x in pairs if x[2] == x[1]]
    downs = [x for x in pairs if x[2] < x[1]]
    gains = sorted(sign * (x[2] - x[1]) for x in pairs)
    line = (f"- {title}: **{len(ups)} of {n}** pairs ({measure} "
            f"{gains[0]:+.3f} to {gains[-1]:+.3f})")
    if kept:
        line += (f"; {start} kept, the refinement not lowering its held-out objective, on "
                 + ", ".join(x[0] for x in kept))
    if downs:
        line += "; worse on " + ", ".join(
            f"{x[0]} ({f(sign * x[1])} -> {f(sign * x[2])})" for x in downs)
    return line + "."


def slash(d, keys, sub=None):
    """d[k] (or d[k][sub]) for each key, "/"-joined, "-" where a key is missing."""
    return " / ".join("-" if k not in d else f(d[k] if sub is None else d[k][sub])
                      for k in keys)


MATCHED = {"S", "M", "L"}  # the members sharing one KV shape (U is the unmatched one)


def long_range_goal_lines(lr):
    """The long-range goals per window kind: the best mapper's long-range share (its
    copy gain over the target's own) on every matched pair, next to the controls' shares."""
    out = ["\nThe long-range goal (the best mapper carries >= 0.90 of the target's own copy gain), "
           "as measured (long-range share = copy "
           "gain / the target's own copy gain; per pair the best mapper's, then token identity's, "
           "the best untrained-source control's and the best mapper's without target RoPE):\n"]
    for kind, pairs in lr.items():
        rows, met, matched = [], 0, 0
        for name, p in pairs.items():
            share, own = p["long_range"], p["copy_gain"]["own"]
            matched += set(name.split("->")) <= MATCHED
            if abs(own) < MIN_COPY_GAIN:
                rows.append(f"{name} undefined (own gain {f(own)})")
                continue
            best = max(served(share), key=lambda c: share[c])
            untrained = max((share[c + "_untrained"] for c in KINDS + W_KINDS
                             if c + "_untrained" in share), default=None)
            rows.append(f"{name} {f(share[best])} ({KIND_NAMES[best]}; identity "
                        f"{f(share.get('identity'))}, untrained {f(untrained)}, no RoPE "
                        f"{f(share.get(best + '_no_target_rope'))})")
            if set(name.split("->")) <= MATCHED:
                met += share[best] >= 0.90
        out.append(f"- {kind} windows: best mapper recovers >= 0.90 of the long-range benefit on "
                   f"**{met} of {matched}** matched pairs. " + "; ".join(rows) + ".")
        shares = {name: p["long_range"] for name, p in pairs.items()
                  if abs(p["copy_gain"]["own"]) >= MIN_COPY_GAIN}
        if any(W + "ridge" in x for x in shares.values()):
            out.append("  " + window_control_line(shares, None).replace(
                "- Best window mapper", f"On the {kind} windows (long-range share) the best "
                "window mapper"))
    return out


def long_range_tables(r):
    lr = r["long_range"]
    st = r["settings"]
    out = ["\n### Long-range windows\n"]
    any_pair = next(iter(next(iter(lr.values())).values()))
    c, n = any_pair["context"], any_pair["continuation"]
    out.append(
        f"{any_pair['windows']} windows per kind (seed {st.get('long_seed', 0)}) of {c} context "
        f"+ {n} continuation bytes from held-out documents. **copy**: the continuation is a "
        f"passage that also opens the context, {c - n - 1} bytes earlier, with unrelated "
        f"held-out text between (retention.copy_windows). **lookup**: \"abc=12345;\" key -> "
        f"value pairs planted in held-out text in the context, looked up again in another "
        f"order in the continuation (retention.lookup_windows). Each window has a control that "
        f"differs only in what lies far back (the earlier copy replaced by other text; other "
        f"values planted). **Copy gain** = CE on the control - CE on the window (nats/byte): "
        f"what the condition draws from context far back. **Long-range share** = copy gain of "
        f"the mapper / copy gain of the target's own cache; shown as undefined where the own "
        f"copy gain is below {MIN_COPY_GAIN} nats/byte. Benefit recovered is the old figure "
        f"(against no context; the token-identity and untrained-source columns are that figure "
        f"too), shown as undefined where CE_none - CE_own is below {MIN_BENEFIT} nats/byte.\n")
    own = {}
    for kind, pairs in lr.items():
        for name, p in pairs.items():
            own.setdefault(name.split("->")[1], {})[kind] = p["copy_gain"]["own"]
    out.append("What each member's own cache gains from context far back (nats/byte; the "
               "family's training aimed at 1 or more for every member, so that these windows can "
               "tell mappers apart):\n")
    out.append("| member | " + " | ".join(f"copy gain, {kind} windows" for kind in lr) + " |")
    out.append("|---|" + "---|" * len(lr))
    for m, g in sorted(own.items()):
        out.append(f"| {m} | " + " | ".join(f(g.get(kind)) for kind in lr) + " |")
    out.extend(long_range_goal_lines(lr))
    groups = [KINDS] + ([W_KINDS] if any(W + "ridge" in p["long_range"] for pairs in lr.values()
                                         for p in pairs.values()) else [])
    for kind, pairs in lr.items():
        for kinds in groups:
            what = "window mappers, " if kinds is W_KINDS else ""
            cells = " / ".join(KIND_NAMES[c] for c in kinds)
            out.append(f"\n#### {kind} windows, {what}CE (nats/byte) per condition\n")
            out.append(f"Each multi-value cell: {cells}.\n")
            out.extend(condition_table(pairs, "ce", ["own", "none"], kinds))
            if all("kl" in p for p in pairs.values()):
                out.append(f"\n#### {kind} windows, {what}KL to the target's own distribution "
                           f"(nats/byte)\n")
                out.extend(condition_table(pairs, "kl", ["none"], kinds))
            out.append(f"\n#### {kind} windows, {what}copy gain, long-range share, benefit "
                       f"recovered\n")
            out.extend(share_table(pairs, kinds))
        if any("layer_probe" in p for p in pairs.values()):
            out.extend(layer_probe_table(pairs))
    return out


def share_table(pairs, kinds):
    """Per pair the copy gain of own and each kind, the long-range shares and the benefit
    recovered against no context, with the controls."""
    out = [f"| pair | copy gain own | copy gain {' / '.join(KIND_NAMES[c] for c in kinds)} | "
           "long-range share | "
           "benefit recovered (first 16) | token identity | untrained source |",
           "|---|---|---|---|---|---|---|"]
    for name, p in pairs.items():
        g, b = p["copy_gain"], p["benefit"]
        gap = p["ce"]["none"]["all"] - p["ce"]["own"]["all"]
        benefit = (f"{slash(b, kinds, 'all')} ({slash(b, kinds, 'first')})"
                   if gap >= MIN_BENEFIT else f"undefined (CE none - own = {f(gap)})")
        ident = f(b["identity"]["all"]) if "identity" in b and gap >= MIN_BENEFIT else "-"
        untrained = (slash(b, [c + "_untrained" for c in kinds], "all")
                     if gap >= MIN_BENEFIT else "-")
        share = ("undefined (own gain " + f(g["own"]) + ")" if abs(g["own"]) < MIN_COPY_GAIN
                 else slash(p["long_range"], kinds))
        out.append(
            f"| {name} | {f(g['own'])} | {slash(g, kinds)} | {share} | {benefit} | {ident} | "
            f"{untrained} |")
    return out


def condition_table(pairs, measure, plain, kinds=KINDS):
    """Per pair the long-range figure `measure` ("ce" or "kl") of each condition: the `plain`
    ones, then mapped, token identity, untrained source and no target RoPE per kind."""
    out = ["| pair | " + " | ".join(plain) + " | mapped | token identity | untrained source | "
           "no target RoPE |", "|---|" + "---|" * (len(plain) + 4)]
    for name, p in pairs.items():
        x = {key: v["all"] for key, v in p[measure].items()}
        out.append(
            f"| {name} | " + " | ".join(f(x[key]) for key in plain) + " | "
            f"{slash(x, kinds)} | {f(x.get('identity'))} | "
            f"{slash(x, [c + '_untrained' for c in kinds])} | "
            f"{slash(x, [c + '_no_target_rope' for c in kinds])} |")
    return out


def layer_probe_table(pairs):
    """retention.copy_layer_probe: the long-range share with the target's own keys (K) or keys
    and values (KV) at one layer, every other layer translated."""
    out = ["\n#### copy windows: where the copy is lost\n",
           "Long-range share of the translated cache with the target's own keys at one layer "
           "(every other layer translated), per target layer: K / K and V "
           "(retention.copy_layer_probe). The layer whose own keys restore the share is where "
           "the target looks the copy up; the mapper's error in those keys is what the share "
           "pays for.\n",
           "| pair | mapper | translated | own K / own K and V at layer 0, 1, ... |",
           "|---|---|---|---|"]
    for name, p in pairs.items():
        for label, probe in p.get("layer_probe", {}).items():
            cells = ", ".join(f"{f(k, 2)} / {f(kv, 2)}" for k, kv in zip(probe["k"], probe["kv"]))
            out.append(f"| {name} | {KIND_NAMES[label]} | {f(probe['mapped'], 2)} | {cells} |")
    return out


# -- how sure: paired bootstrap intervals over the windows (eval/intervals.py) -----------------

LEVEL = 0.95


def ci(est, low, high):
    return f"{est:+.3f} [{low:+.3f}, {high:+.3f}]"


def identity_windows(per_window, target, k):
    """Token identity's per-window CE into `target` (the ridge table's windows are the same)."""
    for name, pw in per_window["pairs"].items():
        if name.split(" ")[0].endswith("->" + target) and name.endswith(f"k={k}"):
            return pw["ce"].get("identity")
    return None


def interval_section(r, per_window, k):
    """The goals' comparisons with 95% paired bootstrap intervals over the windows, and how
    many are beyond noise."""
    n = r["settings"]["windows"]
    out = [f"\n### How sure: {LEVEL:.0%} intervals over the windows\n",
           f"Each comparison above is a difference between two conditions on the same {n} "
           f"held-out windows. Here with its {LEVEL:.0%} paired bootstrap interval "
           f"(eval/intervals.py: the windows resampled 4000 times, every condition on the same "
           f"resample; a window's tokens are not independent, so they are not resampled "
           f"alone): estimate [low, high]. **above** / **below**: the whole interval is above / "
           f"below 0, so the sign is beyond this noise; tie: it is not. Best served: the kind "
           f"with the highest estimate (chosen on these windows, so its margin is slightly "
           f"optimistic).\n"]
    comparisons = [("refined - plain ridge", "ridge_refined", "ridge"),
                   ("refined - plain window ridge", W + "ridge_refined", W + "ridge"),
                   ("refined - MSE-trained MLP", "mlp_refined", "mlp"),
                   ("refined - MSE-trained window MLP", W + "mlp_refined", W + "mlp")]
    comparisons = [c for c in comparisons
                   if any(c[1] in p and c[2] in p for p in r["kinds"].values())]
    out.append("| pair | " + " | ".join(c[0] for c in comparisons) +
               " | best served - token identity |")
    out.append("|---|" + "---|" * (len(comparisons) + 1))
    tally = {c[0]: {"above": 0, "tie": 0, "below": 0} for c in comparisons}
    tally["best served - token identity"] = {"above": 0, "tie": 0, "below": 0}
    for name, p in r["kinds"].items():
        ce = per_window["kinds"][name]["ce"]
        cells = []
        for title, better, worse in comparisons:
            if better not in ce or worse not in ce:
                cells.append("-")
                continue
            est, low, high = intervals.benefit_gap(ce, better, worse, LEVEL)
            v = intervals.verdict(low, high)
            tally[title][v] += 1
            cells.append(ci(est, low, high) + (f" **{v}**" if v != "tie" else " tie"))
        ident = identity_windows(per_window, name.split("->")[1], k)
        best = max(served(p), key=lambda c: p[c]["benefit"])
        if ident is not None and len(ident) == len(ce["own"]):
            est, low, high = intervals.benefit_gap(dict(ce, identity=ident), best, "identity",
                                                   LEVEL)
            v = intervals.verdict(low, high)
            tally["best served - token identity"][v] += 1
            cells.append(f"{KIND_NAMES[best]}: {ci(est, low, high)}" +
                         (f" **{v}**" if v != "tie" else " tie"))
        else:
            cells.append("-")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out.append("\nIn benefit recovered, beyond noise:\n")
    for title, t in tally.items():
        out.append(f"- {title}: above 0 on **{t['above']}**, below on **{t['below']}**, a tie "
                   f"on {t['tie']} of {sum(t.values())} pairs.")
    for kind, pairs in (r.get("long_range") or {}).items():
        out.extend(long_range_intervals(kind, pairs, per_window["long_range"].get(kind, {})))
    return out


def long_range_intervals(kind, pairs, per_window):
    out = [f"\nLong-range share on the {kind} windows with its {LEVEL:.0%} interval: the best "
           f"served mapper (by estimate), token identity, and the best mapper without the "
           f"target RoPE.\n",
           "| pair | best mapper | token identity | best mapper, no target RoPE |",
           "|---|---|---|---|"]
    short = matched = 0
    for name, p in pairs.items():
        ce = per_window.get(name, {}).get("ce")
        if ce is None or abs(p["copy_gain"]["own"]) < MIN_COPY_GAIN:
            out.append(f"| {name} | undefined | - | - |")
            continue
        share = p["long_range"]
        best = max(served(share), key=lambda c: share[c])
        best_share = intervals.share_interval(ce, best, LEVEL)
        cells = [f"{KIND_NAMES[best]}: {ci(*best_share)}"]
        for label in ("identity", best + NO_ROPE):
            cells.append(ci(*intervals.share_interval(ce, label, LEVEL)) if label in ce else "-")
        if set(name.split("->")) <= MATCHED:
            matched += 1
            short += best_share[2] < 0.90
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out.append(f"\nOn {short} of {matched} matched pairs the best mapper's whole interval lies "
               f"below the goal of 0.90.")
    return out


NO_ROPE = "_no_target_rope"


def main():
    results, md = sys.argv[1], sys.argv[2]
    with open(results) as fh:
        r = json.load(fh)
    per_window = None
    pw_path = os.path.join(os.path.dirname(results), "per_window.json")
    if os.path.exists(pw_path):  # runs from before 2026-12-05 evening have none
        with open(pw_path) as fh:
            per_window = json.load(fh)
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
        fh.write(head + BEGIN + "\n" + tables(r, per_window) + "\n" + END + tail)


if __name__ == "__main__":
    main()
