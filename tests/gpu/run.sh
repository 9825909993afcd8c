#!/usr/bin/env bash
# The CUDA backend's GPU checks in one script that fits the lent GPU machine's 10 minutes:
# the start-up self-check, parity tests (CUDA vs CPU vs float64 reference), then the benchmark
# of the paper's shapes.
#
#   bash tests/gpu/run.sh --bundle   # here (Bazel, CUDA toolkit, no GPU needed): build the GPU
#                                    # binaries and pack them with their shared libraries into
#                                    # bazel-gpu-bundle/ (ignored by git; xz, ~15 MiB to carry)
#   bash tests/gpu/run.sh            # on the GPU machine, with bazel-gpu-bundle carried:
#                                    #   run(command="bash tests/gpu/run.sh",
#                                    #       carry=["bazel-gpu-bundle"], timeout_s=600)
#
# The GPU machine has no Bazel and none of Debian's libraries, so the binaries travel with
# every library they need except glibc, libstdc++ and cuBLAS, which that machine has (newer).
# Results go to $OUT (the device tool's folder; /tmp/kvt-gpu-out elsewhere): per-step logs,
# gtest XML, benchmark.tsv, device.txt. The last lines printed are a short table.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=bazel-gpu-bundle
GPU_TARGETS=(
  //kernels/cuda:device_test
  //kernels/cuda:cuda_backend_startup_test
  //kernels/cuda:cuda_backend_test
  //kernels/cuda:cuda_backend_benchmark
  //server:backend_select_test
  # --- Start-up self-check (issue 21): the real CUDA backend against CPU and float64.
  //server:backend_self_check_test
  # --- CUDA IPC (issue 7): round trip through exported handles; kvtd is its second process.
  //tests:cuda_ipc_gpu_test
  //server:kvtd
)

bundle() {
  bazel build -c opt "${GPU_TARGETS[@]}" || return 1
  # bazel-out holds every configuration's outputs; k8-opt is the default one (.bazelrc). Not
  # `bazel info`, which waits for the server lock behind every other Bazel command.
  local bin=bazel-out/k8-opt/bin
  [ -d "$bin" ] || bin=$(bazel info -c opt bazel-bin 2>/dev/null) || return 1
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
  local originals=()
  for target in "${GPU_TARGETS[@]}"; do
    local path=${target#//}
    path=${path/://}
    cp "$bin/$path" "$BUNDLE/bin/" || return 1
    originals+=("$bin/$path")
  done
  # Every shared library the binaries load, except the C/C++ runtime and cuBLAS (large, and
  # the GPU machine's own matches its driver). The kvt libraries are in bazel-bin/_solib_k8,
  # found through the binaries' $ORIGIN-relative RUNPATH: ldd the originals, not the copies.
  local listed
  listed=$(ldd "${originals[@]}") || return 1
  if grep -q "not found" <<<"$listed"; then
    echo "bundle: unresolved libraries:" >&2
    grep "not found" <<<"$listed" | sort -u >&2
    return 1
  fi
  awk '/=> \// {print $3}' <<<"$listed" | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      ld-linux*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libstdc++*|libgcc_s*|\
      libcuda.so*|libcublas*) ;;
      *) cp -L "$lib" "$BUNDLE/lib/" ;;
    esac
  done
  strip --strip-unneeded "$BUNDLE"/bin/* "$BUNDLE"/lib/* 2>/dev/null
  # --- CUDA IPC (issue 7): cuda_ipc_gpu_test finds kvtd at $RUNFILES_DIR/kvt/server/kvtd.
  mkdir -p "$BUNDLE/runfiles/kvt/server" && mv "$BUNDLE/bin/kvtd" "$BUNDLE/runfiles/kvt/server/"
  if ! grep -q cublasGemmStridedBatchedEx "$BUNDLE"/bin/* "$BUNDLE"/lib/*; then
    echo "bundle: the CUDA backend was built without CUDA (no toolkit, or --config=nocuda)" >&2
    return 1
  fi
  {
    echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- kernels server || echo ' (+ local changes)')"
    echo "built $(date -u +%FT%TZ) on $(. /etc/os-release; echo "$PRETTY_NAME"), $(/usr/local/cuda/bin/nvcc --version | tail -1)"
  } > "$BUNDLE/BUILD_INFO"
  # Carried compressed (OpenBLAS alone is 36 MB): one archive, unpacked in place on the GPU
  # machine.
  local parts
  parts=$(cd "$BUNDLE" && ls | grep -v '^BUILD_INFO$')
  (cd "$BUNDLE" && tar -cf - $parts | xz -6 -T0 > bundle.tar.xz && rm -rf $parts) || return 1
  local size
  size=$(du -sm "$BUNDLE" | cut -f1)
  echo "bundle: $BUNDLE, ${size} MiB (the device tool carries at most 64 MiB with the tree)"
  [ "$size" -le 40 ] || { echo "bundle: too large to carry" >&2; return 1; }
}

unpack() {
  [ -f "$BUNDLE/bundle.tar.xz" ] && [ ! -d "$BUNDLE/bin" ] && tar -xJf "$BUNDLE/bundle.tar.xz" -C "$BUNDLE"
  return 0
}

if [ "${1:-}" = "--bundle" ]; then
  bundle
  exit $?
fi

OUT=${OUT:-/tmp/kvt-gpu-out}
mkdir -p "$OUT"
unpack
if [ ! -d "$BUNDLE/bin" ]; then
  if command -v bazel >/dev/null; then
    { bundle && unpack; } || exit 1
  else
    echo "no $BUNDLE/ and no bazel here: run 'bash tests/gpu/run.sh --bundle' on the build" \
         "machine and carry $BUNDLE" >&2
    exit 1
  fi
fi
cat "$BUNDLE/BUILD_INFO"

# cuBLAS from the machine: the toolkit, or the pip wheel PyTorch uses.
cuda_libs=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$dir" ] && cuda_libs="$cuda_libs:$dir"
done
wheel_cublas=$(python3 -c 'import nvidia.cublas as c, os; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null)
[ -n "$wheel_cublas" ] && cuda_libs="$cuda_libs:$wheel_cublas"
export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
missing=$(ldd "$BUNDLE"/bin/* | grep "not found" | sort -u)
if [ -n "$missing" ]; then
  echo "missing libraries on this machine:" >&2
  echo "$missing" >&2
  exit 1
fi
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
  uname -a
} | tee "$OUT/device.txt"

declare -A result
run_step() {  # name timeout_s command...
  local name=$1 limit=$2
  shift 2
  local begin=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  result[$name]="rc=$rc $((SECONDS - begin))s"
  echo "== $name: ${result[$name]}"
  tail -5 "$OUT/$name.log"
}

# Step limits sum to 565 s, under the device tool's 600 s per command, so a slow step cannot
# take the summary with it. Short checks first: a tight budget still gets their verdict.
run_step unit 45 bash -c "for t in device_test cuda_backend_startup_test backend_select_test \
  backend_self_check_test; do $BUNDLE/bin/\$t || exit 1; done"
# --- Start-up self-check (issue 21): what kvtd does before it serves on the GPU: ridge and MLP,
# bf16 and fp32, vs CPU and float64 (SPEC 3). Exit 0 only if every check passed; with
# --backend=cuda a failing GPU is exit 2 naming the case. The summary lines go to the log.
run_step self_check 30 "$BUNDLE/runfiles/kvt/server/kvtd" --self_check --backend=cuda
# --- CUDA IPC (issue 7): this process exports cudaMalloc'd buffers, kvtd (a second process)
# opens the handles and translates through them; compared with the inline result.
mkdir -p "$OUT/cuda_ipc_tmp"
run_step cuda_ipc 90 env RUNFILES_DIR="$PWD/$BUNDLE/runfiles" TEST_TMPDIR="$OUT/cuda_ipc_tmp" \
  "$BUNDLE/bin/cuda_ipc_gpu_test" --gtest_output="xml:$OUT/cuda_ipc_gpu_test.xml"
run_step parity 200 "$BUNDLE/bin/cuda_backend_test" --gtest_output="xml:$OUT/cuda_backend_test.xml"
# Ridge on the paper's pairs, and Qwen3 14B->32B also as an MLP mapper (hidden 1024,
# per_layer; issue 11) in the same run: mlp_vs_ridge.tsv has the ratio.
run_step benchmark 200 "$BUNDLE/bin/cuda_backend_benchmark" --out="$OUT/benchmark.tsv" \
  --mlp_presets=qwen3-14b-to-32b --mlp_hidden=1024 --mlp_granularity=per_layer \
  --mlp_out="$OUT/mlp_vs_ridge.tsv"

echo
echo "== parity failures (first 20 lines)"
grep -E "Failure|FAILED|error" "$OUT/parity.log" | head -20
echo
echo "== summary: $(sed -n 3p "$OUT/device.txt" | cut -d, -f1-2), $(head -1 "$OUT/device.txt")"
for step in unit self_check cuda_ipc parity benchmark; do echo "$step: ${result[$step]}"; done
grep -v "^{" "$OUT/self_check.log" | head -5  # the printed summaries, not the JSON log
grep -E "^\[  (PASSED|FAILED)" "$OUT/parity.log"
if [ -f "$OUT/benchmark.tsv" ]; then
  column -t -s $'\t' "$OUT/benchmark.tsv" 2>/dev/null || cat "$OUT/benchmark.tsv"
fi
if [ -f "$OUT/mlp_vs_ridge.tsv" ]; then
  echo "== MLP vs ridge, same pair, same run (mlp_over_ridge = MLP ms / ridge ms)"
  column -t -s $'\t' "$OUT/mlp_vs_ridge.tsv" 2>/dev/null || cat "$OUT/mlp_vs_ridge.tsv"
fi
for step in unit self_check cuda_ipc parity benchmark; do
  case "${result[$step]}" in rc=0*) ;; *) exit 1 ;; esac
done
