// Seeds for randomised tests, replayable from one environment variable (docs/TESTING.md).
//
// FreshSeed(what) is the seed of one random draw of a test. Every draw derives from one base
// seed: KVT_TEST_SEED when set (a decimal uint64), else one value from std::random_device per
// process. A draw depends on the base seed, the full name of the gtest test that runs it, `what`
// and how often that test asked for `what` before, so a test replays the same seeds whichever
// other tests run beside it (a filter, a shard). A failing test in a process that drew seeds
// prints the replay command, "replay with KVT_TEST_SEED=<base> ...", to stderr.
#pragma once

#include <cstdint>
#include <string>

namespace kvt {
namespace testing {

// The base seed every FreshSeed derives from (KVT_TEST_SEED or one random draw per process).
uint64_t TestSeedBase();

// Draw `index` (0, 1, ...) of `what` in the test `test` ("Suite.Name"; "" outside a test) under
// the base seed `base`: what FreshSeed returns.
uint64_t DeriveSeed(uint64_t base, const std::string& test, const std::string& what,
                    uint64_t index);

// The seed of one draw, printed to stderr with its base seed.
uint64_t FreshSeed(const char* what);

}  // namespace testing
}  // namespace kvt
