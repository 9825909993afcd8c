// Keeps kvtd alive when a client shrinks or truncates a shared-memory object it registered: a
// SIGBUS inside an armed mapping replaces that mapping with zero pages and flags it, so the
// faulting copy completes and the request that used the region fails with a named error.
#pragma once

#include <cstddef>

namespace kvt {

// Watches [start, start + size) (a whole mmap'ed mapping) from now on; installs the SIGBUS
// handler on first use. Returns the slot to pass to the others, or -1 when every slot is taken
// (the mapping is then unprotected, as before).
int ArmFaultTrap(char* start, size_t size);
// Stops watching (before the mapping is unmapped).
void DisarmFaultTrap(int slot);
// Whether a fault in the slot's mapping replaced it: its bytes are no longer the object's.
bool FaultTrapFired(int slot);

}  // namespace kvt
