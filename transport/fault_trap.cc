#include "transport/fault_trap.h"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <mutex>

namespace kvt {
namespace {

// Lock-free: the handler may run on any thread at any time. start == 0: a free slot. len is
// written before start is published and start cleared before the slot is reused.
struct Slot {
  std::atomic<uintptr_t> start{0};
  std::atomic<size_t> size{0};
  std::atomic<bool> fired{false};
  std::atomic<bool> taken{false};
};
constexpr int kSlots = 4096;
Slot slots[kSlots];
struct sigaction previous;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& slot : slots) {
    const uintptr_t start = slot.start.load(std::memory_order_acquire);
    if (start == 0 || at < start) continue;
    const size_t size = slot.size.load(std::memory_order_relaxed);
    if (at - start >= size) continue;
    // The object behind the mapping is shorter than the mapping: from here on the mapping is
    // private zero pages, so the faulting instruction (re-run on return) and every later access
    // succeed. mmap is a plain system call, safe in a handler.
    mmap(reinterpret_cast<void*>(start), size, PROT_READ | PROT_WRITE,
         MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    slot.fired.store(true, std::memory_order_release);
    return;
  }
  // Not a registered region: what would have happened without this handler.
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(signal, info, context);
    return;
  }
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(signal);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);  // returning re-runs the access, which now terminates
}

void Install() {
  struct sigaction action = {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  sigaction(SIGBUS, &action, &previous);
}

}  // namespace

int ArmFaultTrap(char* start, size_t size) {
  static std::once_flag installed;
  std::call_once(installed, Install);
  for (int i = 0; i < kSlots; ++i) {
    bool expected = false;
    if (!slots[i].taken.compare_exchange_strong(expected, true)) continue;
    slots[i].fired.store(false, std::memory_order_relaxed);
    slots[i].size.store(size, std::memory_order_relaxed);
    slots[i].start.store(reinterpret_cast<uintptr_t>(start), std::memory_order_release);
    return i;
  }
  return -1;
}

void DisarmFaultTrap(int slot) {
  if (slot < 0) return;
  slots[slot].start.store(0, std::memory_order_release);
  slots[slot].taken.store(false, std::memory_order_release);
}

bool FaultTrapFired(int slot) {
  return slot >= 0 && slots[slot].fired.load(std::memory_order_acquire);
}

}  // namespace kvt
