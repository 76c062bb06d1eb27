// ffd_packer.cpp — FirstFitDecreasingPacker (see ffd_packer.hpp).
#include "xpm/planner/ffd_packer.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include "packer_internal.hpp"

namespace xpm {
namespace {

// `out` = the dims of a microbatch with dims `dims` (count records) and `record` added.
void add_record_dims(const std::vector<DimAggregation>& aggregation, const std::vector<double>& dims,
                     std::size_t count, const double* record, std::vector<double>& out) {
  for (std::size_t v = 0; v < aggregation.size(); ++v) {
    switch (aggregation[v]) {
      case DimAggregation::kCount: out[v] = static_cast<double>(count + 1); break;
      case DimAggregation::kMax: out[v] = count == 0 ? record[v] : std::max(dims[v], record[v]); break;
      case DimAggregation::kSum: out[v] = (count == 0 ? 0.0 : dims[v]) + record[v]; break;
    }
  }
}

}  // namespace

MicrobatchPlan FirstFitDecreasingPacker::pack(const std::vector<std::vector<double>>& record_dims,
                                              const MemoryModel& model,
                                              std::int64_t usable_bytes) const {
  packer_internal::validate_pack_inputs(record_dims, model, usable_bytes);
  const std::size_t n = record_dims.size();
  const std::size_t nv = model.formula().variable_names().size();
  const std::size_t bs = model.batch_size_index();
  const auto& aggregation = model.aggregation();
  const packer_internal::FitTest fits(model, static_cast<double>(usable_bytes));

  // Heaviest first: the formula's prediction for the record alone (batch size 1).
  std::vector<double> keys(n);
  std::vector<double> alone(nv);
  for (std::size_t i = 0; i < n; ++i) {
    alone = record_dims[i];
    alone[bs] = 1;
    keys[i] = model.formula().predict(model.coefficients(), alone);
  }
  const std::vector<std::size_t> order = packer_internal::descending_order(keys);
  const std::vector<double> ordered_dims = packer_internal::gather_in_order(record_dims, order, nv);

  // rest_min[k * nv + v]: the minimum of dim v over the records order[k..n-1] (the batch-size
  // entry is unused): a record no heavier in any dim than every one still to place.
  std::vector<double> rest_min((n + 1) * nv, std::numeric_limits<double>::infinity());
  for (std::size_t k = n; k-- > 0;) {
    for (std::size_t v = 0; v < nv; ++v) {
      rest_min[k * nv + v] = std::min(rest_min[(k + 1) * nv + v], ordered_dims[k * nv + v]);
    }
  }

  constexpr std::size_t kClosed = std::numeric_limits<std::size_t>::max();
  MicrobatchPlan plan;
  std::vector<std::size_t> open;  // microbatches that may still take a record, in opening order
  std::vector<double> trial(nv);
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = order[k];
    const double* record = &ordered_dims[k * nv];
    bool placed = false;
    bool closed_any = false;
    for (std::size_t& candidate : open) {
      Microbatch& mb = plan.microbatches[candidate];
      const std::size_t count = mb.record_indices.size();
      add_record_dims(aggregation, mb.dims, count, record, trial);
      if (fits(trial)) {
        mb.dims = trial;
        mb.record_indices.push_back(i);
        placed = true;
        break;
      }
      // Not even the lightest record still to place fits: close it for good.
      add_record_dims(aggregation, mb.dims, count, &rest_min[k * nv], trial);
      if (!fits(trial)) {
        candidate = kClosed;
        closed_any = true;
      }
    }
    if (closed_any) open.erase(std::remove(open.begin(), open.end(), kClosed), open.end());
    if (placed) continue;
    Microbatch mb;
    mb.record_indices.push_back(i);
    mb.dims.assign(nv, 0.0);
    add_record_dims(aggregation, mb.dims, 0, record, mb.dims);
    if (fits(mb.dims)) {
      open.push_back(plan.microbatches.size());
    } else {  // does not fit even alone: its own microbatch, reported
      mb.over_budget = true;
      plan.over_budget_records.push_back(i);
    }
    plan.microbatches.push_back(std::move(mb));
  }
  for (Microbatch& mb : plan.microbatches) mb.predicted_bytes = model.predict_bytes(mb.dims);
  return plan;
}

}  // namespace xpm
