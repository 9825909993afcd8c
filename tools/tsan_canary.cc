// A deliberate data race in our own code, run by //tools:tsan_canary_test under --config=tsan to
// prove that TSan with tools/tsan.supp still reports races in kvt code (the suppressions only
// silence interceptors called from uninstrumented system libraries).
#include <cstdio>
#include <thread>

namespace {
int racy_counter = 0;  // written by two threads with no synchronization, on purpose

void Bump() {
  for (int i = 0; i < 100000; ++i) racy_counter = racy_counter + 1;
}
}  // namespace

int main() {
#if defined(__SANITIZE_THREAD__)
  std::printf("tsan build\n");
#else
  std::printf("not a tsan build\n");
#endif
  std::fflush(stdout);
  std::thread a(Bump);
  std::thread b(Bump);
  a.join();
  b.join();
  std::printf("counter %d\n", racy_counter);
  return 0;
}
