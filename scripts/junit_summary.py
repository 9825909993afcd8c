#!/usr/bin/env python3
"""Counts the test cases of one Bazel run from its JUnit XML files: prints 'N passed, N failed'.

Usage: junit_summary.py [--label=NAME] TESTLOGS_DIR //pkg:target ...
One run per call: the ASan run (whose logs live in its own output tree) and the plain run are
counted by two calls, never summed. --label=NAME prefixes the line ("NAME: N passed, ...").
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


def main(argv):
    label = ""
    if argv and argv[0].startswith("--label="):
        label = argv[0][len("--label="):]
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    testlogs = argv[0]
    targets = argv[1:]
    passed = failed = skipped = 0
    for target in targets:
        if not target.startswith("//"):
            print(f"not a test target: {target!r} (one TESTLOGS_DIR per call)", file=sys.stderr)
            return 2
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
    if label:
        line = f"{label}: {line}"
    # stderr first, so that the count is the last thing either stream shows.
    sys.stderr.flush()
    print(line, flush=True)
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
