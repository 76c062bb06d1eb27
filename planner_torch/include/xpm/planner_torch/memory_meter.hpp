// xpm/planner_torch/memory_meter.hpp — the interface the probe runner and the trainer read
// memory through: CpuMemoryMeter on CPU, CudaMemoryMeter on a CUDA device.
//
//   meter.set_capacity_bytes(200'000'000);         // CPU: the cap the probes and steps run under
//   options.budget = xpm::meter_budget(meter);     // the plan's budget: the same capacity, 90 %
//
//   xpm::start_peak(meter);                        // a measured microbatch: cache emptied where it reserves
//   ...forward and backward...
//   std::int64_t peak = xpm::planned_peak_bytes(meter);  // what the budget bounds: reserved or allocated
//
// Reserved bytes: under a caching allocator (CUDA; CpuMemoryMeter with caching) the capacity
// bounds the bytes the allocator holds, blocks in use and cached ones (reserves_segments());
// plans then bound reserved bytes. A meter without one reports its allocated bytes as reserved.
#pragma once

#include <cstdint>

#include "xpm/planner/budget.hpp"

namespace xpm {

class MemoryMeter {
 public:
  virtual ~MemoryMeter() = default;
  /// Bytes of live tensor storages now.
  virtual std::int64_t current_allocated_bytes() const = 0;
  /// Maximum of current_allocated_bytes() since the last reset_peak().
  virtual std::int64_t peak_allocated_bytes() const = 0;
  /// Sets the peak to the current allocated bytes.
  virtual void reset_peak() = 0;
  /// Total memory of the device or the configured cap; 0 when unlimited.
  virtual std::int64_t capacity_bytes() const = 0;
  /// True when allocations go through a caching allocator whose reserved bytes the capacity
  /// bounds (the default: false).
  virtual bool reserves_segments() const { return false; }
  /// Bytes the allocator holds (allocated + cached); default current_allocated_bytes().
  virtual std::int64_t current_reserved_bytes() const { return current_allocated_bytes(); }
  /// Maximum of current_reserved_bytes() since the last reset_peak(); default peak_allocated_bytes().
  virtual std::int64_t peak_reserved_bytes() const { return peak_allocated_bytes(); }
  /// Releases cached blocks that hold nothing (default: nothing to release).
  virtual void empty_cache() {}
};

/// Starts a measured peak: where the meter reserves segments the cache is emptied first (cached
/// segments would be released before an out-of-memory error anyway), then reset_peak().
void start_peak(MemoryMeter& meter);
/// The peak since start_peak that plans bound: peak_reserved_bytes() where the meter reserves
/// segments, else peak_allocated_bytes().
std::int64_t planned_peak_bytes(const MemoryMeter& meter);

/// The budget of a plan under `meter`'s capacity (the capacity is given once, to the meter):
/// capacity_bytes = meter.capacity_bytes(), the given fraction and overhead. Throws
/// std::invalid_argument when the meter has no capacity (an uncapped CPU meter: call
/// CpuMemoryMeter::set_capacity_bytes first) or the budget is out of range (MemoryBudget::validate).
MemoryBudget meter_budget(const MemoryMeter& meter, double memory_fraction = 0.9,
                          std::int64_t extra_overhead_bytes = 0);

}  // namespace xpm
