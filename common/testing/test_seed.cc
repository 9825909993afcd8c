#include "common/testing/test_seed.h"

#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace kvt {
namespace testing {
namespace {

constexpr char kSeedVariable[] = "KVT_TEST_SEED";

// splitmix64's finaliser: a bijection that spreads every input bit over the output.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// FNV-1a: the same value on every build and platform (std::hash promises neither).
uint64_t HashString(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ULL;
  return h;
}

uint64_t ReadBase() {
  const char* value = std::getenv(kSeedVariable);
  if (value != nullptr && *value != '\0') {
    uint64_t seed = 0;
    if (!absl::SimpleAtoi(value, &seed)) {
      std::fprintf(stderr, "[seed] %s=%s is not a decimal uint64\n", kSeedVariable, value);
      std::abort();
    }
    return seed;
  }
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

// The running test's full name ("Suite.Name/param"), or "" outside a test.
std::string CurrentTestName() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return "";
  return std::string(info->test_suite_name()) + "." + info->name();
}

struct SeedState {
  absl::Mutex mu;
  bool drawn ABSL_GUARDED_BY(mu) = false;
  // (test, what) -> draws so far.
  std::map<std::pair<std::string, std::string>, uint64_t> draws ABSL_GUARDED_BY(mu);
};

SeedState& State() {
  static SeedState* state = new SeedState;
  return *state;
}

// Prints the replay command when a test fails in a process that drew seeds.
class ReplayPrinter : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    {
      SeedState& state = State();
      absl::MutexLock lock(&state.mu);
      if (!state.drawn) return;
    }
    const std::string name = std::string(info.test_suite_name()) + "." + info.name();
    const unsigned long long base = TestSeedBase();
    std::fprintf(stderr,
                 "[seed] %s failed: replay with %s=%llu (bazel test --test_env=%s=%llu "
                 "--test_filter=%s TARGET)\n",
                 name.c_str(), kSeedVariable, base, kSeedVariable, base, name.c_str());
  }
};

// Registered when this file is linked, i.e. whenever a test calls FreshSeed; gtest owns it.
const bool kReplayPrinterRegistered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new ReplayPrinter);
  return true;
}();

}  // namespace

uint64_t TestSeedBase() {
  static const uint64_t base = ReadBase();
  return base;
}

uint64_t DeriveSeed(uint64_t base, const std::string& test, const std::string& what,
                    uint64_t index) {
  return Mix(Mix(Mix(base) ^ HashString(test + '\0' + what)) ^ index);
}

uint64_t FreshSeed(const char* what) {
  (void)kReplayPrinterRegistered;
  const std::string test = CurrentTestName();
  uint64_t index;
  {
    SeedState& state = State();
    absl::MutexLock lock(&state.mu);
    state.drawn = true;
    index = state.draws[{test, what}]++;
  }
  const uint64_t base = TestSeedBase();
  const uint64_t seed = DeriveSeed(base, test, what, index);
  std::fprintf(stderr, "[seed] %s: %llu (%s=%llu)\n", what, static_cast<unsigned long long>(seed),
               kSeedVariable, static_cast<unsigned long long>(base));
  return seed;
}

}  // namespace testing
}  // namespace kvt
