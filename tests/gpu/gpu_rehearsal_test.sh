#!/usr/bin/env bash
# The GPU run rehearsed without a GPU: the GPU binaries Bazel built for this test are packed as
# `run.sh --bundle` packs them, then run as a GPU machine runs them (clean environment, only the
# bundle's libraries, no Bazel); every step must load and reach its first CUDA call, and the
# results folder must hold exactly the summary and one archive within the size limits.
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
if kernels/cuda/cuda_backend_benchmark 2>&1 | grep -q "built without the CUDA toolkit"; then
  echo "built without CUDA (--config=nocuda or no toolkit): no GPU bundle to rehearse"
  exit 0
fi
# xz -0: this bundle only has to unpack, not to travel.
export KVT_GPU_BUNDLE="${TEST_TMPDIR}/bundle" TMPDIR="${TEST_TMPDIR}" KVT_GPU_XZ_LEVEL=0
bash tests/gpu/run.sh --pack kernels/cuda/device_test kernels/cuda/cuda_backend_startup_test \
  kernels/cuda/ipc_test server/backend_select_test server/backend_self_check_test \
  kernels/cuda/cuda_backend_test kernels/cuda/cuda_backend_benchmark tests/cuda_ipc_gpu_test \
  server/kvtd
out=$(bash tests/gpu/run.sh --rehearse 2>&1) || { echo "$out"; exit 1; }
echo "$out"
grep -q "^REHEARSAL OK" <<<"$out"
# cuBLAS from a CUDA 13 wheel (nvidia/cu13/lib) when no toolkit has it.
site="${TEST_TMPDIR}/site"
mkdir -p "$site/nvidia/cu13/lib"
touch "$site/nvidia/cu13/lib/libcublas.so.13" "$site/nvidia/cu13/lib/libcublasLt.so.13"
found=$(KVT_GPU_TOOLKIT_DIRS=/nonexistent PYTHONPATH="$site" bash tests/gpu/run.sh --find-cublas)
[ "$found" = "$site/nvidia/cu13/lib" ] || { echo "cuBLAS wheel not found: '$found'"; exit 1; }
# The parity test is split into one process per test: at least the suite's and CUDA's own.
[ "$(grep -c '^parity/' <<<"$out")" -ge 20 ] || { echo "too few parity steps"; exit 1; }
