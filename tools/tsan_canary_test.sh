#!/usr/bin/env bash
# Under --config=tsan with the project's TSAN_OPTIONS (scripts/tsan_test.sh): the deliberate race
# in tools/tsan_canary.cc must be reported and fail the process, i.e. tools/tsan.supp does not
# hide races in our code. Tagged manual: meaningful only in a TSan build.
set -uo pipefail
canary="${TEST_SRCDIR:-$PWD/..}/kvt/tools/tsan_canary"
out="$("$canary" 2>&1)"
rc=$?
if ! grep -q "^tsan build" <<<"$out"; then
  echo "FAIL: not a TSan build; run with bazel test --config=tsan (scripts/tsan_test.sh)"; exit 1
fi
case "${TSAN_OPTIONS:-}" in
  *suppressions=*tsan.supp*) ;;
  *) echo "FAIL: TSAN_OPTIONS does not load tools/tsan.supp: '${TSAN_OPTIONS:-}'"; exit 1 ;;
esac
if [ $rc -eq 0 ] || ! grep -q "WARNING: ThreadSanitizer: data race" <<<"$out" \
   || ! grep -q "tsan_canary.cc" <<<"$out"; then
  echo "FAIL: the deliberate race in tools/tsan_canary.cc was not reported (rc=$rc):"
  echo "$out" | head -40
  exit 1
fi
echo "PASS: TSan reported the canary race (rc=$rc) with the project's suppressions loaded"
