#!/usr/bin/env bash
# Wall time of `kvt fit` closed form vs `--refine=attention` (its defaults) per ordered pair, best
# of REPS alternating runs (docs/FIT.md, "Cost"). DUMPS: a directory of per-member calibration
# dumps made with queries, as `bazel-bin/eval/compare_fits --work=W` leaves in W/dumps/<member>.
#   bazel build //cli:kvt && bash scripts/refine_cost.sh /tmp/kvt-compare/dumps [S,M,L,U] [3]
set -euo pipefail
dumps=${1:?usage: refine_cost.sh DUMPS [MEMBERS] [REPS]}
IFS=, read -r -a members <<< "${2:-S,M,L,U}"
reps=${3:-3}
kvt=$(git rev-parse --show-toplevel)/bazel-bin/cli/kvt
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fit() {  # source target extra-flags...
  local a=$1 b=$2
  shift 2
  local t0 t1
  t0=$(date +%s.%N)
  "$kvt" fit --source_config="$dumps/$a" --target_config="$dumps/$b" \
    --source_model="kvt-tiny-$a" --target_model="kvt-tiny-$b" --source_dumps="$dumps/$a" \
    --target_dumps="$dumps/$b" --top_k=2 --stride=1 --corpus=python3.11-doc --threads=1 \
    --overwrite --out="$out/fit" "$@" > /dev/null 2>&1
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
printf "%-6s %10s %10s %7s\n" pair closed refined ratio
for a in "${members[@]}"; do
  for b in "${members[@]}"; do
    [ "$a" = "$b" ] && continue
    closed=() refined=()
    for _ in $(seq "$reps"); do
      closed+=("$(fit "$a" "$b")")
      refined+=("$(fit "$a" "$b" --refine=attention)")
    done
    c=$(printf "%s\n" "${closed[@]}" | sort -n | head -1)
    r=$(printf "%s\n" "${refined[@]}" | sort -n | head -1)
    printf "%-6s %10.2f %10.2f %7.2f\n" "$a->$b" "$c" "$r" "$(echo "$r / $c" | bc -l)"
  done
done
