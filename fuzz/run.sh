#!/usr/bin/env bash
# Builds the fuzz targets (fuzz/build.sh) and runs each for SECONDS (default 60) from its seed
# corpus and committed regressions. Exits non-zero if any target crashes, leaks, times out or
# fails to build; the crashing input is kept under fuzz/out/artifacts/ and its path printed.
# Usage: fuzz/run.sh [SECONDS] [TARGET...]     (CI: .ci/run calls fuzz/run.sh 60)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
seconds="${1:-60}"
shift || true
# glibc-internal allocations LeakSanitizer cannot see freed (fuzz/lsan.supp says which and why).
export LSAN_OPTIONS="suppressions=$root/fuzz/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"

if ! bash fuzz/build.sh; then
  echo "fuzz: build failed" >&2
  exit 1
fi
out="$root/fuzz/out"
if [ $# -gt 0 ]; then
  targets=("$@")
else
  read -r -a targets <<< "$(make -s -f fuzz/Makefile list)"
fi

failed=0
for target in "${targets[@]}"; do
  work="$out/run/$target"
  rm -rf "$work" && mkdir -p "$work" "$out/artifacts" "$out/logs"
  opts=(-max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1
        -artifact_prefix="$out/artifacts/$target-")
  dirs=("$work" "fuzz/corpus/$target")
  [ -d "fuzz/regressions/$target" ] && dirs+=("fuzz/regressions/$target")
  log="$out/logs/$target.log"
  "$out/$target" "${opts[@]}" "${dirs[@]}" > "$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  if [ $rc -ne 0 ]; then
    failed=1
    echo "fuzz: $target FAILED (exit $rc after ${execs:-?} executions); log $log" >&2
    grep -E "ERROR|FUZZ_CHECK|runtime error|SUMMARY|Test unit written" "$log" | head -20 >&2
  else
    echo "fuzz: $target ok, ${execs:-?} executions in ${seconds}s"
  fi
done
exit $failed
