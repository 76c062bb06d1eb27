// fastest_packer.cpp — consecutive runs of sorted records of the least predicted time
// (fastest_packer.hpp).
#include "xpm/planner/fastest_packer.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "packer_internal.hpp"
#include "xpm/planner/time_model.hpp"

namespace xpm {
namespace {

// The records' order: by `sort_by` (or the first max-aggregated variable) descending, ties by
// index; record order when there is no such variable.
std::vector<std::size_t> visiting_order(RecordDimsView view, const MemoryModel& model, const std::string& sort_by) {
  const std::vector<std::string>& names = model.formula().variable_names();
  std::optional<std::size_t> key;
  if (!sort_by.empty()) {
    key = model.formula().variable_index(sort_by);
  } else {
    for (std::size_t v = 0; v < names.size() && !key; ++v) {
      if (model.aggregation()[v] == DimAggregation::kMax) key = v;
    }
  }
  if (!key) {
    std::vector<std::size_t> order(view.records);
    std::iota(order.begin(), order.end(), std::size_t{0});
    return order;
  }
  std::vector<double> keys(view.records);
  for (std::size_t i = 0; i < view.records; ++i) keys[i] = view.row(i)[*key];
  return packer_internal::descending_order(keys);
}

// Dims of a run grown one record at a time: the count, maxima and sums of model's aggregation.
class RunDims {
 public:
  explicit RunDims(const MemoryModel& model) : aggregation_(model.aggregation()), dims_(aggregation_.size(), 0.0) {}
  void add(const double* record) {
    for (std::size_t v = 0; v < dims_.size(); ++v) {
      switch (aggregation_[v]) {
        case DimAggregation::kCount: dims_[v] += 1; break;
        case DimAggregation::kMax: dims_[v] = std::max(dims_[v], record[v]); break;
        case DimAggregation::kSum: dims_[v] += record[v]; break;
      }
    }
  }
  const std::vector<double>& dims() const { return dims_; }

 private:
  const std::vector<DimAggregation>& aggregation_;
  std::vector<double> dims_;
};

}  // namespace

FastestPacker::FastestPacker(std::string sort_by) : sort_by_(std::move(sort_by)) {
  if (sort_by_.find(',') != std::string::npos) {
    throw std::invalid_argument("FastestPacker sorts by one variable, got sort_by '" + sort_by_ + "'");
  }
}

MicrobatchPlan FastestPacker::pack(RecordDimsView record_dims, const MemoryModel& model,
                                   std::int64_t usable_bytes) const {
  packer_internal::validate_pack_inputs(record_dims, model, usable_bytes);
  const std::optional<TimeModel> time = TimeModel::from_metadata(model);
  if (!time) {
    throw std::invalid_argument("the fastest packer needs a memory model with a time model (metadata.time_model), "
                                "which probing fits from the probes' forward and backward times; this model has "
                                "none (fitted to given measurements, or probed before time models existed)");
  }
  const std::size_t n = record_dims.records;
  const std::vector<std::size_t> order = visiting_order(record_dims, model, sort_by_);
  const packer_internal::FitTest fits(model, static_cast<double>(usable_bytes));
  // cost[j]: the least seconds of the first j sorted records; start[j]: where its last run starts.
  std::vector<double> cost(n + 1, std::numeric_limits<double>::infinity());
  std::vector<std::size_t> start(n + 1, 0);
  cost[0] = 0;
  for (std::size_t i = 0; i < n; ++i) {
    RunDims run(model);
    for (std::size_t j = i + 1; j <= n; ++j) {
      run.add(record_dims.row(order[j - 1]));
      const bool fit = fits(run.dims());
      if (!fit && j > i + 1) break;  // a longer run does not fit either (a monotone model)
      const double seconds = cost[i] + time->seconds(model, run.dims());
      if (seconds < cost[j]) {
        cost[j] = seconds;
        start[j] = i;
      }
      if (!fit) break;  // a record over budget alone: a microbatch of its own
    }
  }
  MicrobatchPlan plan;
  for (std::size_t j = n; j > 0; j = start[j]) {
    Microbatch mb;
    RunDims run(model);
    for (std::size_t k = start[j]; k < j; ++k) {
      mb.record_indices.push_back(order[k]);
      run.add(record_dims.row(order[k]));
    }
    mb.dims = run.dims();
    mb.predicted_bytes = model.predict_bytes(mb.dims);
    mb.over_budget = !fits(mb.dims);
    if (mb.over_budget) plan.over_budget_records.push_back(order[start[j]]);
    plan.microbatches.push_back(std::move(mb));
  }
  std::reverse(plan.microbatches.begin(), plan.microbatches.end());
  std::reverse(plan.over_budget_records.begin(), plan.over_budget_records.end());
  return plan;
}

}  // namespace xpm
