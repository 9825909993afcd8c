#!/usr/bin/env bash
# Builds everything and runs every test; prints "N passed, N failed" (gtest cases summed from
# Bazel's JUnit XML) and exits non-zero on any failure. Extra arguments go to `bazel test`.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash scripts/bootstrap.sh

bazel test //... "$@"
bazel_rc=$?

# Count only the test targets that exist now (bazel-testlogs may hold results of deleted ones).
targets=$(bazel query 'tests(//...)' 2>/dev/null)
python3 scripts/junit_summary.py "$(bazel info bazel-testlogs 2>/dev/null)" $targets
summary_rc=$?

if [ $bazel_rc -ne 0 ] || [ $summary_rc -ne 0 ]; then
  exit 1
fi
