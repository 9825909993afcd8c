#!/usr/bin/env bash
# The thread-safety analysis really sees kvt::Mutex: clang accepts testdata/mutex_analysis.cc
# and rejects each seeded lock mistake in it. Without this, a lost ABSL_LOCKABLE in
# common/mutex.h would make `--config=tsa` pass while checking nothing.
set -uo pipefail
src="common/testdata/mutex_analysis.cc"
compile() {
  clang++ -std=c++17 -fsyntax-only -I. -Wthread-safety -Werror=thread-safety "$@" "$src" 2>&1
}
if ! command -v clang++ >/dev/null 2>&1; then
  echo "FAIL: clang++ not found (scripts/bootstrap.sh installs it)"
  exit 1
fi
fail=0
if ! out=$(compile); then
  echo "FAIL: the correct version does not compile:"; echo "$out"; fail=1
fi
for case in UNLOCKED_WRITE READ_AFTER_UNLOCK LOCKED_CALL_UNLOCKED; do
  if out=$(compile "-DKVT_BREAK_$case"); then
    echo "FAIL: $case compiled; the analysis missed it"; fail=1
  elif ! grep -q "Wthread-safety" <<<"$out"; then
    echo "FAIL: $case failed, but not with a thread-safety error:"; echo "$out"; fail=1
  else
    echo "ok: $case rejected: $(grep -m1 'error:' <<<"$out")"
  fi
done
exit "$fail"
