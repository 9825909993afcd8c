"""eval/compare_runs.py on synthetic runs with known differences: the before and after figures
and the paired change match a float64 reference, a change far beyond the noise is counted
above, no change is a tie, and runs on different windows are refused with the window named."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import compare_runs
import intervals


def run_pair(rng, n, ridge_gain, mlp_gain):
    """Per-window CE of one pair on today's windows and on copy windows, before and after a
    refit that lowers the ridge's CE by ridge_gain and the MLP's by mlp_gain (nats/byte)."""
    own = rng.normal(1.3, 0.2, n)
    none = own + 0.15 + rng.normal(0, 0.02, n)
    ridge = own + 0.08 + rng.normal(0, 0.02, n)
    mlp = own + 0.06 + rng.normal(0, 0.02, n)
    before = {"own": own, "none": none, "ridge": ridge, "mlp": mlp}
    after = {"own": own, "none": none, "ridge": ridge - ridge_gain, "mlp": mlp - mlp_gain}
    c_own = own + 1.0 + rng.normal(0, 0.05, n)  # the copy's control: no earlier copy
    copy_before = {"own": own, "none": none, "control_own": c_own,
                   "ridge": c_own - 0.1, "control_ridge": c_own + 0.001,
                   "mlp": c_own - 0.5 + rng.normal(0, 0.02, n), "control_mlp": c_own + 0.002}
    copy_after = dict(copy_before, mlp=copy_before["mlp"] - 0.2)
    as_lists = lambda d: {k: [float(x) for x in v] for k, v in d.items()}
    return ({"kinds": {"M->L": {"ce": as_lists(before)}},
             "long_range": {"copy": {"M->L": {"ce": as_lists(copy_before)}}}},
            {"kinds": {"M->L": {"ce": as_lists(after)}},
             "long_range": {"copy": {"M->L": {"ce": as_lists(copy_after)}}}})


class CompareRunsTest(unittest.TestCase):

    def setUp(self):
        self.before, self.after = run_pair(np.random.default_rng(5), 64, 0.0, 0.03)

    def test_figures_match_float64_reference(self):
        result = compare_runs.compare(self.before, self.after, ("ridge", "mlp"))
        ce_b = {k: np.asarray(v, np.float64) for k, v in self.before["kinds"]["M->L"]["ce"].items()}
        ce_a = {k: np.asarray(v, np.float64) for k, v in self.after["kinds"]["M->L"]["ce"].items()}
        ref = lambda ce, k: (ce["none"].mean() - ce[k].mean()) / (ce["none"].mean() - ce["own"].mean())
        b, a, est, low, high = result["benefit"]["M->L"]["mlp"]
        self.assertAlmostEqual(b, ref(ce_b, "mlp"), places=12)
        self.assertAlmostEqual(a, ref(ce_a, "mlp"), places=12)
        self.assertAlmostEqual(est, a - b, places=12)
        self.assertLess(low, est)
        self.assertLess(est, high)
        self.assertEqual(intervals.verdict(low, high), "above")  # 0.03 of a 0.15 gain: 0.2
        # The ridge did not change: a gap of exactly 0, its interval a point, a tie.
        b, a, est, low, high = result["benefit"]["M->L"]["ridge"]
        self.assertAlmostEqual(est, 0.0, places=12)
        self.assertEqual(intervals.verdict(low, high), "tie")
        lr_b = {k: np.asarray(v) for k, v in self.before["long_range"]["copy"]["M->L"]["ce"].items()}
        share = lambda ce, k: ((ce["control_" + k].mean() - ce[k].mean())
                               / (ce["control_own"].mean() - ce["own"].mean()))
        b, a, est, low, high = result["copy share"]["M->L"]["mlp"]
        self.assertAlmostEqual(b, share(lr_b, "mlp"), places=12)
        self.assertAlmostEqual(est, a - b, places=12)
        self.assertEqual(intervals.verdict(low, high), "above")
        self.assertEqual(compare_runs.counts(result["copy share"]),
                         {"ridge": (0, 0, 1), "mlp": (1, 0, 0)})

    def test_other_windows_are_refused(self):
        moved = json.loads(json.dumps(self.after))
        moved["kinds"]["M->L"]["ce"]["own"][7] += 0.01
        with self.assertRaisesRegex(ValueError, "'own' differs on window 7"):
            compare_runs.compare(self.before, moved)

    def test_command_line_prints_the_table(self):
        with tempfile.TemporaryDirectory() as d:
            paths = []
            for name, run in (("before", self.before), ("after", self.after)):
                paths.append(os.path.join(d, name + ".json"))
                with open(paths[-1], "w") as f:
                    json.dump(run, f)
            out = subprocess.run(
                [sys.executable, compare_runs.__file__, "--before=" + paths[0],
                 "--after=" + paths[1], "--before_label=64 windows", "--after_label=256"],
                capture_output=True, text=True, check=True).stdout
            self.assertIn("benefit, 64 windows -> 256", out)
            self.assertIn("| M->L |", out)
            self.assertIn("MLP up on 1, down on 0", out)
            bad = subprocess.run([sys.executable, compare_runs.__file__, "--before=" + paths[0],
                                  "--after=" + paths[1], "--kinds=ridge,lasso"],
                                 capture_output=True, text=True)
            self.assertNotEqual(bad.returncode, 0)
            self.assertIn("unknown ['lasso']", bad.stderr)


if __name__ == "__main__":
    unittest.main()
