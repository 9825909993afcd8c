"""eval/license_text.py on synthetic texts: the selection drops a text quoted by the training
text and a near-duplicate of a text kept before it, and the windows are cut as the family's
held-out windows are (EOS after each text, windows spread evenly, first and last included)."""

import os
import tempfile
import unittest

import numpy as np

import license_text as L

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def prose(seed, n=200):
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


class SelectTest(unittest.TestCase):
    def test_drops_quoted_and_near_duplicate_texts(self):
        training = prose(0)
        texts = [("new", prose(1)), ("old", prose(1) + " " + prose(2, 10)),
                 ("quoted", training[:800]), ("other", prose(3))]
        kept, report = L.select(texts, L.word_grams(training))
        self.assertEqual([n for n, _ in kept], ["new", "other"])
        self.assertGreater(report["old"]["kept_texts"], 0.8)
        self.assertGreater(report["quoted"]["reference"], 0.9)
        self.assertLess(report["other"]["reference"], L.MAX_OVERLAP)
        self.assertTrue(report["new"]["kept"])
        self.assertFalse(report["old"]["kept"])

    def test_overlap_of_a_short_text_is_zero(self):
        self.assertEqual(L.overlap("too short", L.word_grams(prose(0))), 0.0)


class WindowTest(unittest.TestCase):
    def test_stream_puts_eos_after_each_text(self):
        s = L.stream([("a", "ab"), ("b", "c")], lambda t: list(t.encode()), 0)
        self.assertEqual(s, [97, 98, 0, 99, 0])

    def test_windows_spread_like_heldout_windows(self):
        tokens = list(range(1000))
        w = L.spread_windows(tokens, 100, 4)
        self.assertEqual([x[0] for x in w], [0, 300, 600, 900])
        self.assertTrue(all(len(x) == 100 for x in w))
        # More windows asked for than the stream holds: every whole window once.
        self.assertEqual(len(L.spread_windows(tokens, 300, 64)), 3)
        with self.assertRaises(ValueError):
            L.spread_windows(tokens[:50], 100, 1)

    def test_reads_named_files_only(self):
        with tempfile.TemporaryDirectory() as d:
            for name in ("GPL-3", "BSD", "unlisted"):
                with open(os.path.join(d, name), "w") as f:
                    f.write(name)
            os.symlink("GPL-3", os.path.join(d, "GPL"))
            self.assertEqual([n for n, _ in L.read_texts(d)], ["GPL-3", "BSD"])
            with self.assertRaises(SystemExit):
                L.read_texts(d, names=("missing",))


if __name__ == "__main__":
    unittest.main()
