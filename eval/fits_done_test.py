"""fits_done.FitsDone: what a resumed evaluation keeps and what it fits again."""

import os
import tempfile
import unittest

import fits_done


class FitsDoneTest(unittest.TestCase):

    def setUp(self):
        self.work = tempfile.mkdtemp()
        self.records = os.path.join(self.work, "fits-done")
        self.mapper = os.path.join(self.work, "store", "M-to-L-k2")
        os.makedirs(self.mapper)

    def complete(self):
        with open(os.path.join(self.mapper, "manifest.yaml"), "w") as f:
            f.write("kind: ridge\n")

    def test_a_fresh_run_keeps_nothing_and_forgets_earlier_records(self):
        first = fits_done.FitsDone(self.records, reuse=False)
        first.put("M-to-L-k2", {"seconds": 2.0, "phase": "ridge"})
        self.complete()
        self.assertIsNone(first.get("M-to-L-k2", [self.mapper]))  # not resuming
        fresh = fits_done.FitsDone(self.records, reuse=False)
        self.assertEqual(os.listdir(self.records), [])
        self.assertIsNone(fresh.get("M-to-L-k2", [self.mapper]))

    def test_a_resumed_run_keeps_a_recorded_fit_whose_outputs_are_there(self):
        fits_done.FitsDone(self.records, reuse=False).put(
            "M-to-L-k2-both", {"seconds": 5.5, "phase": "kinds", "report": {"recommended": "mlp"}})
        resumed = fits_done.FitsDone(self.records, reuse=True)
        # Recorded but its mapper is gone (or was never written): fitted again.
        self.assertIsNone(resumed.get("M-to-L-k2-both", [self.mapper]))
        self.assertEqual(resumed.reused, 0)
        self.complete()
        record = resumed.get("M-to-L-k2-both", [self.mapper])
        self.assertEqual(record["report"], {"recommended": "mlp"})
        self.assertEqual(resumed.reused, 1)
        # A fit cut off before its record was written is fitted again, outputs or not.
        self.assertIsNone(resumed.get("M-to-S-k2", [self.mapper]))

    def test_seconds_are_summed_per_phase(self):
        done = fits_done.FitsDone(self.records, reuse=False)
        done.put("a", {"seconds": 3.0, "phase": "kinds"})
        done.put("b", {"seconds": 1.5, "phase": "ridge"})
        done.put("c", {"seconds": 4.0, "phase": "kinds"})
        self.assertEqual(done.seconds_total("kinds"), 7.0)
        self.assertEqual(done.seconds_total("ridge"), 1.5)
        self.assertFalse(any(n.endswith(".tmp") for n in os.listdir(self.records)))


if __name__ == "__main__":
    unittest.main()
