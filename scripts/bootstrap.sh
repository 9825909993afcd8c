#!/usr/bin/env bash
# Installs exactly the Debian 12 packages kvt needs to build, test and run (idempotent, quiet:
# a few seconds when everything is present). Usage: scripts/bootstrap.sh [--python]
#   --python   also create the project venv (.venv) for the Python client and eval tools.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap          # Bazel 4.2.3 (offline)
  bazel-rules-java         # @rules_java for Bazel's own tools
  g++
  pkg-config
  protobuf-compiler        # /usr/bin/protoc
  protobuf-compiler-grpc   # /usr/bin/grpc_cpp_plugin, grpc_python_plugin
  libprotobuf-dev
  libgrpc++-dev            # gRPC 1.51 C++ (health, reflection)
  grpc-proto               # grpc/health/v1/health.proto for clients
  libabsl-dev              # Abseil 20220623
  prometheus-cpp-dev       # metrics exposer
  libyaml-cpp-dev          # kvtd.yaml
  nlohmann-json3-dev       # safetensors headers
  libopenblas-dev          # CPU GEMMs
  libdnnl-dev              # oneDNN 2.6.3: bf16 matmuls of the CPU backend (AMX / AVX-512 BF16)
  liblapacke-dev           # Cholesky solves (kvt fit)
  libssl-dev               # SHA-256 (libcrypto), TLS
  openssl                  # certificates for the TLS/mTLS tests
  zlib1g-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev         # Google Benchmark programs
  clang                    # clang 14: libFuzzer targets (fuzz/build.sh)
  libclang-rt-14-dev       # libFuzzer + ASan/UBSan runtimes for clang 14
  make                     # fuzz/Makefile
  prometheus               # promtool + a real Prometheus for the integration test
  python3
  python3-venv
  python3-numpy            # known-answer test generators, eval
  python3-grpcio           # the Python client (clients/python)
  python3-protobuf
  python3-yaml             # clients/python tests read mapper manifests
  python3-mypy             # //clients/python:package_test type-checks the kvt package
  python3-xmlrunner        # per-case JUnit XML of the Python unittest suites
  python3-torch            # torch 1.13: client adapters, eval (transformers comes from PyPI)
  python3-matplotlib       # eval/run_eval.py plots for docs/EVAL.md
  python3.11-doc           # eval/tinyfamily corpus: the Python docs' English text
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ "${1:-}" = "--python" ]; then
  root="$(cd "$(dirname "$0")/.." && pwd)"
  # Debian's interpreter, so --system-site-packages sees Debian's numpy, grpcio, torch (a
  # python3 earlier on PATH, e.g. pyenv's, would not); a venv made from another one is redone.
  if [ ! -x "$root/.venv/bin/python" ] ||
     [ "$("$root/.venv/bin/python" -c 'import sys; print(sys.base_prefix)')" != /usr ]; then
    rm -rf "$root/.venv"
    /usr/bin/python3 -m venv --system-site-packages "$root/.venv"
  fi
  if [ -f "$root/clients/python/requirements.txt" ]; then
    "$root/.venv/bin/pip" install -q -r "$root/clients/python/requirements.txt"
  fi
  "$root/.venv/bin/pip" install -q -r "$root/eval/requirements.txt"  # eval/, tools/dump_kv.py
  "$root/.venv/bin/pip" install -q -r "$root/deploy/requirements.txt"  # //deploy:k8s_test
fi
