// meter_budget: the plan's budget from the meter's capacity.
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

}  // namespace xpm
