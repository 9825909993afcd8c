"""kvt_testing: what the Python tests and the evaluation harness share (testonly, //testing).

- runfiles: files of this workspace in Bazel's runfiles (binaries, mappers, models)
- junit_main: unittest.main with one JUnit testcase per test method under `bazel test`
- kvtd: kvtd as a real child process on an OS-picked port
- tinyfamily: the bundled tiny Llama family (eval/tinyfamily) through transformers, its KV dumps,
  `kvt fit`, a kvtd serving the fitted mappers, and the context-benefit measure

Each module is a py_library of its own in testing/BUILD.bazel; a user depends on what it imports.
"""
