"""Files of this workspace in Bazel's runfiles (`bazel test`, `bazel run`, bazel-bin/...)."""

from __future__ import annotations

import os
import tempfile

# This file sits in <runfiles>/kvt/testing/kvt_testing/ under Bazel: ROOT is the workspace's
# directory in the runfiles (in a source checkout, the checkout).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def runfile(path: str) -> str:
    """Absolute path of a file of this workspace in the runfiles."""
    roots = [os.path.join(os.environ[v], "kvt") for v in ("TEST_SRCDIR", "RUNFILES_DIR")
             if os.environ.get(v)]
    for root in roots + [ROOT]:
        candidate = os.path.join(root, path)
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(f"{path} not found in the runfiles (run under bazel test or run)")


def test_tmpdir() -> str:
    return os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
