// xpm/trainer/loop/memory_plan.hpp — the memory plan a Learner builds for itself: the formula,
// the probe design's range, the packer and the tolerance; the budget comes from the meter's
// capacity (given once, to the meter).
//
//   xpm::LearnerOptions options;
//   options.memory_plan = xpm::MemoryPlanOptions(xpm::CostFormula::with_variables("a*bs*l + b*bs + c", {"bs", "l"}))
//                             .set_variable_max({{"bs", 64}, {"l", 256}})
//                             .set_design_fractions({1.0, 0.5, 0.25});
//
// The Learner then probes the task (TrainingTask::probe_loss_sum) on rank 0 before the first
// step, fits, and plans every outer batch with make_packer(packer, sort_by) (packer_kind.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "xpm/planner/packer_kind.hpp"
#include "xpm/planner/predictive_batcher.hpp"
#include "xpm/planner_torch/memory_meter.hpp"
#include "xpm/trainer/options/option_setters.hpp"

namespace xpm {

struct MemoryPlanOptions {
  MemoryPlanOptions() = default;
  explicit MemoryPlanOptions(CostFormula formula_) : formula(std::move(formula_)) {}

  // Defaults: the predictive batcher's (PredictiveBatcherOptions, FitOptions, MemoryBudget).
  CostFormula formula = PredictiveBatcherOptions{}.formula;
  FormulaChoice formula_choice = FormulaChoice::kGiven;  // kAutomatic: chosen over formula's variables
  std::map<std::string, double> variable_max;            // the probe design's upper ends (every variable)
  std::vector<double> design_fractions = PredictiveBatcherOptions{}.design_fractions;  // of each non-bs variable's max
  std::map<std::string, DimAggregation> aggregation;     // non-batch-size variables; default max
  std::string batch_size_variable = PredictiveBatcherOptions{}.batch_size_variable;
  PackerKind packer = PackerKind::kAdaptive;
  std::string sort_by;                     // the adaptive packer's sort variables ("": record order)
  double memory_fraction = MemoryBudget{}.memory_fraction;  // of the meter's capacity the plan may use
  std::int64_t extra_overhead_bytes = 0;   // held back from the budget (bytes)
  double usable_max_rel_error = FitOptions{}.usable_max_rel_error;  // the largest fit / held-out error of a usable model

  XPM_OPTION_SETTER(MemoryPlanOptions, CostFormula, formula)
  XPM_OPTION_SETTER(MemoryPlanOptions, FormulaChoice, formula_choice)
  XPM_OPTION_SETTER(MemoryPlanOptions, std::map<std::string XPM_COMMA double>, variable_max)
  XPM_OPTION_SETTER(MemoryPlanOptions, std::vector<double>, design_fractions)
  XPM_OPTION_SETTER(MemoryPlanOptions, std::map<std::string XPM_COMMA DimAggregation>, aggregation)
  XPM_OPTION_SETTER(MemoryPlanOptions, std::string, batch_size_variable)
  XPM_OPTION_SETTER(MemoryPlanOptions, PackerKind, packer)
  XPM_OPTION_SETTER(MemoryPlanOptions, std::string, sort_by)
  XPM_OPTION_SETTER(MemoryPlanOptions, double, memory_fraction)
  XPM_OPTION_SETTER(MemoryPlanOptions, std::int64_t, extra_overhead_bytes)
  XPM_OPTION_SETTER(MemoryPlanOptions, double, usable_max_rel_error)

  /// The predictive batcher's options under `meter`'s capacity. Throws std::invalid_argument
  /// when the meter has no capacity or an option is out of range (PredictiveBatcherOptions::validate).
  PredictiveBatcherOptions batcher_options(const MemoryMeter& meter) const;
  /// Throws std::invalid_argument for an option out of range, without a meter
  /// (PredictiveBatcherOptions::validate under any capacity; a sort_by for a packer that takes
  /// none). LearnerOptions::validate calls it.
  void validate() const;
};

}  // namespace xpm
