#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/*_fuzzer.cc) with clang, ASan and UBSan into fuzz/out/.
# Bazel's toolchain here is gcc, which has no libFuzzer, so this compiles the project's plain
# C++17 sources directly (fuzz/Makefile; incremental). Usage: fuzz/build.sh [make args]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
exec make -s -f "$root/fuzz/Makefile" -j"$(nproc)" "$@"
