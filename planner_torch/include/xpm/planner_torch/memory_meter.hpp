// xpm/planner_torch/memory_meter.hpp — the interface the probe runner and the trainer read
// memory through: CpuMemoryMeter on CPU, CudaMemoryMeter on a CUDA device.
//
//   meter.set_capacity_bytes(200'000'000);         // CPU: the cap the probes and steps run under
//   options.budget = xpm::meter_budget(meter);     // the plan's budget: the same capacity, 90 %
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
};

/// The budget of a plan under `meter`'s capacity (the capacity is given once, to the meter):
/// capacity_bytes = meter.capacity_bytes(), the given fraction and overhead. Throws
/// std::invalid_argument when the meter has no capacity (an uncapped CPU meter: call
/// CpuMemoryMeter::set_capacity_bytes first) or the budget is out of range (MemoryBudget::validate).
MemoryBudget meter_budget(const MemoryMeter& meter, double memory_fraction = 0.9,
                          std::int64_t extra_overhead_bytes = 0);

}  // namespace xpm
