// plan_quality.cpp — see plan_quality.hpp.
#include "plan_quality.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace xpm_bench {

std::size_t plan_lower_bound(const std::vector<std::vector<double>>& records,
                             const xpm::MemoryModel& model, std::int64_t usable_bytes) {
  const xpm::CostFormula& formula = model.formula();
  const auto& coefficients = model.coefficients();
  const std::size_t bs = model.batch_size_index();
  std::vector<double> dims(formula.variable_names().size(), 0.0);
  const double c = formula.predict(coefficients, dims);  // no record at all
  double volume = 0;
  for (const auto& r : records) {
    dims = r;
    dims[bs] = 1;
    volume += formula.predict(coefficients, dims) - c;
  }
  return static_cast<std::size_t>(std::ceil(volume / (static_cast<double>(usable_bytes) - c)));
}

PlanQuality plan_quality(const xpm::MicrobatchPlan& plan,
                         const std::vector<std::vector<double>>& records,
                         const xpm::MemoryModel& model, std::int64_t usable_bytes) {
  PlanQuality q;
  q.microbatches = plan.microbatches.size();
  q.lower_bound = plan_lower_bound(records, model, usable_bytes);
  std::vector<int> seen(records.size(), 0);
  const auto budget = static_cast<double>(usable_bytes);
  const std::size_t bs = model.batch_size_index();
  const std::size_t length = bs == 0 ? 1 : 0;  // the other dim of the {bs, length} formulas
  const bool padded = model.aggregation()[length] == xpm::DimAggregation::kMax;
  double real_tokens = 0, padded_tokens = 0, utilization_sum = 0;
  q.utilization_min = std::numeric_limits<double>::infinity();
  for (const xpm::Microbatch& mb : plan.microbatches) {
    for (std::size_t i : mb.record_indices) {
      if (i >= records.size() || seen[i]++ != 0) {
        throw std::logic_error("plan_quality: record " + std::to_string(i) +
                               " is out of range or in two microbatches");
      }
      real_tokens += records[i][length];
    }
    const std::vector<double> dims = xpm::aggregate_dims(records, mb.record_indices, model);
    const double predicted = model.predict_bytes(dims);
    if (predicted > budget) ++q.over_budget;
    utilization_sum += predicted / budget;
    q.utilization_min = std::min(q.utilization_min, predicted / budget);
    padded_tokens += dims[bs] * dims[length];
  }
  if (std::count(seen.begin(), seen.end(), 1) != static_cast<std::ptrdiff_t>(records.size())) {
    throw std::logic_error("plan_quality: the plan misses records");
  }
  if (q.microbatches > 0) {
    q.utilization_mean = utilization_sum / static_cast<double>(q.microbatches);
    q.mean_records = static_cast<double>(records.size()) / static_cast<double>(q.microbatches);
  } else {
    q.utilization_min = 0;
  }
  q.padding_waste = padded && real_tokens > 0 ? (padded_tokens - real_tokens) / real_tokens : 0.0;
  return q;
}

}  // namespace xpm_bench
