// meter_budget: the plan's budget from the meter's capacity; the peaks that plans bound.
#include "xpm/planner_torch/memory_meter.hpp"

#include <stdexcept>
#include <string>

namespace xpm {

MemoryBudget meter_budget(const MemoryMeter& meter, double memory_fraction, std::int64_t extra_overhead_bytes) {
  MemoryBudget budget;
  budget.capacity_bytes = meter.capacity_bytes();
  if (budget.capacity_bytes <= 0) {
    throw std::invalid_argument("meter_budget: the memory meter has no capacity (" +
                                std::to_string(budget.capacity_bytes) +
                                " bytes); cap it first (CpuMemoryMeter::set_capacity_bytes)");
  }
  budget.memory_fraction = memory_fraction;
  budget.extra_overhead_bytes = extra_overhead_bytes;
  budget.validate();
  return budget;
}

void start_peak(MemoryMeter& meter) {
  if (meter.reserves_segments()) meter.empty_cache();
  meter.reset_peak();
}

std::int64_t planned_peak_bytes(const MemoryMeter& meter) {
  return meter.reserves_segments() ? meter.peak_reserved_bytes() : meter.peak_allocated_bytes();
}

}  // namespace xpm
