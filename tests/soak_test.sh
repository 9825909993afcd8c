#!/usr/bin/env bash
# Soak: kvtd (a real process, CPU backend) under closed-loop load from kvt-load for
# KVT_SOAK_SECONDS (default 120) with a mix of sequence lengths. Passes when no request failed,
# the server's RSS floor grew < 5% from the first to the last third of the run after warm-up (see
# kvt-load --max_rss_growth_pct), and its open fds did not grow.
# Longer soak: KVT_SOAK_SECONDS=3600 bazel test //tests:soak_test --test_timeout=4000
set -euo pipefail
runfiles="${TEST_SRCDIR:-$PWD/..}/kvt"
kvtd="$runfiles/server/kvtd"
kvt="$runfiles/cli/kvt"
load="$runfiles/loadtest/kvt-load"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
seconds="${KVT_SOAK_SECONDS:-120}"
warmup=$(( seconds / 4 ))

rm -rf "$tmp/store" && mkdir -p "$tmp/store"
"$kvt" synth --preset=demo-tiny --out="$tmp/store/demo-tiny" --seed=3 >/dev/null

"$kvtd" --mapper_store="$tmp/store" --listen_address=127.0.0.1:0 --backend=cpu \
  --drain_grace_seconds=0 2>"$tmp/kvtd.log" &
pid=$!
trap 'kill -KILL $pid 2>/dev/null || true' EXIT
port=""
for _ in $(seq 1 200); do
  port="$(grep '"msg":"listening"' "$tmp/kvtd.log" | grep -o '"port":[0-9]*' | head -n1 | cut -d: -f2 || true)"
  [ -n "$port" ] && break
  sleep 0.05
done
if [ -z "$port" ]; then
  echo "kvtd did not report its port:"; cat "$tmp/kvtd.log"; exit 1
fi

"$load" --server="127.0.0.1:$port" --mode=closed --concurrency=3 --duration_s="$seconds" \
  --warmup_s="$warmup" --mix=demo-tiny:64:2,demo-tiny:512:2,demo-tiny:4096:1 \
  --server_pid=$pid --max_rss_growth_pct=5 --fail_on_error \
  --json_out="${TEST_UNDECLARED_OUTPUTS_DIR:-$tmp}/soak.json" \
  --svg_out="${TEST_UNDECLARED_OUTPUTS_DIR:-$tmp}/soak.svg"

kill -TERM $pid
wait $pid
trap - EXIT
echo "soak passed: kvtd exited cleanly"
