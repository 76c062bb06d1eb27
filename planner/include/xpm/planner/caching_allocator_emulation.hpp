// xpm/planner/caching_allocator_emulation.hpp — the bookkeeping of PyTorch's CUDA caching
// allocator (no device memory): which segments it would reserve for a sequence of allocations
// and frees, so that reserved bytes, fragmentation and the out-of-memory errors they cause can
// be planned and tested on a machine without a GPU.
//
//   CachingAllocatorEmulation allocator;                       // CachingAllocatorOptions{} : classic segments
//   auto a = allocator.allocate(3 << 20, /*capacity_bytes=*/0);  // 3 MiB: a 20 MiB segment
//   auto b = allocator.allocate(100, 0);                        // 512 B in a 2 MiB small segment
//   allocator.free(*a);                                         // cached: still reserved
//   allocator.reserved_bytes();                                 // 22 MiB
//   allocator.empty_cache();                                    // the 20 MiB segment released
//
// The policy, as PyTorch documents it (docs "CUDA semantics: memory management" and the notes of
// c10/cuda/CUDACachingAllocator.cpp), one device, one stream:
//  - a request is rounded up to a multiple of 512 bytes (at least 512): its block size, what
//    "allocated bytes" count;
//  - blocks of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones
//    from the large pool: a 20 MiB segment for requests under 10 MiB, else the request rounded
//    up to 2 MiB;
//  - a request takes the smallest cached free block of its pool that holds it (best fit, lowest
//    address among equal sizes), split when what remains is at least 512 bytes (small pool) or
//    more than 1 MiB (large pool); freed blocks stay cached and merge with free neighbours of
//    their segment;
//  - with no cached block that fits, a new segment is reserved; when that would pass the
//    capacity, every cached segment with no block in use is released first and the reserve
//    retried; still over: out of memory (allocate returns no block, changing nothing else);
//  - expandable segments (PYTORCH_ALLOC_CONF=expandable_segments:True): each pool is one
//    segment that grows by mapping pages (2 MiB in the small pool, 20 MiB in the large) at the
//    first free address range that holds the request, and blocks split at 512-byte granularity
//    in both pools; releasing the cache unmaps the whole pages inside free blocks.
// Not emulated: several streams and their events, CUDA graphs' private pools,
// max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold.
//
// Units: bytes. Per process, not collective (no rank waits on another). Not thread-safe:
// callers serialise (the CPU meter holds a lock).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

namespace xpm {

/// How the emulated allocator gets its memory from the device.
struct CachingAllocatorOptions {
  /// PyTorch's expandable_segments:True: one growing segment per pool instead of fixed ones.
  bool expandable_segments = false;
};

/// A live allocation of the emulation (what allocate() returns and free() takes).
using EmulatedBlockId = std::int64_t;

class CachingAllocatorEmulation {
 public:
  explicit CachingAllocatorEmulation(CachingAllocatorOptions options = {});
  ~CachingAllocatorEmulation();
  CachingAllocatorEmulation(const CachingAllocatorEmulation&) = delete;
  CachingAllocatorEmulation& operator=(const CachingAllocatorEmulation&) = delete;

  /// Allocates a block for `n_bytes` (> 0) with reserved bytes kept within `capacity_bytes`
  /// (0: no cap). Returns the block, or nothing when the reserve, even after releasing the
  /// cache, would pass the capacity (then only the released cache has changed, as on a GPU).
  /// Throws std::invalid_argument when n_bytes <= 0 or capacity_bytes < 0.
  std::optional<EmulatedBlockId> allocate(std::int64_t n_bytes, std::int64_t capacity_bytes);
  /// Frees a block of allocate() into the cache. Throws std::invalid_argument for a block that
  /// is not live.
  void free(EmulatedBlockId block);
  /// Releases every cached segment (or page, with expandable segments) that holds no block in
  /// use: torch.cuda.empty_cache().
  void empty_cache();

  /// The block size a request of `n_bytes` takes: at least 512, a multiple of 512.
  static std::int64_t block_bytes(std::int64_t n_bytes);
  /// The segment a request of `n_bytes` reserves when nothing cached fits (classic segments).
  static std::int64_t segment_bytes(std::int64_t n_bytes);

  /// Bytes of blocks in use (block sizes): CUDA's allocated_bytes.
  std::int64_t allocated_bytes() const;
  /// Bytes of segments (or mapped pages) held: CUDA's reserved_bytes.
  std::int64_t reserved_bytes() const;
  /// Peaks of the two since construction or the last reset_peak().
  std::int64_t peak_allocated_bytes() const;
  std::int64_t peak_reserved_bytes() const;
  /// Starts both peaks at the current values.
  void reset_peak();
  /// Out-of-memory answers since construction.
  std::int64_t oom_count() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace xpm
