// memory_plan.cpp — MemoryPlanOptions::batcher_options and validate (see memory_plan.hpp).
#include "xpm/trainer/loop/memory_plan.hpp"

#include <cstdint>
#include <limits>
#include <stdexcept>

namespace xpm {
namespace {

PredictiveBatcherOptions batcher_options_under(const MemoryPlanOptions& plan, const MemoryBudget& budget) {
  PredictiveBatcherOptions options;
  options.formula = plan.formula;
  options.formula_choice = plan.formula_choice;
  options.variable_max = plan.variable_max;
  options.design_fractions = plan.design_fractions;
  options.aggregation = plan.aggregation;
  options.batch_size_variable = plan.batch_size_variable;
  options.budget = budget;
  options.fit.usable_max_rel_error = plan.usable_max_rel_error;
  options.validate();
  return options;
}

}  // namespace

PredictiveBatcherOptions MemoryPlanOptions::batcher_options(const MemoryMeter& meter) const {
  return batcher_options_under(*this, meter_budget(meter, memory_fraction, extra_overhead_bytes));
}

void MemoryPlanOptions::validate() const {
  MemoryBudget any_capacity;  // the meter's is known only in batcher_options
  any_capacity.capacity_bytes = std::numeric_limits<std::int64_t>::max() / 2;
  any_capacity.memory_fraction = memory_fraction;
  any_capacity.extra_overhead_bytes = extra_overhead_bytes;
  batcher_options_under(*this, any_capacity);
  if (!sort_by.empty() && !packer_takes_sort_by(packer)) {
    throw std::invalid_argument("MemoryPlanOptions.sort_by '" + sort_by + "' applies to the adaptive packer only, not '" +
                                to_string(packer) + "'");
  }
}

}  // namespace xpm
