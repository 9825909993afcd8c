#!/usr/bin/env python3
"""Runs the full retention evaluation on the bundled family and writes docs/EVAL.md.

    bazel build //eval:run_eval
    PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/run_eval --work=/tmp/kvt-eval --out_md=docs/EVAL.md

(the venv only on the program's PATH: on Bazel's, it would change every action's environment).

Dumps, fits (every ordered matched pair, several k, plus the untrained-source controls; per
kind pair the ridge, the ridge refined on attention outputs, the MLP and the MLP refined on
attention outputs), one kvtd for all
mappers, then the measures of eval/retention.py on today's held-out windows and on the
long-range windows (a passage repeated after a gap; planted key -> value lookups); results.json
and the SVG plots go next to the Markdown (docs/eval/).
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import time

import torch

import kvt
import fits_done
import retention as R


# The mapper kinds of each kind pair and their store-id suffixes (after "{a}-to-{b}-k{k}").
KINDS = {"ridge": "", "ridge_refined": "-refined", "mlp": "-mlp", "mlp_refined": "-mlp-refined"}
MLP_KINDS = ("mlp", "mlp_refined")
# The same four as window mappers (kvt fit --window, docs/MAPPER_FORMAT.md): "w_" + kind.
WINDOW_PREFIX = "w_"


def kinds_of(window):
    """Every evaluated kind and its suffix: KINDS, and with a window > 1 the window kinds."""
    kinds = dict(KINDS)
    if window > 1:
        kinds.update({WINDOW_PREFIX + kind: f"-w{window}{suffix}" for kind, suffix in KINDS.items()})
    return kinds


def base_kind(kind):
    """The token-wise kind a (window) kind is fitted like: "w_mlp" -> "mlp"."""
    return kind[len(WINDOW_PREFIX):] if kind.startswith(WINDOW_PREFIX) else kind


def run_all(jobs, workers):
    """Calls every job, `workers` at a time (they wait on `kvt fit` processes); the first error
    is raised."""
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def fmt(x, digits=3):
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default=R.MODELS)
    p.add_argument("--members", default="S,M,L,U")
    p.add_argument("--pairs", default="S:L,L:S,M:L,L:M,U:L,L:U")
    p.add_argument("--ks", default="1,2,3")
    p.add_argument("--main_k", default="2")
    p.add_argument("--calib_windows", type=int, default=64)
    p.add_argument("--calib_tokens", type=int, default=512)
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--kind_pairs", default="all",
                   help="pairs fitted with kvt fit --kind both (ridge vs MLP): 'all' ordered "
                        "pairs of --members, '' none, or A:B,...")
    p.add_argument("--mlp_hidden", type=int, default=R.MLP_FLAGS["mlp_hidden"])
    p.add_argument("--mlp_epochs", type=int, default=R.MLP_FLAGS["mlp_epochs"])
    p.add_argument("--mlp_batch", type=int, default=R.MLP_FLAGS["mlp_batch"])
    p.add_argument("--mlp_max_observations", type=int,
                   default=R.MLP_FLAGS["mlp_max_observations"])
    p.add_argument("--mlp_control_targets", default="L",
                   help="for kind pairs into these members also fit an MLP from the untrained "
                        "source (the untrained-source control of the MLP and, from the same "
                        "fit, of the refined MLP); '' none")
    p.add_argument("--jobs", type=int, default=1, help="kvt fit processes at once")
    p.add_argument("--mlp_pairs", default="all",
                   help="kind pairs that also get the MLP and the refined MLP (kvt fit --kind "
                        "both --refine=attention); the others get the refined ridge alone "
                        "(--kind ridge --refine=attention): 'all' or A:B,...")
    p.add_argument("--refined_control_targets", default="all",
                   help="kind pairs into these members also get the refined ridge from the "
                        "untrained source: 'all' or a list")
    p.add_argument("--reuse_fits", action="store_true",
                   help="resume: keep every fit an interrupted run with the same settings "
                        "completed (--work/fits-done records each with its report and wall "
                        "time; the fits are deterministic) and fit the rest")
    p.add_argument("--fits_from", default="",
                   help="an earlier run's results.json whose fits are all in --work's store: "
                        "fit nothing, take the fit reports and fit times it recorded, and "
                        "rerun the evaluation alone (e.g. on more windows)")
    p.add_argument("--window", type=int, default=4,
                   help="every kind pair also gets the four kinds as window mappers reading "
                        "this many tokens (kvt fit --window), with their untrained-source "
                        "controls; <= 1: none")
    p.add_argument("--long_windows", type=int, default=32,
                   help="long-range windows per kind (copy, lookup); 0: none")
    p.add_argument("--long_seed", type=int, default=0)
    p.add_argument("--drift_pair", default="S:L")
    p.add_argument("--drift_windows", type=int, default=8)
    p.add_argument("--segment", type=int, default=40)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--work", required=True)
    p.add_argument("--out_md", required=True)
    args = p.parse_args()
    # `bazel run` starts in the runfiles: relative paths are the caller's.
    caller = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd())
    args.work = os.path.join(caller, args.work)
    args.out_md = os.path.join(caller, args.out_md)
    os.makedirs(args.work, exist_ok=True)
    start = time.time()
    torch.set_num_threads(1)

    calib = R.write_split("calib", os.path.join(args.work, "calib.jsonl"))
    members = {}
    dumps = {}
    names = args.members.split(",")
    if args.kind_pairs == "all":
        kind_pairs = [(a, b) for a in names for b in names if a != b]
    else:
        kind_pairs = [tuple(x.split(":")) for x in args.kind_pairs.split(",") if x]
    pairs = [tuple(x.split(":")) for x in args.pairs.split(",")]
    # Every member a mapper targets dumps its queries too: kvt fit then records each mapper's
    # held-out attention-output cosine (and --kind both compares the kinds on it).
    targets = {b for _, b in pairs} | {b for _, b in kind_pairs} | set(args.drift_pair.split(":"))
    for m in names:
        d = os.path.join(args.family, m)
        members[m] = R.Member(d)
        dumps[m] = R.dump(d, calib, os.path.join(args.work, "dumps", m), args.calib_tokens,
                          args.calib_windows, queries=m in targets)
    store = os.path.join(args.work, "store")
    untrained = {}
    mlp_pairs = (kind_pairs if args.mlp_pairs == "all" else
                 [p for p in kind_pairs if f"{p[0]}:{p[1]}" in args.mlp_pairs.split(",")])
    controls = [(a, b) for a, b in mlp_pairs if b in args.mlp_control_targets.split(",")]
    refined_controls = [(a, b) for a, b in kind_pairs if args.refined_control_targets == "all"
                        or b in args.refined_control_targets.split(",")]
    for s in sorted({a for a, _ in pairs} | {a for a, _ in kind_pairs}):
        udir = R.make_untrained(members[s].dir, os.path.join(args.work, "untrained", s))
        untrained[s] = R.Member(udir)
        dumps[s + "0"] = R.dump(udir, calib, os.path.join(args.work, "dumps", s + "0"),
                                args.calib_tokens, args.calib_windows)
    mlp_flags = {"mlp_hidden": args.mlp_hidden, "mlp_epochs": args.mlp_epochs,
                 "mlp_batch": args.mlp_batch, "mlp_lr": R.MLP_FLAGS["mlp_lr"],
                 "mlp_max_observations": args.mlp_max_observations}
    k2 = args.main_k
    ks = args.ks.split(",")
    kinds = kinds_of(args.window)
    window_flags = [f"--window={args.window}"] if args.window > 1 else []

    earlier = None
    if args.fits_from:
        with open(os.path.join(caller, args.fits_from)) as f:
            earlier = json.load(f)

    done = fits_done.FitsDone(os.path.join(args.work, "fits-done"), args.reuse_fits)

    def fit(a, b, suffix, k=k2, phase="ridge", **kw):  # a "0": the untrained source
        member = untrained[a[0]] if a.endswith("0") else members[a]
        dest = os.path.join(store, f"{a}-to-{b}-k{k}{suffix}")
        if earlier is not None:
            return lambda: reused(dest)

        outputs = [dest] + ([kw["unrefined_mlp_out"]] if kw.get("unrefined_mlp_out") else [])

        def job():
            if done.get(os.path.basename(dest), outputs) is not None:
                return dest
            t0 = time.time()
            R.fit(dumps[a], dumps[b], member.name, members[b].name, k, dest, **kw)
            done.put(os.path.basename(dest), {"seconds": round(time.time() - t0, 1),
                                              "phase": phase})
            return dest
        return job

    # The fits are independent `kvt fit` processes (one thread each): --jobs of them at once.
    ridge_fits = []
    da, db = args.drift_pair.split(":")
    for a, b in dict.fromkeys(pairs + [(da, db), (db, da)] + kind_pairs):
        for k in (ks if (a, b) in pairs else [k2]):
            ridge_fits.append(fit(a, b, "", k))
    for a, b in sorted(set(pairs) | set(kind_pairs)):
        ridge_fits.append(fit(a + "0", b, ""))
    if window_flags:  # the window ridge and its untrained-source control, every kind pair
        for a, b in kind_pairs:
            for source in (a, a + "0"):
                ridge_fits.append(fit(source, b, kinds["w_ridge"], extra=window_flags))
    run_all(ridge_fits, args.jobs)
    print(f"eval: dumps and ridge fits done in {time.time() - start:.0f} s", flush=True)
    # Ridge vs refined ridge vs MLP vs refined MLP: kvt fit --kind both --refine=attention per
    # pair (both halves refined, the recommendation then between the refined ridge and the
    # refined MLP; --unrefined_mlp_out also writes the MSE-trained MLP it started from, so the
    # plain MLP costs no second training) beside the plain ridge above (the k sweep fits it
    # anyway); the untrained-source controls of the refined ridge (and, into
    # --mlp_control_targets, of the MLP and the refined MLP, from one --kind mlp fit).
    fit_reports = {}
    mlp_start = time.time()

    def fit_both(a, b, prefix=""):
        if earlier is not None:
            for label in ("ridge_refined", "mlp_refined", "mlp"):
                reused(os.path.join(store, f"{a}-to-{b}-k{k2}{kinds[prefix + label]}"))
            fit_reports[(a, b, prefix)] = earlier["kinds"][f"{a}->{b}"][
                "fit_report_window" if prefix else "fit_report"]
            return
        both = os.path.join(args.work, "both", f"{a}-to-{b}{kinds[prefix + 'ridge']}")
        outputs = [os.path.join(store, f"{a}-to-{b}-k{k2}{kinds[prefix + label]}")
                   for label in ("ridge_refined", "mlp_refined", "mlp")]
        kept = done.get(os.path.basename(both) + "-both", outputs)
        if kept is not None:
            fit_reports[(a, b, prefix)] = kept["report"]
            return
        t0 = time.time()
        report = R.fit(dumps[a], dumps[b], members[a].name, members[b].name, k2, both,
                       kind="both", mlp_flags=mlp_flags, refine=True,
                       unrefined_mlp_out=os.path.join(both, "mlp-unrefined"),
                       extra=window_flags if prefix else ())
        report["seconds"] = round(time.time() - t0, 1)
        for kind, label in (("ridge", "ridge_refined"), ("mlp", "mlp_refined"),
                            ("mlp-unrefined", "mlp")):
            dest = os.path.join(store, f"{a}-to-{b}-k{k2}{kinds[prefix + label]}")
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(os.path.join(both, kind), dest)
        fit_reports[(a, b, prefix)] = report
        done.put(os.path.basename(both) + "-both",
                 {"seconds": report["seconds"], "phase": "kinds", "report": report})
        print(f"eval: kvt fit --kind both {a}->{b}{' ' + window_flags[0] if prefix else ''}: "
              f"recommends {report['recommended']} ({report['seconds']:.0f} s)", flush=True)
    prefixes = [""] + ([WINDOW_PREFIX] if window_flags else [])
    jobs = []
    for prefix in prefixes:
        extra = window_flags if prefix else ()
        jobs += ([lambda a=a, b=b, prefix=prefix: fit_both(a, b, prefix) for a, b in mlp_pairs] +
                 [fit(a, b, kinds[prefix + "ridge_refined"], phase="kinds", refine=True,
                      extra=extra)
                  for a, b in kind_pairs if (a, b) not in mlp_pairs] +
                 [fit(a + "0", b, kinds[prefix + "ridge_refined"], phase="kinds", refine=True,
                      extra=extra)
                  for a, b in refined_controls] +
                 [fit(a + "0", b, kinds[prefix + "mlp_refined"], phase="kinds", kind="mlp",
                      mlp_flags=mlp_flags, refine=True, extra=extra, unrefined_mlp_out=os.path.join(
                          store, f"{a}0-to-{b}-k{k2}{kinds[prefix + 'mlp']}"))
                  for a, b in controls])
    run_all(jobs, args.jobs)
    kind_fit_seconds = (earlier["kind_fit_seconds"] if earlier is not None
                        else round(time.time() - mlp_start))
    if done.reused:  # this run's wall time misses the reused fits: count each fit's own
        kind_fit_seconds = round(done.seconds_total("kinds") / max(1, args.jobs))
    print(f"eval: dumps and fits done in {time.time() - start:.0f} s", flush=True)

    calib_windows = R.calib_windows(args.calib_tokens, args.calib_windows)
    identity = {}
    windows = R.heldout_windows(args.context + args.continuation + 1, args.windows)
    settings = dict(vars(args))
    settings["command"] = "bazel-bin/eval/run_eval " + " ".join(sys.argv[1:])
    results = {"pairs": {}, "settings": settings}
    with R.start_kvtd(store) as server, kvt.Client(server.address, timeout=120) as client:
        for a, b in pairs:
            if b not in identity:
                identity[b] = R.TokenIdentityMap(members[b], calib_windows)
            for k in ks:
                extra = {}
                if k == args.main_k:
                    extra = {"identity": identity[b],
                             "untrained": (untrained[a], f"{a}0-to-{b}-k{k}")}
                r = R.evaluate_pair(client, members[a], members[b], f"{a}-to-{b}-k{k}", windows,
                                    args.context, extra)
                results["pairs"][f"{a}->{b} k={k}"] = r
                print(f"eval: {a}->{b} k={k}: benefit {r['benefit']['mapped']['all']:.3f} "
                      f"({time.time() - start:.0f} s)", flush=True)
        results["kinds"] = {}
        long_range = {}
        if args.long_windows > 0:
            n, c = args.long_windows, args.context
            long_range = {"copy": R.copy_windows(c, args.continuation, n, args.long_seed),
                          "lookup": R.lookup_windows(c, args.continuation, n, args.long_seed)}
            results["long_range"] = {kind: {} for kind in long_range}
        for a, b in kind_pairs:
            if b not in identity:
                identity[b] = R.TokenIdentityMap(members[b], calib_windows)
            ids = {kind: f"{a}-to-{b}-k{args.main_k}{suffix}" for kind, suffix in kinds.items()
                   if base_kind(kind) not in MLP_KINDS or (a, b) in mlp_pairs}
            controls_of = {kind: (untrained[a], f"{a}0-to-{b}-k{args.main_k}{suffix}")
                           for kind, suffix in kinds.items()
                           if {"mlp": (a, b) in controls, "mlp_refined": (a, b) in controls,
                               "ridge_refined": (a, b) in refined_controls}.get(base_kind(kind),
                                                                                True)}
            labels = dict(ids, **{kind + "_untrained": mid
                                  for kind, (_, mid) in controls_of.items()})
            r = R.evaluate_kinds(client, members[a], members[b], labels, windows, args.context,
                                 {kind + "_untrained": member
                                  for kind, (member, _) in controls_of.items()})
            if (a, b, "") in fit_reports:
                r["fit_report"] = fit_reports[(a, b, "")]
            if (a, b, WINDOW_PREFIX) in fit_reports:
                r["fit_report_window"] = fit_reports[(a, b, WINDOW_PREFIX)]
            results["kinds"][f"{a}->{b}"] = r
            print(f"eval: {a}->{b} " + " / ".join(ids) + ": benefit "
                  + " / ".join(f"{r[kind]['benefit']:.3f}" for kind in ids)
                  + f", recommended {r.get('fit_report', {}).get('recommended')} "
                  f"({time.time() - start:.0f} s)", flush=True)
            for kind, (lw, lc) in long_range.items():
                lr = R.evaluate_long_range(client, members[a], members[b], ids, lw, lc,
                                           args.context, identity[b], controls_of)
                if kind == "copy":
                    # Where the copy is lost (per target layer), for the paper's mapper and the
                    # MLP (when fitted).
                    lr["layer_probe"] = {
                        label: R.copy_layer_probe(client, members[a], members[b], ids[label],
                                                  lw, lc, args.context)
                        for label in ("ridge", "mlp", "w_mlp") if label in ids}
                results["long_range"][kind][f"{a}->{b}"] = lr
                print(f"eval: {a}->{b} {kind} windows: copy gain own {lr['copy_gain']['own']:.3f}"
                      f" nats/byte ({time.time() - start:.0f} s)", flush=True)
            # A long run interrupted keeps what it measured (not read back by anything).
            with open(os.path.join(args.work, "results.partial.json"), "w") as f:
                json.dump(results, f, indent=1)
        results["kind_fit_seconds"] = kind_fit_seconds
        results["kind_fit_seconds_resumed"] = done.reused > 0
        drift_windows = R.heldout_windows(args.segment * (args.turns + 1) + 1,
                                          args.drift_windows)
        results["drift"] = R.multi_turn(client, members[da], members[db],
                                        f"{da}-to-{db}-k{args.main_k}",
                                        f"{db}-to-{da}-k{args.main_k}", drift_windows,
                                        args.segment, args.turns)
    results["family"] = {}
    for m, member in members.items():
        with open(os.path.join(member.dir, "summary.json")) as f:
            s = json.load(f)
        c = member.config
        results["family"][m] = {"name": member.name, "layers": c.num_hidden_layers,
                                "hidden": c.hidden_size, "heads": c.num_attention_heads,
                                "kv_heads": c.num_key_value_heads, "head_dim": member.head_dim,
                                "parameters": s["parameters"],
                                # Both runs when a member was trained further (--init).
                                "tokens": s.get("tokens_total", s["tokens"]),
                                "teacher": os.path.basename(s["teacher"]) or "-",
                                "bpb": s["heldout_bits_per_byte"]}
    results["seconds"] = round(time.time() - start)
    out_dir = os.path.join(os.path.dirname(args.out_md), "eval")
    os.makedirs(out_dir, exist_ok=True)
    # The per-window figures (what write_eval_md's intervals resample) go to a compact file of
    # their own, keyed as in results.json, so results.json stays readable.
    per_window = split_per_window(results)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "per_window.json"), "w") as f:
        json.dump(per_window, f, separators=(",", ":"))
    plots(results, out_dir, args.main_k)
    import write_eval_md
    sys.argv = ["write_eval_md", os.path.join(out_dir, "results.json"), args.out_md]
    write_eval_md.main()
    print(f"eval: done in {results['seconds']} s; results in {out_dir}/results.json")


def reused(mapper_dir):
    """--fits_from: the mapper an earlier run fitted, which must still be in the store."""
    if not os.path.exists(os.path.join(mapper_dir, "manifest.yaml")):
        raise SystemExit(f"--fits_from: {mapper_dir} is not in --work's store (fitted by a "
                         f"different run?); rerun without --fits_from")
    return mapper_dir


def split_per_window(results):
    """Removes every "per_window" from results; returns them as {"pairs": {name: ...}, "kinds":
    {...}, "long_range": {kind: {...}}}."""
    out = {"pairs": {}, "kinds": {}, "long_range": {}}
    for section in ("pairs", "kinds"):
        for name, r in results.get(section, {}).items():
            out[section][name] = r.pop("per_window")
    for kind, pairs in results.get("long_range", {}).items():
        out["long_range"][kind] = {name: r.pop("per_window") for name, r in pairs.items()}
    return out


def plots(results, out_dir, main_k):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["mapped", "identity", "untrained", "untranslated", "no_target_rope"]
    names = [n for n in results["pairs"] if n.endswith(f"k={main_k}")]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.16
    for i, key in enumerate(keys):
        vals = [results["pairs"][n]["benefit"].get(key, {}).get("all", float("nan"))
                for n in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=key)
    ax.set_xticks([j + 2 * width for j in range(len(names))])
    ax.set_xticklabels([n.split(" ")[0] for n in names])
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.axhline(0.0, color="black", linewidth=0.5)
    # Targets that barely use context give ratios far outside [0, 1] (docs/EVAL.md): clip the
    # axis so the rows into L stay readable; the tables have the values.
    ax.set_ylim(-1.5, 1.5)
    ax.set_ylabel("context benefit recovered (axis clipped)")
    ax.set_title(f"Held-out context benefit recovered (k={main_k})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "benefit.svg"))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([d["turn"] for d in results["drift"]], [d["benefit"] for d in results["drift"]], "o-")
    ax.set_xlabel("turn (handoff)")
    ax.set_ylabel("benefit recovered")
    ax.set_title("Multi-turn drift: alternating handoffs")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "drift.svg"))


if __name__ == "__main__":
    main()
