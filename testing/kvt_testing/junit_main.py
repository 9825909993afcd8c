"""unittest.main that, under `bazel test`, also writes one JUnit testcase per test
method to $XML_OUTPUT_FILE (xmlrunner, from the venv's unittest-xml-reporting), so
scripts/junit_summary.py counts each case instead of one per target."""

from __future__ import annotations

import os
import unittest


def main() -> None:
    path = os.environ.get("XML_OUTPUT_FILE")
    if not path:
        unittest.main(module="__main__")
        return
    import xmlrunner  # unittest-xml-reporting (requirements.lock); required under bazel test

    with open(path, "wb") as output:
        unittest.main(module="__main__",
                      testRunner=xmlrunner.XMLTestRunner(output=output, verbosity=2))
