// plan_quality.hpp — how good a microbatch plan is, measured independently of the packer that
// made it: dims re-aggregated from the records and predictions recomputed from the model.
//
//   PlanQuality q = plan_quality(plan, records, model, usable_bytes);
//   q.microbatches / q.lower_bound;   // 1.0 would be perfect
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xpm/planner/packer.hpp"

namespace xpm_bench {

struct PlanQuality {
  std::size_t microbatches = 0;
  std::size_t lower_bound = 0;        // volume bound, see plan_lower_bound()
  double utilization_mean = 0;        // mean over microbatches of predicted bytes / usable
  double utilization_min = 0;         // smallest of the same
  double padding_waste = 0;           // (sum of bs x longest - real tokens) / real tokens;
                                      // 0 for a formula whose length dim is summed (packed)
  std::size_t over_budget = 0;        // microbatches predicted above the budget
  double mean_records = 0;            // records per microbatch
};

/// Volume lower bound on the microbatch count of any plan: every microbatch pays the record-free
/// cost c = formula(all dims 0) once and at least g_i = formula(bs 1, record i's dims) - c for
/// each record i (for c + bs x g(longest) with g nondecreasing, and exactly for summed dims), so
/// a plan needs at least ceil(sum_i g_i / (usable - c)) microbatches. Valid for the formulas of
/// packer_inputs.hpp.
std::size_t plan_lower_bound(const std::vector<std::vector<double>>& records,
                             const xpm::MemoryModel& model, std::int64_t usable_bytes);

/// Measures `plan`. Throws std::logic_error when the plan does not hold every record exactly
/// once (a broken packer must not be timed as if it worked).
PlanQuality plan_quality(const xpm::MicrobatchPlan& plan,
                         const std::vector<std::vector<double>>& records,
                         const xpm::MemoryModel& model, std::int64_t usable_bytes);

}  // namespace xpm_bench
