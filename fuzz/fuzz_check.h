// FUZZ_CHECK: an invariant a fuzz target asserts about a parser's result. A violation aborts, which
// libFuzzer reports as a crash (and the gcc-built replay test as a failure).
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)
