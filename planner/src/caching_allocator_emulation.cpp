#include "xpm/planner/caching_allocator_emulation.hpp"

#include <algorithm>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace xpm {
namespace {

constexpr std::int64_t kMinBlockBytes = 512;            // rounding of every request
constexpr std::int64_t kSmallBytes = 1 << 20;           // largest request of the small pool
constexpr std::int64_t kSmallSegmentBytes = 2 << 20;    // a small-pool segment (and page)
constexpr std::int64_t kLargeSegmentBytes = 20 << 20;   // a large-pool segment under 10 MiB (and page)
constexpr std::int64_t kMinLargeAllocBytes = 10 << 20;  // from here a request's own segment
constexpr std::int64_t kRoundLargeBytes = 2 << 20;      // ... rounded up to 2 MiB
// The address space an expandable segment reserves (never all mapped).
constexpr std::int64_t kExpandableVirtualBytes = std::int64_t{1} << 46;

std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

struct Block {
  std::int64_t address = 0;
  std::int64_t size = 0;
  std::int64_t segment_address = 0;  // where its segment starts: pages are counted from there
  int pool = 0;                      // 0: the small pool, 1: the large one
  bool allocated = false;
  bool mapped = true;
  Block* prev = nullptr;  // neighbours within the segment
  Block* next = nullptr;
};

struct BySizeThenAddress {
  bool operator()(const Block* a, const Block* b) const {
    return a->size != b->size ? a->size < b->size : a->address < b->address;
  }
};

struct ByAddress {
  bool operator()(const Block* a, const Block* b) const { return a->address < b->address; }
};

struct Pool {
  bool small = false;
  std::set<Block*, BySizeThenAddress> free_blocks;  // cached, mapped, not in use
  std::set<Block*, ByAddress> unmapped;             // address space of expandable segments
  std::int64_t page_bytes() const { return small ? kSmallSegmentBytes : kLargeSegmentBytes; }
};

}  // namespace

struct CachingAllocatorEmulation::State {
  CachingAllocatorOptions options;
  Pool pools[2];
  std::unordered_set<Block*> blocks;  // every block, owned
  std::unordered_map<EmulatedBlockId, Block*> live;
  EmulatedBlockId next_id = 1;
  std::int64_t next_address = kLargeSegmentBytes;
  std::int64_t allocated = 0, reserved = 0, peak_allocated = 0, peak_reserved = 0, ooms = 0;

  ~State() {
    for (Block* block : blocks) delete block;
  }

  Pool& pool_for(std::int64_t size) { return pools[size <= kSmallBytes ? 0 : 1]; }

  Block* make_block(std::int64_t address, std::int64_t size, std::int64_t segment_address, const Pool& pool,
                    bool mapped) {
    auto* block = new Block{address, size, segment_address, pool.small ? 0 : 1, false, mapped, nullptr, nullptr};
    blocks.insert(block);
    return block;
  }

  void destroy(Block* block) {
    blocks.erase(block);
    delete block;
  }

  void add_reserved(std::int64_t bytes) {
    reserved += bytes;
    peak_reserved = std::max(peak_reserved, reserved);
  }

  /// Splits `tail_bytes` off the end of `block` into a new block after it (same mapping).
  Block* split_tail(Block* block, std::int64_t tail_bytes) {
    Block* tail = make_block(block->address + block->size - tail_bytes, tail_bytes, block->segment_address,
                             pools[block->pool], block->mapped);
    block->size -= tail_bytes;
    tail->prev = block;
    tail->next = block->next;
    if (block->next != nullptr) block->next->prev = tail;
    block->next = tail;
    return tail;
  }

  /// Moves a free neighbour `other` of `block` (same mapping) into `block`, which survives.
  void absorb(Block* block, Block* other, Pool& pool) {
    if (other == nullptr || other->allocated || other->mapped != block->mapped) return;
    if (other->mapped) {
      pool.free_blocks.erase(other);
    } else {
      pool.unmapped.erase(other);
    }
    if (other == block->prev) {
      block->address = other->address;
      block->prev = other->prev;
      if (block->prev != nullptr) block->prev->next = block;
    } else {
      block->next = other->next;
      if (block->next != nullptr) block->next->prev = block;
    }
    block->size += other->size;
    destroy(other);
  }

  Block* best_fit(Pool& pool, std::int64_t size) {
    Block key;
    key.address = std::numeric_limits<std::int64_t>::min();
    key.size = size;
    const auto it = pool.free_blocks.lower_bound(&key);
    if (it == pool.free_blocks.end()) return nullptr;
    Block* block = *it;
    pool.free_blocks.erase(it);
    return block;
  }

  bool fits(std::int64_t bytes, std::int64_t capacity_bytes) const {
    return capacity_bytes == 0 || reserved + bytes <= capacity_bytes;
  }

  Block* new_segment(Pool& pool, std::int64_t size, std::int64_t capacity_bytes) {
    const std::int64_t bytes = pool.small ? kSmallSegmentBytes : segment_bytes(size);
    if (!fits(bytes, capacity_bytes)) return nullptr;
    Block* block = make_block(next_address, bytes, next_address, pool, true);
    next_address = round_up(next_address + bytes, kLargeSegmentBytes) + kLargeSegmentBytes;
    add_reserved(bytes);
    return block;
  }

  /// Maps the first `size` bytes (whole pages) of the unmapped `block`; false over the capacity.
  bool map(Pool& pool, Block* block, std::int64_t size, std::int64_t capacity_bytes) {
    const std::int64_t bytes = std::min(round_up(size, pool.page_bytes()), block->size);
    if (!fits(bytes, capacity_bytes)) return false;
    pool.unmapped.erase(block);
    if (bytes < block->size) pool.unmapped.insert(split_tail(block, block->size - bytes));
    block->mapped = true;
    absorb(block, block->prev, pool);
    absorb(block, block->next, pool);
    pool.free_blocks.insert(block);
    add_reserved(bytes);
    return true;
  }

  /// The lowest-address run of free and unmapped blocks that holds `size` (a new expandable
  /// segment when none does); its first block.
  Block* find_expandable(Pool& pool, std::int64_t size) {
    for (Block* candidate : pool.unmapped) {
      if (candidate->prev != nullptr && !candidate->prev->allocated) candidate = candidate->prev;
      std::int64_t bytes = 0;
      for (Block* run = candidate; run != nullptr && !run->allocated && bytes < size; run = run->next) {
        bytes += run->size;
      }
      if (bytes >= size) return candidate;
    }
    Block* segment = make_block(next_address, kExpandableVirtualBytes, next_address, pool, false);
    next_address += kExpandableVirtualBytes + kLargeSegmentBytes;
    pool.unmapped.insert(segment);
    return segment;
  }

  Block* grow_expandable(Pool& pool, std::int64_t size, std::int64_t capacity_bytes) {
    Block* candidate = find_expandable(pool, size);
    if (!candidate->mapped && !map(pool, candidate, std::min(candidate->size, size), capacity_bytes)) return nullptr;
    while (candidate->size < size) {
      Block* next = candidate->next;  // unmapped: mapping it merges the candidate into it
      if (!map(pool, next, std::min(size - candidate->size, next->size), capacity_bytes)) return nullptr;
      candidate = next;
    }
    pool.free_blocks.erase(candidate);
    return candidate;
  }

  Block* reserve(Pool& pool, std::int64_t size, std::int64_t capacity_bytes) {
    return options.expandable_segments ? grow_expandable(pool, size, capacity_bytes)
                                       : new_segment(pool, size, capacity_bytes);
  }

  bool splits(const Pool& pool, std::int64_t remaining) const {
    return pool.small || options.expandable_segments ? remaining >= kMinBlockBytes : remaining > kSmallBytes;
  }

  /// Unmaps the whole pages inside the free `block` of an expandable segment.
  void unmap_pages(Pool& pool, Block* block) {
    const std::int64_t page = pool.page_bytes(), base = block->segment_address;
    const std::int64_t low = base + round_up(block->address - base, page);
    const std::int64_t high = base + (block->address + block->size - base) / page * page;
    if (high <= low) return;
    pool.free_blocks.erase(block);
    if (block->address + block->size > high) pool.free_blocks.insert(split_tail(block, block->address + block->size - high));
    Block* pages = block;
    if (low > block->address) {
      pages = split_tail(block, high - low);
      pool.free_blocks.insert(block);
    }
    pages->mapped = false;
    reserved -= high - low;
    absorb(pages, pages->prev, pool);
    absorb(pages, pages->next, pool);
    pool.unmapped.insert(pages);
  }

  void release_cache() {
    for (Pool& pool : pools) {
      const std::vector<Block*> cached(pool.free_blocks.begin(), pool.free_blocks.end());
      for (Block* block : cached) {
        if (options.expandable_segments) {
          unmap_pages(pool, block);
        } else if (block->prev == nullptr && block->next == nullptr) {
          pool.free_blocks.erase(block);
          reserved -= block->size;
          destroy(block);
        }
      }
    }
  }
};

CachingAllocatorEmulation::CachingAllocatorEmulation(CachingAllocatorOptions options)
    : state_(std::make_unique<State>()) {
  state_->options = options;
  state_->pools[0].small = true;
}

CachingAllocatorEmulation::~CachingAllocatorEmulation() = default;

std::int64_t CachingAllocatorEmulation::block_bytes(std::int64_t n_bytes) {
  return n_bytes < kMinBlockBytes ? kMinBlockBytes : round_up(n_bytes, kMinBlockBytes);
}

std::int64_t CachingAllocatorEmulation::segment_bytes(std::int64_t n_bytes) {
  const std::int64_t size = block_bytes(n_bytes);
  if (size <= kSmallBytes) return kSmallSegmentBytes;
  if (size < kMinLargeAllocBytes) return kLargeSegmentBytes;
  return round_up(size, kRoundLargeBytes);
}

std::optional<EmulatedBlockId> CachingAllocatorEmulation::allocate(std::int64_t n_bytes,
                                                                   std::int64_t capacity_bytes) {
  if (n_bytes <= 0) {
    throw std::invalid_argument("CachingAllocatorEmulation::allocate: n_bytes must be > 0, got " +
                                std::to_string(n_bytes));
  }
  if (capacity_bytes < 0) {
    throw std::invalid_argument("CachingAllocatorEmulation::allocate: capacity_bytes must be >= 0, got " +
                                std::to_string(capacity_bytes));
  }
  State& s = *state_;
  const std::int64_t size = block_bytes(n_bytes);
  Pool& pool = s.pool_for(size);
  Block* block = s.best_fit(pool, size);
  if (block == nullptr) block = s.reserve(pool, size, capacity_bytes);
  if (block == nullptr) {
    s.release_cache();
    block = s.reserve(pool, size, capacity_bytes);
  }
  if (block == nullptr) {
    ++s.ooms;
    return std::nullopt;
  }
  if (s.splits(pool, block->size - size)) pool.free_blocks.insert(s.split_tail(block, block->size - size));
  block->allocated = true;
  s.allocated += block->size;
  s.peak_allocated = std::max(s.peak_allocated, s.allocated);
  const EmulatedBlockId id = s.next_id++;
  s.live.emplace(id, block);
  return id;
}

void CachingAllocatorEmulation::free(EmulatedBlockId id) {
  State& s = *state_;
  const auto it = s.live.find(id);
  if (it == s.live.end()) {
    throw std::invalid_argument("CachingAllocatorEmulation::free: block " + std::to_string(id) + " is not live");
  }
  Block* block = it->second;
  s.live.erase(it);
  block->allocated = false;
  s.allocated -= block->size;
  Pool& pool = s.pools[block->pool];
  s.absorb(block, block->prev, pool);
  s.absorb(block, block->next, pool);
  pool.free_blocks.insert(block);
}

void CachingAllocatorEmulation::empty_cache() { state_->release_cache(); }

std::int64_t CachingAllocatorEmulation::allocated_bytes() const { return state_->allocated; }
std::int64_t CachingAllocatorEmulation::reserved_bytes() const { return state_->reserved; }
std::int64_t CachingAllocatorEmulation::peak_allocated_bytes() const { return state_->peak_allocated; }
std::int64_t CachingAllocatorEmulation::peak_reserved_bytes() const { return state_->peak_reserved; }
std::int64_t CachingAllocatorEmulation::oom_count() const { return state_->ooms; }

void CachingAllocatorEmulation::reset_peak() {
  state_->peak_allocated = state_->allocated;
  state_->peak_reserved = state_->reserved;
}

}  // namespace xpm
