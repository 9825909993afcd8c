#!/usr/bin/env python3
"""Sums test cases over Bazel's JUnit XML files and prints 'N passed, N failed'.

Usage: junit_summary.py TESTLOGS_DIR //pkg:target ... [TESTLOGS_DIR2 //pkg:target ...]
Several runs (e.g. an ASan configuration, whose logs live in another output tree) are summed:
each directory argument applies to the targets after it.
A target without a test.xml (it failed to build, or never ran) counts as one failed case.
Exits 1 when anything failed or no test case ran at all.
"""
import os
import sys
import xml.etree.ElementTree as ET


def count(xml_path):
    passed = failed = skipped = 0
    failed_names = []
    root = ET.parse(xml_path).getroot()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            failed_names.append(name)
        elif case.find("skipped") is not None or case.get("status") == "notrun":
            skipped += 1
        else:
            passed += 1
    # Bazel writes a single-testcase XML for non-gtest tests; a crashed gtest binary can leave
    # an XML with no testcase but failures at suite level.
    if passed + failed + skipped == 0:
        for suite in root.iter("testsuite"):
            if int(suite.get("failures", 0)) + int(suite.get("errors", 0)) > 0:
                failed += 1
                failed_names.append(suite.get("name", xml_path))
    return passed, failed, skipped, failed_names


def main():
    testlogs = sys.argv[1]
    targets = sys.argv[2:]
    passed = failed = skipped = 0
    for target in targets:
        if not target.startswith("//"):  # the next run's testlogs directory
            testlogs = target
            continue
        rel = target.lstrip("/").replace(":", "/")
        xml_path = os.path.join(testlogs, rel, "test.xml")
        if not os.path.exists(xml_path):
            failed += 1
            print(f"missing result: {target} ({testlogs})", file=sys.stderr)
            continue
        p, f, s, names = count(xml_path)
        passed += p
        failed += f
        skipped += s
        for name in names:
            print(f"FAILED: {target} {name} ({testlogs})", file=sys.stderr)
    line = f"{passed} passed, {failed} failed"
    if skipped:
        line += f", {skipped} skipped"
    print(line)
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
