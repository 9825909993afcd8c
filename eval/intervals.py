"""Paired bootstrap intervals over evaluation windows: how sure a difference between two
conditions measured on the same held-out windows is (docs/EVAL.md, "How sure").

Every condition of the evaluation is scored on the same windows, so a comparison (refined ridge
against plain ridge, a mapper against token identity) is paired: resampling the windows, not the
tokens, keeps both the pairing and the correlation of the tokens inside one window, which a
per-token standard error would ignore. The bootstrap itself and benefit_of live in the kvt
package (kvt.intervals: numpy only, so write_eval_md can import it without torch), where
kvt.qualify uses them too; the evaluation's figures are built on the same code.
"""

import numpy as np

from kvt.intervals import benefit_of, paired_bootstrap  # noqa: F401  (intervals.paired_bootstrap)


def share_of(means, label):
    """The long-range share of `label`, its copy gain over own's, from mean CE per condition of
    the long-range windows and of their controls ("control_" keys)."""
    return ((means["control_" + label] - means[label])
            / (means["control_own"] - means["own"]))


def benefit_interval(ce, label, level=0.95):
    """benefit_of `label` with its interval, from per-window CE {condition: [...]} (retention's
    per_window["ce"])."""
    data = {key: ce[key] for key in ("own", "none", label)}
    return paired_bootstrap(data, lambda m: benefit_of(m, label), level=level)


def benefit_gap(ce, better, worse, level=0.95):
    """benefit(better) - benefit(worse) with its paired interval, from per-window CE."""
    data = {key: ce[key] for key in ("own", "none", better, worse)}
    return paired_bootstrap(data, lambda m: (m[worse] - m[better]) / (m["none"] - m["own"]),
                            level=level)


def share_interval(ce, label, level=0.95):
    """The long-range share of `label` (its copy gain / own's) with its interval, from the
    per-window CE of the long-range windows and of their controls ("control_" keys; window i's
    control is control i)."""
    data = {key: ce[key] for key in ("own", "control_own", label, "control_" + label)}
    return paired_bootstrap(data, lambda m: share_of(m, label), level=level)


def share_gap(ce, better, worse, level=0.95):
    """share(better) - share(worse) on the same long-range windows, with its paired interval."""
    keys = ("own", "control_own", better, "control_" + better, worse, "control_" + worse)
    return paired_bootstrap(
        {key: ce[key] for key in keys},
        lambda m: ((m["control_" + better] - m[better]) - (m["control_" + worse] - m[worse]))
        / (m["control_own"] - m["own"]), level=level)


def verdict(low, high):
    """"above" when the whole interval is above 0, "below" when below, else "tie"."""
    if low > 0:
        return "above"
    if high < 0:
        return "below"
    return "tie"


def attach_reference(ce, reference_ce, labels, prefix="ref_", tolerance=1e-5):
    """Adds conditions of an earlier run (its per-window CE, e.g. docs/eval/per_window.json's
    token identity) to this run's per-window CE as prefix + label, so they can be compared
    paired. Only valid on the same windows scored by the same target: the conditions both runs
    share and that no mapper touches ("own", "none", "control_own") must agree window by window
    within `tolerance` nats/byte, else ValueError names the first that differs. Long-range CE
    also carries each label's "control_" + label, attached beside it."""
    shared = [key for key in ("own", "none", "control_own") if key in ce and key in reference_ce]
    if "own" not in shared:
        raise ValueError("reference: no per-window 'own' CE in both runs to check the windows by")
    for key in shared:
        mine, theirs = np.asarray(ce[key], np.float64), np.asarray(reference_ce[key], np.float64)
        if mine.shape != theirs.shape:
            raise ValueError(f"reference: '{key}' over {theirs.size} windows, this run "
                             f"{mine.size}: not the same windows")
        worst = int(np.argmax(np.abs(mine - theirs)))
        if abs(mine[worst] - theirs[worst]) > tolerance:
            raise ValueError(f"reference: '{key}' differs on window {worst} ({mine[worst]:.6f} "
                             f"here, {theirs[worst]:.6f} there): not the same windows or target")
    out = dict(ce)
    for label in labels:
        if label not in reference_ce:
            raise ValueError(f"reference: no condition '{label}' (it has "
                             f"{sorted(k for k in reference_ce if not k.startswith('control_'))})")
        out[prefix + label] = reference_ce[label]
        if "control_" + label in reference_ce:
            out["control_" + prefix + label] = reference_ce["control_" + label]
    return out
