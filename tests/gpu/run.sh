#!/usr/bin/env bash
# The CUDA backend's GPU checks, built for a single run on a GPU machine that has no Bazel and
# none of Debian's libraries: unit tests, kvtd's start-up self-check, CUDA IPC, parity (CUDA vs
# CPU sgemm vs float64, one process per test) and the benchmark of the paper's shapes.
#
#   bash tests/gpu/run.sh --bundle      # build machine (Bazel, CUDA toolkit, no GPU needed):
#                                       # build the GPU binaries and pack them with their
#                                       # libraries into bazel-gpu-bundle/ (one xz archive)
#   bash tests/gpu/run.sh               # on a machine with a GPU, in the repository root with
#                                       # bazel-gpu-bundle/ in it: the full run, <= 8 minutes
#   bash tests/gpu/run.sh --quick       # a second try after a failed or cut-short first one:
#                                       # the same checks, a shorter benchmark, <= 5 minutes
#   bash tests/gpu/run.sh --rehearse    # build machine: the bundle run exactly as the GPU
#                                       # machine runs it (clean environment, only the bundle's
#                                       # libraries), each step expected to stop at "no device"
#   bash tests/gpu/run.sh --pack BIN... # pack these already built binaries (the CI rehearsal)
#   bash tests/gpu/run.sh --find-cublas # where this machine's cuBLAS 13 is
#
# Results: exactly two files in $OUT (default /tmp/kvt-gpu-out): summary.txt (verdict, each
# step's exit status and time, the first lines of each failure with its values and seed, the
# benchmark table) and gpu-results.tar.gz (every log, gtest XML, the seeds, benchmark TSVs,
# nvidia-smi -q). Temporaries (test stores, kvtd's files) live in a scratch folder outside $OUT.
# Exit 0 only if every step passed on a GPU (or, rehearsing, reached its first CUDA call).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUNDLE=$(realpath -m "${KVT_GPU_BUNDLE:-bazel-gpu-bundle}")
OUT=${OUT:-/tmp/kvt-gpu-out}
# Whole-run deadline (seconds): the 10-minute window less start-up slack and packing.
DEADLINE=${KVT_GPU_DEADLINE_S:-480}
GPU_TARGETS=(
  //kernels/cuda:device_test
  //kernels/cuda:cuda_backend_startup_test
  //kernels/cuda:ipc_test
  //server:backend_select_test
  //server:backend_self_check_test
  //kernels/cuda:cuda_backend_test
  //kernels/cuda:cuda_backend_benchmark
  //tests:cuda_ipc_gpu_test
  //server:kvtd
)
# Libraries the GPU machine provides: glibc, the C++ runtime, and the NVIDIA driver's.
SYSTEM_LIBS='^(ld-linux.*|libc|libm|libdl|libpthread|librt|libutil|libresolv|libstdc\+\+|libgcc_s|libcuda|libnvidia-.*)\.so'
# How a binary says it stopped at its first CUDA call for want of a device (or driver).
NO_DEVICE='no usable CUDA device|no CUDA device|needs a CUDA device|needs a GPU|cudaErrorInsufficientDriver|cudaErrorNoDevice|CUDA driver version is insufficient'
LOADER_ERROR='error while loading shared libraries|cannot open shared object|symbol lookup error|version .GLIBC'

die() { echo "run.sh: $*" >&2; exit 1; }

# ---- Build machine: pack binaries with every library they load except SYSTEM_LIBS and cuBLAS
# (400+ MiB; every CUDA 13 machine has it, found at run time by find_cublas).
pack() {  # binary paths
  command -v xz >/dev/null || die "xz is needed to pack the bundle"
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE/bin" "$BUNDLE/lib" "$BUNDLE/runfiles/kvt/server" || return 1
  local listed
  # ldd the originals: their $ORIGIN-relative RUNPATH finds the kvt libraries.
  listed=$(ldd "$@") || return 1
  if grep -q "not found" <<<"$listed"; then
    echo "pack: unresolved libraries:" >&2
    grep "not found" <<<"$listed" | sort -u >&2
    return 1
  fi
  local binary
  for binary in "$@"; do
    case "$(basename "$binary")" in
      kvtd) cp -L "$binary" "$BUNDLE/runfiles/kvt/server/" ;;  # cuda_ipc_gpu_test's second process
      *) cp -L "$binary" "$BUNDLE/bin/" ;;
    esac || return 1
  done
  awk '/=> \// {print $3}' <<<"$listed" | sort -u | while read -r lib; do
    grep -qE "$SYSTEM_LIBS|^libcublas" <<<"$(basename "$lib")" || cp -L "$lib" "$BUNDLE/lib/"
  done
  chmod -R u+w "$BUNDLE"
  strip --strip-unneeded "$BUNDLE"/bin/* "$BUNDLE"/lib/* "$BUNDLE"/runfiles/kvt/server/* \
    2>/dev/null
  grep -q cublasGemmStridedBatchedEx "$BUNDLE"/bin/* "$BUNDLE"/lib/* ||
    die "pack: the CUDA backend was built without CUDA (no toolkit, or --config=nocuda)"
  {
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- \
      kernels server tests 2>/dev/null || echo ' (+ local changes)')"
    echo "built $(date -u +%FT%TZ) on $(. /etc/os-release; echo "$PRETTY_NAME"), $(
      /usr/local/cuda/bin/nvcc --version 2>/dev/null | tail -1)"
  } > "$BUNDLE/BUILD_INFO"
  (cd "$BUNDLE" && tar -cf - bin lib runfiles | xz -"${KVT_GPU_XZ_LEVEL:-6}" -T0 > bundle.tar.xz &&
     rm -rf bin lib runfiles) || return 1
  local size
  size=$(du -sm "$BUNDLE" | cut -f1)
  echo "bundle: $BUNDLE, ${size} MiB"
  [ "$size" -le 40 ] || die "bundle: ${size} MiB; over 40 MiB, tree and bundle may not fit their 64 MiB"
}

bundle() {
  bazel build -c opt "${GPU_TARGETS[@]}" || return 1
  # Not `bazel info`, which waits for the server lock behind every other Bazel command.
  local bin=bazel-out/k8-opt/bin paths=() target
  for target in "${GPU_TARGETS[@]}"; do
    target=${target#//}
    paths+=("$bin/${target/://}")
  done
  pack "${paths[@]}"
}

# ---- The GPU machine (or its rehearsal).

# cuBLAS 13 wherever a CUDA 13 install or a pip wheel put it; prints the folder.
# KVT_GPU_TOOLKIT_DIRS replaces the toolkit folders searched first (tests check the wheels).
find_cublas() {
  local dirs
  read -r -a dirs <<<"${KVT_GPU_TOOLKIT_DIRS:-${CUDA_HOME:-/usr/local/cuda}/lib64 \
    /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(echo /usr/local/cuda-13*/lib64 \
    /usr/local/cuda-13*/targets/x86_64-linux/lib) /usr/lib/x86_64-linux-gnu /usr/lib64}"
  local python site
  for python in python3 /usr/bin/python3; do
    command -v "$python" >/dev/null || continue
    for site in $("$python" -c 'import site, sys; print(" ".join(sys.path + site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null); do
      # CUDA 13 wheels: nvidia/cu13/lib; CUDA 12-style wheels: nvidia/cublas/lib.
      dirs+=("$site/nvidia/cu13/lib" "$site/nvidia/cublas/lib")
    done
  done
  local ldconfig_dir
  ldconfig_dir=$(/sbin/ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 / {print $NF; exit}')
  [ -n "$ldconfig_dir" ] && dirs+=("$(dirname "$ldconfig_dir")")
  local dir
  for dir in "${dirs[@]}"; do
    if [ -e "$dir/libcublas.so.13" ] && [ -e "$dir/libcublasLt.so.13" ]; then
      echo "$dir"
      return 0
    fi
  done
  return 1
}

# Into the scratch folder: the bundle stays as it came, the size it travels at.
unpack() {
  mkdir -p "$UNPACKED"
  [ -f "$BUNDLE/bundle.tar.xz" ] ||
    die "no $BUNDLE/bundle.tar.xz here: run 'bash tests/gpu/run.sh --bundle' on the build" \
        "machine and bring $BUNDLE/ along with the working tree"
  if command -v xz >/dev/null; then
    tar -xJf "$BUNDLE/bundle.tar.xz" -C "$UNPACKED" || die "$BUNDLE/bundle.tar.xz: unpacking failed"
  elif command -v python3 >/dev/null; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$BUNDLE/bundle.tar.xz" "$UNPACKED" || die "no xz; python3's tarfile could not unpack either"
  else
    die "neither xz nor python3 here: cannot unpack $BUNDLE/bundle.tar.xz"
  fi
}

# The driver's version (major number >= 580 for a CUDA 13 build); prints a verdict line.
check_driver() {
  local version=""
  if command -v nvidia-smi >/dev/null; then
    version=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  fi
  if [ -z "$version" ] && [ -r /proc/driver/nvidia/version ]; then
    version=$(grep -oE 'Kernel Module +[0-9.]+' /proc/driver/nvidia/version | awk '{print $3}')
  fi
  if [ -z "$version" ]; then
    echo "driver: none (no nvidia-smi answer, no /proc/driver/nvidia/version)"
    return 1
  fi
  if [ "${version%%.*}" -lt 580 ] 2>/dev/null; then
    echo "driver: $version is too old: this CUDA 13 build needs 580 or newer"
    return 1
  fi
  echo "driver: $version (>= 580)"
}

# Every binary's libraries resolve into the bundle, the cuBLAS folder or SYSTEM_LIBS.
check_libraries() {
  local listed bad
  listed=$(ldd "$UNPACKED"/bin/* "$UNPACKED"/runfiles/kvt/server/kvtd 2>&1)
  bad=$(grep "not found" <<<"$listed" | sort -u)
  if [ -n "$bad" ]; then
    echo "libraries: missing on this machine:"; echo "$bad"
    return 1
  fi
  bad=$(awk '/=> \// {print $1, $3}' <<<"$listed" | sort -u | while read -r name path; do
    case "$path" in
      "$UNPACKED"/lib/*|"$CUBLAS_DIR"/*) ;;
      *) grep -qE "$SYSTEM_LIBS" <<<"$name" || echo "$name => $path" ;;
    esac
  done)
  if [ -n "$bad" ]; then
    echo "libraries: loaded from outside the bundle (the GPU machine lacks them):"; echo "$bad"
    return 1
  fi
  echo "libraries: all resolved (bundle, $CUBLAS_DIR, system C/C++ runtime and driver)"
}

declare -A VERDICT
STEPS=()
START=$SECONDS

# Runs one binary in its own process with a limit that keeps the run inside DEADLINE.
run_step() {  # name limit_s command...
  local name=$1 limit=$2
  shift 2
  STEPS+=("$name")
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 10 ]; then
    VERDICT[$name]="FAIL not run: the run's ${DEADLINE} s were spent"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local log="$RESULTS/logs/$name.log" begin=$SECONDS
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  local rc=$? seconds=$((SECONDS - begin)) verdict
  if [ -n "$REHEARSAL" ]; then
    if grep -qE "$LOADER_ERROR" "$log"; then verdict="FAIL does not load"
    elif grep -qE "$NO_DEVICE" "$log"; then verdict="ok reached its first CUDA call"
    elif [ $rc -eq 0 ] && [[ $name == unit/* ]]; then verdict="ok loads and runs (accepts no device)"
    else verdict="FAIL rc=$rc without reaching CUDA (or without saying so)"; fi
  elif [ $rc -eq 0 ] && grep -qE "$NO_DEVICE" "$log"; then
    verdict="FAIL passed only by accepting 'no device'"
  elif [ $rc -eq 0 ]; then verdict="PASS"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="FAIL timed out after ${limit} s"
  elif [ $rc -gt 128 ]; then verdict="FAIL crashed (signal $((rc - 128)))"
  else verdict="FAIL rc=$rc"; fi
  VERDICT[$name]="$verdict (${seconds} s)"
  printf '%-60s %s\n' "$name" "${VERDICT[$name]}" | tee -a "$OUT/summary.txt"
}

# Each parity test in its own process: a memory fault cannot take the later ones with it.
run_parity() {  # per-test limit_s, total limit_s
  local per_test=$1 until=$((SECONDS + $2)) test
  local list
  list=$("$UNPACKED/bin/cuda_backend_test" --gtest_list_tests 2>&1 | awk '
    /^[^ ]/ {suite = $1; next}
    /^  / {name = $1; if (name !~ /^DISABLED_/ && suite !~ /^DISABLED_/) print suite name}')
  for test in $list; do
    if [ $SECONDS -ge $until ]; then
      STEPS+=("parity/${test//\//.}")
      VERDICT["parity/${test//\//.}"]="FAIL not run: parity's time was spent"
      continue
    fi
    run_step "parity/${test//\//.}" "$per_test" "$UNPACKED/bin/cuda_backend_test" \
      --gtest_filter="$test" --gtest_output="xml:$RESULTS/xml/${test//\//.}.xml"
  done
}

run_all() {
  local env=(env KVT_REQUIRE_GPU=1 TEST_TMPDIR="$SCRATCH/tmp"
             RUNFILES_DIR="$UNPACKED/runfiles")
  local t
  for t in device_test cuda_backend_startup_test ipc_test backend_select_test \
           backend_self_check_test; do
    run_step "unit/$t" 30 "${env[@]}" "$UNPACKED/bin/$t" --gtest_output="xml:$RESULTS/xml/$t.xml"
  done
  # These accept "no device" (CI has none): on a GPU they count only if device_test, which
  # fails there without a usable device, passed.
  if [ -z "$REHEARSAL" ] && [[ ${VERDICT[unit/device_test]} != PASS* ]]; then
    for t in cuda_backend_startup_test ipc_test backend_select_test backend_self_check_test; do
      [[ ${VERDICT[unit/$t]} == PASS* ]] &&
        VERDICT[unit/$t]="FAIL inconclusive: passed without a usable device (see unit/device_test)"
    done
  fi
  # What kvtd does before it serves on the GPU: exit 0 only if every check passed.
  run_step self_check 45 "${env[@]}" "$UNPACKED/runfiles/kvt/server/kvtd" --self_check \
    --backend=cuda
  run_parity 90 "$PARITY_S"
  # This process exports cudaMalloc'd buffers (from inside a larger allocation), kvtd (a second
  # process) opens the handles and translates through them.
  run_step cuda_ipc 90 "${env[@]}" "$UNPACKED/bin/cuda_ipc_gpu_test" \
    --gtest_output="xml:$RESULTS/xml/cuda_ipc_gpu_test.xml"
  run_step benchmark "$BENCH_S" "$UNPACKED/bin/cuda_backend_benchmark" "${BENCH_ARGS[@]}" \
    --out="$RESULTS/benchmark.tsv" --mlp_out="$RESULTS/mlp_vs_ridge.tsv"
}

# The first lines that matter of each failed step's log: gtest's failures with their values,
# the trace with the seed, value-check and CUDA errors.
failure_excerpts() {  # lines per step, steps
  local name shown=0 failed=0
  for name in "${STEPS[@]}"; do
    case "${VERDICT[$name]}" in PASS*|ok*) continue ;; esac
    [ -f "$RESULTS/logs/$name.log" ] || continue
    failed=$((failed + 1))
    [ $shown -ge "$2" ] && continue
    shown=$((shown + 1))
    echo "-- $name: ${VERDICT[$name]}"
    grep -E "Failure|Expected|Which is|Actual|<=|seed=|^\[seed\]|Google Test trace|: (L[0-9]|mlp|device|host|split)|VALUE CHECK|FATAL|error|illegal|cuda" \
      "$RESULTS/logs/$name.log" | grep -v '^\[ RUN\|^\[       OK\|^{' | cut -c1-400 | head -"$1"
  done
  [ $failed -gt $shown ] && echo "-- $((failed - shown)) more failed steps: their logs are in the archive"
  return 0
}

summarize() {
  local failed=0 name
  for name in "${STEPS[@]}"; do
    case "${VERDICT[$name]}" in PASS*|ok*) ;; *) failed=$((failed + 1)) ;; esac
  done
  {
    if [ -n "$REHEARSAL" ]; then
      [ $failed -eq 0 ] && echo "REHEARSAL OK: ${#STEPS[@]} steps, each loads and reaches its first CUDA call" \
                        || echo "REHEARSAL FAILED: $failed of ${#STEPS[@]} steps"
    else
      [ -n "$PREFLIGHT_FAILED" ] && echo "GPU RUN FAILED BEFORE ANY TEST: preflight ($PREFLIGHT_FAILED)"
      [ $failed -eq 0 ] && [ -z "$PREFLIGHT_FAILED" ] && echo "GPU RUN PASSED: ${#STEPS[@]} steps"
      [ $failed -gt 0 ] && echo "GPU RUN FAILED: $failed of ${#STEPS[@]} steps"
    fi
    echo "mode $MODE, $((SECONDS - START)) s; $(head -1 "$BUNDLE/BUILD_INFO")"
    cat "$RESULTS/preflight.txt"
    local passed=0
    for name in "${STEPS[@]}"; do
      case "${VERDICT[$name]}" in
        PASS*|ok*) passed=$((passed + 1)); [[ $name == parity/* ]] || printf '%-44s %s\n' "$name" "${VERDICT[$name]}" ;;
        *) printf '%-44s %s\n' "$name" "${VERDICT[$name]}" ;;
      esac
    done
    echo "passed $passed of ${#STEPS[@]} steps (parity tests that passed are not listed)"
    [ -z "$REHEARSAL" ] && failure_excerpts 10 6
    grep -h "^value check" "$RESULTS/logs/benchmark.log" 2>/dev/null | head -24
    [ -f "$RESULTS/benchmark.tsv" ] && column -t -s $'\t' "$RESULTS/benchmark.tsv" 2>/dev/null
    [ -f "$RESULTS/mlp_vs_ridge.tsv" ] && column -t -s $'\t' "$RESULTS/mlp_vs_ridge.tsv" 2>/dev/null
    echo "full logs, gtest XML and seeds: gpu-results.tar.gz"
  } > "$RESULTS/summary.txt"
  return $failed
}

# Exactly two files in $OUT, each within 16 MiB: long logs keep their first 256 KiB and last
# 2 MiB (gtest prints failures as they happen and its summary last).
archive() {
  local log
  find "$RESULTS/logs" -type f -size +3M | while read -r log; do
    { head -c 262144 "$log"; echo; echo "[... cut to fit the results archive ...]";
      tail -c 2097152 "$log"; } > "$log.cut" && mv "$log.cut" "$log"
  done
  grep -h "^\[seed\]" "$RESULTS"/logs/*.log "$RESULTS"/logs/*/*.log 2>/dev/null > "$RESULTS/seeds.txt"
  cp "$RESULTS/summary.txt" "$OUT/summary.txt"
  tar -czf "$OUT/gpu-results.tar.gz" -C "$SCRATCH" results
  if [ "$(stat -c %s "$OUT/gpu-results.tar.gz")" -gt $((15 << 20)) ]; then
    find "$RESULTS/logs" -type f -size +512k -exec truncate -s 512k {} +
    tar -czf "$OUT/gpu-results.tar.gz" -C "$SCRATCH" results
  fi
}

gpu_run() {
  mkdir -p "$OUT" || die "cannot create the results folder $OUT"
  rm -f "$OUT/summary.txt" "$OUT/gpu-results.tar.gz"
  [ -z "$(ls -A "$OUT")" ] || echo "warning: $OUT holds other files; only two of its own come back"
  local tool
  for tool in tar gzip timeout ldd awk; do
    command -v "$tool" >/dev/null || die "$tool is missing on this machine"
  done
  SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/kvt-gpu.XXXXXX")
  UNPACKED=$SCRATCH/bundle
  RESULTS=$SCRATCH/results
  unpack
  mkdir -p "$RESULTS/logs/unit" "$RESULTS/logs/parity" "$RESULTS/xml" "$SCRATCH/tmp"
  PREFLIGHT_FAILED=""
  {
    cat "$BUNDLE/BUILD_INFO"
    check_driver || PREFLIGHT_FAILED="driver"
    if CUBLAS_DIR=$(find_cublas); then
      echo "cuBLAS: $CUBLAS_DIR"
    else
      CUBLAS_DIR=/nonexistent
      echo "cuBLAS: libcublas.so.13 + libcublasLt.so.13 not found (CUDA 13 toolkit under" \
           "/usr/local/cuda*, a wheel's nvidia/cu13/lib or nvidia/cublas/lib, ldconfig)"
      PREFLIGHT_FAILED="${PREFLIGHT_FAILED:+$PREFLIGHT_FAILED, }cuBLAS"
    fi
    # Only the bundle and cuBLAS: a library the machine happens to have must not hide a gap.
    export LD_LIBRARY_PATH="$UNPACKED/lib:$CUBLAS_DIR"
    check_libraries || PREFLIGHT_FAILED="${PREFLIGHT_FAILED:+$PREFLIGHT_FAILED, }libraries"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 |
        head -3
      nvidia-smi -q > "$RESULTS/nvidia-smi-q.txt" 2>&1
    fi
  } > "$RESULTS/preflight.txt" 2>&1
  # Until the end replaces it: what a run cut short leaves behind.
  { echo "GPU RUN CUT SHORT: no verdict; the steps that finished:"; cat "$RESULTS/preflight.txt"; } \
    > "$OUT/summary.txt"
  cat "$RESULTS/preflight.txt"
  export LD_LIBRARY_PATH="$UNPACKED/lib:$CUBLAS_DIR"
  if [ -n "$PREFLIGHT_FAILED" ] && [ -z "$REHEARSAL" ]; then
    echo "PREFLIGHT FAILED ($PREFLIGHT_FAILED): no step can pass; running them for their logs"
  fi
  run_all
  summarize
  local failed=$?
  [ -n "$PREFLIGHT_FAILED" ] && [ -z "$REHEARSAL" ] && failed=$((failed + 1))
  archive
  cat "$OUT/summary.txt"
  rm -rf "$SCRATCH"
  [ $failed -eq 0 ]
}

# The build machine plays the GPU machine: a copy of the script and bundle, a clean
# environment, no Bazel; then the results folder is checked against what comes back from one.
rehearse() {
  [ -f "$BUNDLE/bundle.tar.xz" ] || bundle || return 1
  local stage begin=$SECONDS
  stage=$(mktemp -d "${TMPDIR:-/tmp}/kvt-gpu-rehearsal.XXXXXX")
  mkdir -p "$stage/tree/tests/gpu" "$stage/out" "$stage/tmp"
  cp tests/gpu/run.sh "$stage/tree/tests/gpu/"
  cp -r "$BUNDLE" "$stage/tree/bazel-gpu-bundle"
  env -i PATH=/usr/bin:/bin HOME="$stage" TMPDIR="$stage/tmp" OUT="$stage/out" \
    KVT_GPU_REHEARSAL=1 bash "$stage/tree/tests/gpu/run.sh" "$@"
  local rc=$? problems=0
  echo "== rehearsal: $((SECONDS - begin)) s, the run's exit status $rc"
  local files
  files=$(cd "$stage/out" && find . -mindepth 1 | sort)
  echo "results folder:"; (cd "$stage/out" && ls -l)
  [ "$(grep -c . <<<"$files")" -le 2 ] || { echo "more than 2 entries in the results folder"; problems=1; }
  [ -f "$stage/out/summary.txt" ] && [ -f "$stage/out/gpu-results.tar.gz" ] ||
    { echo "summary.txt or gpu-results.tar.gz missing"; problems=1; }
  [ -z "$(find "$stage/out" -type f -size +16M)" ] || { echo "a result over 16 MiB"; problems=1; }
  [ -z "$(find "$stage/out" -mindepth 2)" ] || { echo "folders in the results folder"; problems=1; }
  [ -z "$(ls -A "$stage/tmp")" ] || { echo "temporaries left behind: $(ls "$stage/tmp")"; problems=1; }
  if git rev-parse --git-dir >/dev/null 2>&1; then
    # What travels: tracked and untracked-unignored files, plus the bundle.
    local tree bundle_bytes
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    bundle_bytes=$(du -sb "$BUNDLE" | cut -f1)
    echo "working tree $((tree >> 20)) MiB + bundle $((bundle_bytes >> 20)) MiB (limit 64 MiB)"
    [ $((tree + bundle_bytes)) -le $((64 << 20)) ] || { echo "tree + bundle over 64 MiB"; problems=1; }
  fi
  rm -rf "$stage"
  [ $rc -eq 0 ] && [ $problems -eq 0 ]
}

MODE=full
REHEARSAL=${KVT_GPU_REHEARSAL:-}
PARITY_S=240
BENCH_S=180
BENCH_ARGS=(--mlp_presets=qwen3-14b-to-32b --mlp_hidden=1024 --mlp_granularity=per_layer)
case "${1:-}" in
  --bundle) bundle; exit $? ;;
  --pack) shift; pack "$@"; exit $? ;;
  --rehearse) shift; rehearse "$@"; exit $? ;;
  --find-cublas) find_cublas; exit $? ;;
  --quick)
    MODE=quick
    DEADLINE=${KVT_GPU_DEADLINE_S:-280}
    PARITY_S=120
    BENCH_S=60
    BENCH_ARGS=(--presets=qwen3-14b-to-32b --tokens=1024,32768 --repeats=3 --mlp_presets=
                --per_head_presets= --host_presets=)
    ;;
  "") ;;
  *) die "unknown option $1 (see the top of this script)" ;;
esac
[ -n "$REHEARSAL" ] && MODE="$MODE rehearsal"
gpu_run
