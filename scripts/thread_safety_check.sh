#!/usr/bin/env bash
# Clang's thread-safety analysis over the whole tree: `bazel build --config=tsa //...` (clang 14,
# -Wthread-safety -Werror=thread-safety, own output tree). Every ABSL_GUARDED_BY /
# ABSL_EXCLUSIVE_LOCKS_REQUIRED / ABSL_LOCKS_EXCLUDED on a kvt::Mutex (common/mutex.h) or
# absl::Mutex is checked; one finding fails the build, and this script exits non-zero.
# Lock discipline: docs/RELIABILITY.md "Thread-safety analysis". Extra arguments go to bazel.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang++ >/dev/null 2>&1; then
  echo "thread-safety: FAILED (clang++ not found; scripts/bootstrap.sh installs it)" >&2
  exit 1
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
bazel build --config=tsa //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
findings=$(grep -c -- '-Werror,-Wthread-safety' "$log")
if [ "$rc" -eq 0 ]; then
  echo "thread-safety: clean (bazel build --config=tsa //...)"
else
  echo "thread-safety: FAILED (bazel exited $rc; $findings thread-safety error(s) above)"
fi
exit "$rc"
