#!/usr/bin/env bash
# The main job on the embedded default: installs what is missing, builds, starts kvtd on the
# bundled demo mapper store (CPU backend, a free port), performs a real handoff through gRPC
# (`kvt demo`: prints tokens, per-stage latency and the max error against a float64 reference),
# then stops kvtd with SIGTERM (graceful drain); then a handoff between two trained members of
# the bundled model family (below). Extra arguments go to `kvt demo`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash scripts/bootstrap.sh
bazel build --noshow_progress //server:kvtd //cli:kvt
bin="$(bazel info bazel-bin 2>/dev/null)"

log="$(mktemp -t kvtd.XXXXXX.log)"
"$bin/server/kvtd" --mapper_store="$root/demo/mappers" --listen_address=127.0.0.1:0 \
  --backend=cpu --drain_grace_seconds=0 2>"$log" &
kvtd_pid=$!
trap 'kill -TERM $kvtd_pid 2>/dev/null || true' EXIT

port=""
for _ in $(seq 1 100); do
  port="$(grep -o '"msg":"listening".*' "$log" | grep -o '"port":[0-9]*' | head -n1 | cut -d: -f2 || true)"
  [ -n "$port" ] && break
  if ! kill -0 $kvtd_pid 2>/dev/null; then
    echo "kvtd exited:" >&2; cat "$log" >&2; exit 1
  fi
  sleep 0.1
done
[ -n "$port" ] || { echo "kvtd did not start:" >&2; cat "$log" >&2; exit 1; }
echo "kvtd listening on 127.0.0.1:$port (log: $log)"

"$bin/cli/kvt" health --server="127.0.0.1:$port"
"$bin/cli/kvt" mappers --server="127.0.0.1:$port"
"$bin/cli/kvt" demo --server="127.0.0.1:$port" --mapper_store="$root/demo/mappers" "$@"

kill -TERM $kvtd_pid
wait $kvtd_pid
trap - EXIT
echo "kvtd drained and exited cleanly"

# Then a handoff between two trained members of the bundled family (eval/tinyfamily): dumps
# their caches through transformers, fits ridge and MLP with `kvt fit --kind both` (about 2
# minutes on 2 cores), serves the recommended one from a fresh kvtd behind its quality gate and
# prints the recommendation, the gate's verdict, latency, the speedup over the target's own
# prefill and the context benefit recovered. KVT_QUICKSTART_FAMILY=0 skips it (it needs the
# Python venv: torch, transformers).
if [ "${KVT_QUICKSTART_FAMILY:-1}" != 0 ]; then
  echo
  bash scripts/bootstrap.sh --python
  bazel build --noshow_progress //eval:handoff_demo
  PATH="$root/.venv/bin:$PATH" "$bin/eval/handoff_demo"
fi
