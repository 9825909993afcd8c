"""Paired bootstrap intervals over windows: how sure a figure measured on the same windows under
several conditions is (docs/EVAL.md, "How sure"; kvt.qualify's benefit interval).

Every condition is scored on the same windows, so a comparison (a translated cache against the
target's own prefill and against no context) is paired: resampling the windows, not the tokens,
keeps both the pairing and the correlation of the tokens inside one window, which a per-token
standard error would ignore. numpy only. The evaluation's intervals (eval/intervals.py) are built
on this one.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Sequence, Tuple

import numpy as np


def paired_bootstrap(per_window: Mapping[str, Sequence[float]],
                     statistic: Callable[[Dict[str, Any]], Any], resamples: int = 4000,
                     seed: int = 0, level: float = 0.95) -> Tuple[float, float, float]:
    """per_window {condition: [value per window]}, every list over the same windows in the same
    order; statistic(means) -> the figure, where means {condition: mean over windows} holds
    floats for the estimate and arrays (one entry per resample) for the interval, so it must be
    written with numpy operations. Returns (estimate, low, high): the statistic on all windows
    and the percentile interval of `level` over `resamples` resamples of the windows (resamples
    where the statistic is undefined, e.g. a ratio over 0, are left out)."""
    arrays = {key: np.asarray(values, dtype=np.float64) for key, values in per_window.items()}
    lengths = {len(a) for a in arrays.values()}
    if len(lengths) != 1:
        raise ValueError(f"per_window: conditions over different window counts {sorted(lengths)}")
    n = lengths.pop()
    if n < 2:
        raise ValueError(f"per_window: {n} window(s); an interval needs at least 2")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n, size=(resamples, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = float(statistic({key: float(a.mean()) for key, a in arrays.items()}))
        samples = np.asarray(statistic({key: a[picks].mean(axis=1)
                                        for key, a in arrays.items()}), dtype=np.float64)
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return estimate, float("nan"), float("nan")
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(samples, [tail, 1.0 - tail])
    return estimate, float(low), float(high)


def benefit_of(means: Mapping[str, Any], label: str) -> Any:
    """Benefit recovered by `label`, (CE_none - CE_label) / (CE_none - CE_own), from mean CE per
    condition (floats, or arrays of resampled means)."""
    return (means["none"] - means[label]) / (means["none"] - means["own"])
