"""How much the held-out attention-output cosine varies from one held-out sequence to the next:
the number behind `kvt fit`'s minimum held-out sequence count (docs/FIT.md, "Held-out quality
and the gate"). Dumps S, M, L over 128 calibration windows of 256 tokens (queries on), fits ridge
M -> L, L -> M, S -> L, L -> S holding out half of them, and prints each fit's mean, 95% lower
bound and the per-sequence standard deviation they imply.

    bazel build //eval:heldout_spread && PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/heldout_spread
"""

import math
import os
import sys
import tempfile

import yaml

import retention as R

WINDOWS, TOKENS = 128, 256
PAIRS = (("M", "L"), ("L", "M"), ("S", "L"), ("L", "S"))


def t95(dof):
    """Student t's 0.95 quantile for dof >= 30, as quality/mean_interval.cc computes it there."""
    assert dof >= 30, dof
    z = 1.6448536269514722
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


def main():
    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kvt-spread-")
    calib = R.write_split("calib", os.path.join(work, "calib.jsonl"))
    dumps = {m: R.dump(os.path.join(R.MODELS, m), calib, os.path.join(work, "dumps", m), TOKENS,
                       WINDOWS, queries=True) for m in ("S", "M", "L")}
    for s, t in PAIRS:
        out = os.path.join(work, f"{s}-to-{t}")
        R.fit(dumps[s], dumps[t], f"kvt-tiny-{s}", f"kvt-tiny-{t}", 2, out,
              extra=["--heldout_fraction=0.5"])
        with open(os.path.join(out, "manifest.yaml")) as f:
            q = yaml.safe_load(f)["quality"]
        n, mean = q["heldout_sequences"], q["attention_cosine_heldout"]
        low = q["attention_cosine_heldout_lower95"]
        sd = (mean - low) * math.sqrt(n) / t95(n - 1)
        print(f"{s} -> {t}: {n} held-out sequences, mean {mean:.4f}, lower95 {low:.4f}, "
              f"per-sequence sd {sd:.4f}", flush=True)


if __name__ == "__main__":
    main()
