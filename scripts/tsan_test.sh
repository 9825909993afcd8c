#!/usr/bin/env bash
# ThreadSanitizer run of the concurrency tests that matter (store, server, transport, load
# generator, mapper control, faults, gRPC service tests) with the project's suppressions for
# uninstrumented Debian libraries (tools/tsan.supp, docs/RELIABILITY.md "Sanitizers"), plus the
# canary that proves a race in our code is still reported. Extra arguments go to `bazel test`.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# An absolute path: tests run in their runfiles tree. .bazelrc's tsan config passes TSAN_OPTIONS
# through to the tests (and the kvtd processes they start inherit it).
export TSAN_OPTIONS="suppressions=$root/tools/tsan.supp ${TSAN_OPTIONS:-}"
targets=(
  //tools:tsan_canary_test
  //mapper_store:store_test //mapper_store:store_paging_test //mapper_store:store_stress_test
  //mapper_store:source_test //mapper_store:host_tier_test //mapper_store:device_tier_test
  //server:config_test //server:admission_test //server:compute_executor_test
  //server:metrics_test //server:auth_test //server:backend_select_test
  //transport:shm_registry_test //transport:paged_test //transport:kv_chunks_test
  //kernels:thread_pool_test
  //loadtest:load_generator_test //loadtest:report_test
  //tests:mapper_control_test //tests:translate_service_test //tests:faults_test
  //tests:pipelined_transport_test //tests:shm_transport_test //tests:security_test
  //tests:telemetry_test //tests:kvtd_process_test
)
exec bazel test --config=tsan "${targets[@]}" "$@"
