#!/usr/bin/env bash
# Fails when a dependency crosses the layering of docs/ARCHITECTURE.md ("Packages and layers"):
# each rule is a `bazel query somepath(FROM, TO)` that must be empty. Visibility (the BUILD
# files) refuses a forbidden *direct* edge at analysis time; this catches the transitive ones
# (fit -> something allowed -> client) that visibility cannot see. Run by scripts/test.sh.
set -uo pipefail
cd "$(dirname "$0")/.."

# Production code (no tests, no testonly helpers) of a package pattern.
prod() { echo "(kind('cc_library|cc_binary', $1) except attr(testonly, 1, $1))"; }

failed=0
rule() {  # rule "why" FROM TO
  local path
  if ! path=$(bazel query --noshow_progress "somepath($2, $3)" 2>/tmp/check_layering.$$); then
    cat /tmp/check_layering.$$ >&2
    rm -f /tmp/check_layering.$$
    echo "check_layering: query failed for: $1" >&2
    exit 2
  fi
  rm -f /tmp/check_layering.$$
  if [ -n "$path" ]; then
    echo "FORBIDDEN: $1; a path:" >&2
    echo "$path" | sed 's/^/  /' >&2
    failed=1
  fi
}

rule "fit/ uses the store and kernels, never the client or the server" \
  "//fit/..." "//client/... + //server/..."
rule "cli/ never links the server (the RPC commands use client/)" \
  "$(prod //cli/...)" "//server/..."
rule "client/ never links the server" "//client/..." "//server/..."
rule "the server never links the client, the fitter or the CLI" \
  "$(prod "//server/... + //prefix_cache/...")" "//client/... + //fit/... + //cli/..."
rule "the store, format and kernels never reach fit, cli, client or server" \
  "//mapper_store/... + //safetensors/... + //kernels/... + //host_cache/... + //transport/... + //quality/..." \
  "//fit/... + //cli/... + //client/... + //server/..."
rule "kernels/ sit below the mapper store" "$(prod //kernels/...)" "//mapper_store/... + //safetensors/..."
rule "safetensors/ uses kernels/ and common/ only" \
  "$(prod //safetensors/...)" \
  "//mapper_store/... + //host_cache/... + //transport/... + //quality/... + //prefix_cache/... + //client/... + //server/... + //fit/... + //cli/..."
rule "common/ sits below everything first-party" \
  "$(prod //common/...)" \
  "//kernels/... + //safetensors/... + //mapper_store/... + //host_cache/... + //transport/... + //client/... + //server/... + //fit/... + //cli/..."

if [ "$failed" -ne 0 ]; then
  echo "check_layering: forbidden dependencies (docs/ARCHITECTURE.md, Packages and layers)" >&2
  exit 1
fi
echo "check_layering: ok"
