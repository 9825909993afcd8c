"""eval/per_head_md.py on synthetic per_head_eval rows: the pair order, the interval and
difference formatting, the ratios, and the measured choice (per_layer only where per_head loses
beyond noise on benefit or KL) checked against the recommendation."""

import json
import os
import tempfile
import unittest

import per_head_md


def row(pair, benefit_gap, kl_gap, recommended="per_layer", copy=True):
    granularity = {"benefit": [0.4, 0.3, 0.5], "benefit_first": 0.55, "kl": 0.28,
                   "kl_first": 0.35, "ppl_ratio": 1.07, "attention_cosine": 0.85, "c_k": 1.3,
                   "benefit_no_target_rope": 0.1, "kl_no_target_rope": 0.33}
    r = {"pair": pair, "recommended": recommended,
         "fit_cosine": {"ridge": 0.86, "ridge_per_head": 0.84},
         "bytes": {"ridge": 198144, "ridge_per_head": 99840},
         "translate_ms": {"ridge": 2.0, "ridge_per_head": 1.5},
         "ridge": granularity, "ridge_per_head": dict(granularity, kl=0.30),
         "ridge_untrained": dict(granularity, benefit=[0.08, 0.0, 0.2]),
         "ridge_per_head_untrained": dict(granularity, benefit=[0.05, -0.1, 0.2]),
         "per_head_minus_per_layer": {"benefit": benefit_gap, "kl": kl_gap}}
    if copy:
        r["copy_share"] = {"ridge": [0.1, 0.05, 0.15], "ridge_per_head": [0.08, 0.03, 0.13],
                           "ridge_untrained": [0.01, -0.02, 0.04],
                           "ridge_per_head_untrained": [0.0, -0.03, 0.03]}
        r["copy_share_per_head_minus_per_layer"] = [-0.02, -0.04, 0.0]
    return r


class PerHeadMdTest(unittest.TestCase):

    def test_measured_choice(self):
        self.assertEqual(per_head_md.measured_choice(
            row("M->L", [-0.1, -0.2, -0.01], [0.0, -0.01, 0.01])), "per_layer")
        self.assertEqual(per_head_md.measured_choice(
            row("M->L", [0.0, -0.1, 0.1], [0.02, 0.01, 0.03])), "per_layer")
        self.assertEqual(per_head_md.measured_choice(
            row("M->L", [-0.05, -0.1, 0.01], [0.01, -0.01, 0.03])), "per_head")

    def test_tables(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rows.jsonl")
            with open(path, "w") as f:
                u_l = row("U->L", [0.0, -0.1, 0.1], [0.0, -0.01, 0.01], "per_head")
                u_l["compute_ms"] = {"ridge": 0.8, "ridge_per_head": 0.4}
                for r in (u_l,
                          row("S->M", [-0.1, -0.2, -0.05], [0.02, 0.01, 0.03], copy=False)):
                    f.write(json.dumps(r) + "\n")
            rows = per_head_md.load(path)
        self.assertEqual([r["pair"] for r in rows], ["S->M", "U->L"])
        measures = per_head_md.measures_table(rows).splitlines()
        self.assertEqual(len(measures), 2 + 4)
        self.assertIn("| S->M | per_layer | 0.400 [0.300, 0.500] (0.550) | 0.280 (0.350) | - | - "
                      "| 0.080 / - | 0.100 / 0.330 | 198,144 | 2.00 / - |", measures)
        self.assertIn("| U->L | per_head | 0.400 [0.300, 0.500] (0.550) | 0.300 (0.350) | "
                      "0.080 [0.030, 0.130] | - | 0.050 / 0.000 | 0.100 / 0.330 | 99,840 | "
                      "1.50 / 0.400 |",
                      measures)
        diff = per_head_md.difference_table(rows).splitlines()
        self.assertEqual(len(diff), 2 + 2)
        self.assertEqual(diff[2], "| S->M | -0.100 [-0.200, -0.050] | +0.020 [+0.010, +0.030] | "
                                  "- | - | 0.504 | 0.75 / - | 0.8600 / 0.8400 (per_layer) | "
                                  "per_layer | yes |")
        self.assertTrue(diff[3].endswith("(per_head) | per_head | yes |"), diff[3])
        self.assertIn("-0.020 [-0.040, +0.000]", diff[3])
        self.assertIn("| 0.75 / 0.50 |", diff[3])


if __name__ == "__main__":
    unittest.main()
