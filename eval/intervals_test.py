"""eval/intervals.py against float64 references: the bootstrap interval of a paired mean
difference matches the normal-theory interval, covers the true difference at its level, and a
ratio statistic (benefit recovered) is computed as the evaluation computes it."""

import unittest

import numpy as np

import intervals


class PairedBootstrapTest(unittest.TestCase):

    def test_mean_difference_matches_normal_interval(self):
        rng = np.random.default_rng(1)
        n = 400
        shared = rng.normal(1.5, 0.4, n)  # what both conditions share on a window
        a = shared + rng.normal(0.0, 0.05, n)
        b = shared + 0.02 + rng.normal(0.0, 0.05, n)
        est, low, high = intervals.paired_bootstrap({"a": a, "b": b},
                                                    lambda m: m["b"] - m["a"], seed=3)
        d = b - a
        ref_half = 1.959964 * d.std(ddof=1) / np.sqrt(n)
        self.assertAlmostEqual(est, d.mean(), places=12)
        self.assertLess(abs((high - low) / 2 - ref_half) / ref_half, 0.1)
        self.assertLess(abs((high + low) / 2 - d.mean()), 0.2 * ref_half)
        # Paired: far narrower than the interval of either mean alone.
        self.assertLess(high - low, 0.2 * 2 * 1.96 * 0.4 / np.sqrt(n))
        self.assertEqual(intervals.verdict(low, high), "above")

    def test_coverage_at_its_level(self):
        rng = np.random.default_rng(2)
        truth, covered, trials = 0.1, 0, 300
        for t in range(trials):
            x = rng.normal(0.0, 1.0, 40)
            y = x + truth + rng.normal(0.0, 0.5, 40)
            _, low, high = intervals.paired_bootstrap({"x": x, "y": y},
                                                      lambda m: m["y"] - m["x"],
                                                      resamples=1000, seed=t)
            covered += low <= truth <= high
        # Binomial(300, 0.95) lies in [270, 294] with probability > 0.999; the percentile
        # bootstrap undercovers slightly at n = 40, hence the lower bound.
        self.assertGreaterEqual(covered, 265)
        self.assertLessEqual(covered, 294)

    def test_ratio_statistic_is_benefit_recovered(self):
        rng = np.random.default_rng(4)
        own = rng.normal(1.4, 0.2, 32)
        none = own + rng.uniform(0.1, 0.3, 32)
        mapped = own + 0.3 * (none - own)
        def benefit(m):
            return (m["none"] - m["mapped"]) / (m["none"] - m["own"])
        est, low, high = intervals.paired_bootstrap(
            {"own": own, "none": none, "mapped": mapped}, benefit)
        ref = (none.mean() - mapped.mean()) / (none.mean() - own.mean())
        self.assertAlmostEqual(est, ref, places=12)
        self.assertAlmostEqual(est, 0.7, places=12)
        # Every window recovers exactly 0.7 of its own gap: every resample does too.
        self.assertAlmostEqual(low, 0.7, places=9)
        self.assertAlmostEqual(high, 0.7, places=9)

    def test_evaluation_figures(self):
        # benefit_interval / benefit_gap / share_interval against their definitions in float64.
        rng = np.random.default_rng(5)
        own = rng.normal(1.0, 0.1, 16)
        ce = {"own": own, "none": own + 0.4, "a": own + 0.1, "b": own + 0.2,
              "control_own": own + 1.0, "control_a": own + 0.7}
        est, low, high = intervals.benefit_interval(ce, "a")
        self.assertAlmostEqual(est, 0.75, places=9)
        self.assertAlmostEqual(low, 0.75, places=9)
        self.assertAlmostEqual(high, 0.75, places=9)
        self.assertAlmostEqual(intervals.benefit_gap(ce, "a", "b")[0], 0.25, places=9)
        self.assertAlmostEqual(intervals.share_interval(ce, "a")[0], 0.6, places=9)
        ce["control_b"] = own + 0.5
        self.assertAlmostEqual(intervals.share_gap(ce, "a", "b")[0], 0.3, places=9)

    def test_attach_reference(self):
        # A condition of an earlier run on the same windows compares paired like one of this run.
        rng = np.random.default_rng(7)
        own = rng.normal(1.0, 0.1, 8)
        mine = {"own": own, "none": own + 0.4, "a": own + 0.1, "control_own": own + 1.0,
                "control_a": own + 0.7}
        earlier = {"own": own + 1e-7, "none": own + 0.4, "identity": own + 0.3,
                   "control_own": own + 1.0, "control_identity": own + 0.35}
        ce = intervals.attach_reference(mine, earlier, ["identity"])
        self.assertNotIn("ref_identity", mine)
        self.assertAlmostEqual(intervals.benefit_gap(ce, "a", "ref_identity")[0], 0.5, places=9)
        self.assertAlmostEqual(intervals.share_gap(ce, "a", "ref_identity")[0], 0.55, places=9)
        with self.assertRaisesRegex(ValueError, "no condition 'w_mlp'.*identity"):
            intervals.attach_reference(mine, earlier, ["w_mlp"])
        shifted = dict(earlier, none=np.concatenate([own[:3] + 0.4, own[3:] + 0.5]))
        with self.assertRaisesRegex(ValueError, "'none' differs on window 3"):
            intervals.attach_reference(mine, shifted, ["identity"])
        with self.assertRaisesRegex(ValueError, "over 7 windows, this run 8"):
            intervals.attach_reference(mine, {k: v[:7] for k, v in earlier.items()},
                                       ["identity"])

    def test_deterministic_for_a_seed(self):
        data = {"a": [1.0, 2.0, 4.0, 3.0], "b": [1.5, 2.0, 3.0, 3.5]}
        stat = lambda m: m["b"] - m["a"]
        self.assertEqual(intervals.paired_bootstrap(data, stat, seed=9),
                         intervals.paired_bootstrap(data, stat, seed=9))

    def test_undefined_resamples_are_left_out(self):
        # The denominator is 0 on resamples of only the first window.
        data = {"num": [1.0, 1.0, 1.0], "den": [0.0, 1.0, 1.0]}
        est, low, high = intervals.paired_bootstrap(data, lambda m: m["num"] / m["den"],
                                                    resamples=500)
        self.assertAlmostEqual(est, 1.5)
        self.assertTrue(np.isfinite(low) and np.isfinite(high))

    def test_bad_input_is_named(self):
        with self.assertRaisesRegex(ValueError, "different window counts"):
            intervals.paired_bootstrap({"a": [1.0, 2.0], "b": [1.0]}, lambda m: m["a"])
        with self.assertRaisesRegex(ValueError, "at least 2"):
            intervals.paired_bootstrap({"a": [1.0]}, lambda m: m["a"])

    def test_verdict(self):
        self.assertEqual(intervals.verdict(0.01, 0.2), "above")
        self.assertEqual(intervals.verdict(-0.2, -0.01), "below")
        self.assertEqual(intervals.verdict(-0.01, 0.2), "tie")


if __name__ == "__main__":
    unittest.main()
