"""A second text source for the evaluation (docs/EVAL.md, "A second text source"): Debian's
license texts in /usr/share/common-licenses (the base-files package, on every Debian system, so
the windows are reproducible without committing the text). Legal and technical English written
independently of the Python documentation the family was trained, calibrated and held out on.

Texts are taken in PREFERRED order and a text is kept only when few of its word 8-grams occur in
the Python documentation (the BSD license is quoted there: docs/license) or in a text already
kept (GPL-2 after GPL-3, LGPL-2 after LGPL-2.1, ...). Windows are cut as the family's held-out
windows are (testing/kvt_testing/tinyfamily.heldout_windows): the texts' bytes end to end, each
followed by EOS, windows of one length spread evenly over the stream (kvt.text.spread_windows,
which kvt.qualify cuts an operator's text with).
"""

import os
import re

from kvt.text import spread_windows  # noqa: F401  (license_text.spread_windows: kvt.qualify's)

DIRECTORY = "/usr/share/common-licenses"
# Newest version of each license first, so the older near-duplicates are the ones dropped.
PREFERRED = ("GPL-3", "LGPL-2.1", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic", "CC0-1.0",
             "LGPL-3", "GPL-2", "GPL-1", "LGPL-2", "MPL-1.1", "GFDL-1.2", "BSD")
# A text is dropped when more than this share of its word 8-grams occurs elsewhere.
MAX_OVERLAP = 0.1
GRAM = 8


def word_grams(text, n=GRAM):
    """The set of the text's word n-grams (lower-case alphanumeric words)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def overlap(text, grams, n=GRAM):
    """Share of the text's word n-grams that are in `grams` (0 for a text shorter than n words)."""
    mine = word_grams(text, n)
    return len(mine & grams) / len(mine) if mine else 0.0


def select(texts, reference_grams, max_overlap=MAX_OVERLAP):
    """texts [(name, text)] in order of preference; keeps each whose overlap with the reference
    (the training text's n-grams) and with every text kept before it is at most max_overlap.
    Returns (kept [(name, text)], report {name: {"reference": share, "kept_texts": share,
    "kept": bool}})."""
    kept, report, kept_grams = [], {}, set()
    for name, text in texts:
        ref, prior = overlap(text, reference_grams), overlap(text, kept_grams)
        keep = ref <= max_overlap and prior <= max_overlap
        report[name] = {"reference": round(ref, 4), "kept_texts": round(prior, 4), "kept": keep}
        if keep:
            kept.append((name, text))
            kept_grams |= word_grams(text)
    return kept, report


def read_texts(directory=DIRECTORY, names=PREFERRED):
    """[(name, text)] of the named files present (symlinks such as GPL -> GPL-3 are aliases and
    not listed in PREFERRED)."""
    out = []
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                out.append((name, f.read()))
    if not out:
        raise SystemExit(f"no license texts under {directory} (Debian's base-files package)")
    return out


def stream(texts, encode, eos):
    """The texts' tokens end to end, each text followed by eos."""
    return [t for _, text in texts for t in encode(text) + [eos]]
