// memory_plan.cpp — MemoryPlanOptions::batcher_options (see memory_plan.hpp).
#include "xpm/trainer/loop/memory_plan.hpp"

namespace xpm {

PredictiveBatcherOptions MemoryPlanOptions::batcher_options(const MemoryMeter& meter) const {
  PredictiveBatcherOptions options;
  options.formula = formula;
  options.formula_choice = formula_choice;
  options.variable_max = variable_max;
  options.design_fractions = design_fractions;
  options.aggregation = aggregation;
  options.batch_size_variable = batch_size_variable;
  options.budget = meter_budget(meter, memory_fraction, extra_overhead_bytes);
  options.fit.usable_max_rel_error = usable_max_rel_error;
  options.validate();
  return options;
}

}  // namespace xpm
