#!/usr/bin/env bash
# The GPU binaries (manual / not run in CI) link and load here, the parity test lists every
# dtype/layout/RoPE suite, the benchmark refuses cleanly without a device, run.sh parses.
set -euo pipefail
cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
bash -n tests/gpu/run.sh

tests=$(kernels/cuda/cuda_backend_test --gtest_list_tests)
# The backend conformance suite's tests are listed as Name/Cuda (kernels/testing/backend_conformance.cc).
for name in EveryRopeTypeAndStyle YarnWithExplicitAttentionFactor EveryDtypeLayoutAndWeightDtype \
            UnmatchedShapesAndOddHeadDim SeparateSigmaLengths NoBias LargeAndExplicitPositions \
            ChunksAndLayerGroups \
            RealHeadShapesBf16 ConcurrentCalls StreamedPrepareTranslatesLayerByLayer BadInputsNameTheField \
            SplitTranslationEqualsWhole ReadsAndWritesAnotherProcesssIpcMemory \
            MlpBothGranularitiesFp32AndBf16 MlpDtypesLayoutsAndChunks MlpMixedDtypesConvertWeights \
            MlpChunksAndLayerGroups \
            MlpRealHeadShapesBf16 MlpStreamedPrepareCountsEveryWeight MlpBadMappersNameTheField; do
  if ! grep -qE "^  $name(/Cuda  #.*)?\$" <<<"$tests"; then
    echo "cuda_backend_test does not list $name:"
    echo "$tests"
    exit 1
  fi
done

set +e
out=$(kernels/cuda/cuda_backend_benchmark --tokens=64 --mlp_presets=qwen3-14b-to-32b 2>&1)
rc=$?
set -e
if [ "$rc" -eq 0 ]; then
  echo "$out"
  echo "benchmark ran: this machine has a GPU, nothing to check here"
  exit 0
fi
if ! grep -q "no CUDA device\|built without the CUDA toolkit" <<<"$out"; then
  echo "benchmark failed without saying there is no device (rc=$rc):"
  echo "$out"
  exit 1
fi
echo "ok"
