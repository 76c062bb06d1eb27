// xpm/planner/budget.hpp — the memory budget a microbatch's predicted peak must fit under.
//
//   MemoryBudget b;
//   b.capacity_bytes = 80LL << 30;
//   b.memory_fraction = 0.9;
//   b.extra_overhead_bytes = 512LL << 20;
//   b.usable_bytes();  // 80 GiB * 0.9 - 512 MiB
//
// capacity_bytes is the device's total memory (CUDA) or a configured cap (CPU), never the
// currently free memory: free memory double-counts resident weights and shrinks as the caching
// allocator reserves (docs/design.md section 3).
#pragma once

#include <cstdint>

namespace xpm {

struct MemoryBudget {
  std::int64_t capacity_bytes = 0;        // total device memory or configured cap, > 0
  double memory_fraction = 0.9;           // share of capacity the plan may use, in (0, 1]
  std::int64_t extra_overhead_bytes = 0;  // reserved for what probes don't see, >= 0

  /// Throws std::invalid_argument naming the field and its value when out of range, or when
  /// the usable bytes would be <= 0.
  void validate() const;
  /// capacity_bytes * memory_fraction - extra_overhead_bytes (floor). Calls validate().
  std::int64_t usable_bytes() const;
};

}  // namespace xpm
