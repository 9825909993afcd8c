#!/bin/sh
# One pod of the sharded `kvt fit` Indexed Job (job.yaml; the two phases are in docs/FIT.md,
# "Scale-out: shards"). Every pod runs its probe shard, index 0 merges the probes into the plan,
# every pod runs its final shard with the plan, and index 0 merges the finals into the mapper.
# Pods meet through files in a shared directory: each file appears by rename when complete, so a
# peer never reads a partial one, and a restarted pod skips the work it already finished.
#
# Environment (set by job.yaml; //deploy:fit_job_test runs this script with real `kvt`):
#   JOB_COMPLETION_INDEX  this shard, 0 .. KVT_FIT_SHARDS-1 (set by Kubernetes)
#   KVT_FIT_SHARDS        number of shards (= the Job's completions = parallelism)
#   KVT_FIT_FLAGS         kvt fit flags shared by every shard (configs, dumps, --top_k, ...)
#   KVT_FIT_MERGE_FLAGS   flags of the final merge (--lambda, --weight_dtype)
#   KVT_FIT_WORK          shared directory for shard files (one subdirectory per run)
#   KVT_FIT_RUN           run id (the Job's uid): a re-created Job starts from scratch
#   KVT_FIT_OUT           the mapper directory to write (inside the mapper store)
#   KVT_FIT_WAIT_SECONDS  how long to wait for the other shards (default 86400)
#   KVT_BIN               the kvt binary (default: kvt on PATH)
set -eu

i="${JOB_COMPLETION_INDEX:?JOB_COMPLETION_INDEX is not set (run as an Indexed Job)}"
n="${KVT_FIT_SHARDS:?KVT_FIT_SHARDS is not set}"
out="${KVT_FIT_OUT:?KVT_FIT_OUT is not set}"
work="${KVT_FIT_WORK:?KVT_FIT_WORK is not set}/${KVT_FIT_RUN:-run}"
kvt="${KVT_BIN:-kvt}"
wait_limit="${KVT_FIT_WAIT_SECONDS:-86400}"
flags="${KVT_FIT_FLAGS:-}"
merge_flags="${KVT_FIT_MERGE_FLAGS:-}"

log() { echo "kvt-fit shard $i/$n: $*" >&2; }

case "$i" in *[!0-9]*|'') log "JOB_COMPLETION_INDEX must be a number"; exit 2 ;; esac
if [ "$i" -ge "$n" ]; then log "index out of range: the Job's completions must equal KVT_FIT_SHARDS"; exit 2; fi
mkdir -p "$work"

# Blocks until every file named by "$@" exists, or fails after KVT_FIT_WAIT_SECONDS (a shard that
# never ran, e.g. parallelism < completions, must not leave the others waiting forever).
wait_for() {
  waited=0
  for f in "$@"; do
    while [ ! -e "$f" ]; do
      if [ "$waited" -ge "$wait_limit" ]; then
        log "gave up after ${wait_limit}s waiting for $f"
        exit 1
      fi
      sleep 2
      waited=$((waited + 2))
    done
  done
}

shard_files() {  # all shards' files of one phase
  k=0
  while [ "$k" -lt "$n" ]; do
    printf '%s\n' "$work/$1-$k.kvtstats"
    k=$((k + 1))
  done
}

# Phase 1: probe statistics of this shard.
probe="$work/probe-$i.kvtstats"
if [ ! -e "$probe" ]; then
  # shellcheck disable=SC2086  # the flags are a word list on purpose
  "$kvt" fit $flags --partial --shard="$i/$n" --out="$probe.partial"
  mv "$probe.partial" "$probe"
fi

# The plan: index 0 merges the probes (layer choice over all shards); the others wait for it.
plan="$work/plan.kvtstats"
if [ "$i" -eq 0 ] && [ ! -e "$plan" ]; then
  # shellcheck disable=SC2046
  wait_for $(shard_files probe)
  # shellcheck disable=SC2046
  "$kvt" fit merge --out="$plan.partial" $(shard_files probe)
  mv "$plan.partial" "$plan"
fi
wait_for "$plan"

# Phase 2: final statistics of this shard with the plan's layers.
final="$work/final-$i.kvtstats"
if [ ! -e "$final" ]; then
  # shellcheck disable=SC2086
  "$kvt" fit $flags --partial --shard="$i/$n" --plan="$plan" --out="$final.partial"
  mv "$final.partial" "$final"
fi

# The mapper: index 0 solves from every final shard. It is written under a dot-name (the store
# skips those) and renamed into place, so kvtd never lists a half-written mapper.
if [ "$i" -eq 0 ]; then
  if [ -e "$out/manifest.yaml" ]; then
    log "$out already exists; not overwritten (delete it to refit)"
    exit 0
  fi
  # shellcheck disable=SC2046
  wait_for $(shard_files final)
  staging="$(dirname "$out")/.$(basename "$out").partial"
  rm -rf "$staging"
  # shellcheck disable=SC2046,SC2086
  "$kvt" fit merge $merge_flags --out="$staging" $(shard_files final)
  mv "$staging" "$out"
  log "wrote $out"
fi
