// Process-wide glibc malloc settings for programs that move KV caches (kvtd, the transport
// benchmark): which allocations get their own mapping, and how much freed heap is kept warm.
#pragma once

#include <cstdint>

namespace kvt {

// Allocations at or above this get their own mmap (returned to the OS on free); below it they
// come from the heap arenas and are reused warm. Above gRPC's largest TCP read buffer
// (kGrpcMaxReadChunkBytes): on a VM a fresh page costs a fault plus kernel zeroing, about
// 2 GB/s here, several times a socket copy, so read buffers must be reused, not remapped.
inline constexpr int64_t kMmapThresholdBytes = 8ll << 20;
// gRPC's largest TCP read (GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, set by the server and client to
// this so the relation to kMmapThresholdBytes holds whatever gRPC's default is).
inline constexpr int64_t kGrpcMaxReadChunkBytes = 4ll << 20;
// Free memory an arena keeps at its top before giving it back: a few read buffers' worth, so
// a steady stream reuses them, but an idle process does not hold what a burst needed.
inline constexpr int64_t kTrimThresholdBytes = 64ll << 20;
// At most this many heap arenas (glibc's default is 8 per core): each keeps its own free
// memory, so more arenas hold more idle RSS.
inline constexpr int kMaxArenas = 4;

// Applies the settings above with mallopt. Call first thing in main, before any thread starts
// (threads bind to arenas on their first allocation). Fixed values also turn off glibc's
// dynamic mmap threshold, which otherwise rises to 32 MiB after the first large free and lets
// cache-sized buffers fragment the arenas (RSS creeping under load).
void TuneAllocatorForCacheTraffic();

}  // namespace kvt
