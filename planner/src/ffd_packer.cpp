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

// Per microbatch (in opening order) a threshold: records whose key (predicted cost alone) is at
// or above it are not tried there (a record that heavy did not fit); -infinity: closed. A
// max-tree over the microbatches finds the first one a record may fit in O(log m).
class MicrobatchThresholds {
 public:
  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

  void push(double threshold) {
    if (size_ == leaves_) grow();
    set(size_++, threshold);
  }
  void set(std::size_t m, double threshold) {
    std::size_t node = leaves_ + m;
    tree_[node] = threshold;
    for (node /= 2; node >= 1; node /= 2) tree_[node] = std::max(tree_[2 * node], tree_[2 * node + 1]);
  }
  // The first microbatch m >= from whose threshold is above key; kNone when none. Climbs from
  // leaf `from` to the first subtree on its right holding such a threshold, then descends.
  std::size_t first_above(double key, std::size_t from) const {
    if (from >= size_) return kNone;
    std::size_t node = leaves_ + from;
    if (tree_[node] > key) return from;
    while (true) {
      if (node == 1) return kNone;
      if ((node & 1) == 0 && tree_[node + 1] > key) break;  // a left child: its right sibling
      node /= 2;
    }
    ++node;
    while (node < leaves_) node = tree_[2 * node] > key ? 2 * node : 2 * node + 1;
    return node - leaves_;  // < size_: leaves past it hold -infinity
  }

 private:
  void grow() {
    const std::size_t leaves = leaves_ == 0 ? 64 : 2 * leaves_;
    std::vector<double> tree(2 * leaves, -std::numeric_limits<double>::infinity());
    for (std::size_t m = 0; m < size_; ++m) tree[leaves + m] = tree_[leaves_ + m];
    for (std::size_t node = leaves - 1; node >= 1; --node) tree[node] = std::max(tree[2 * node], tree[2 * node + 1]);
    tree_.swap(tree);
    leaves_ = leaves;
  }

  std::vector<double> tree_;  // 1-based heap layout; leaves at [leaves_, 2 leaves_)
  std::size_t leaves_ = 0;
  std::size_t size_ = 0;
};

}  // namespace

MicrobatchPlan FirstFitDecreasingPacker::pack(RecordDimsView record_dims, const MemoryModel& model,
                                              std::int64_t usable_bytes) const {
  packer_internal::validate_pack_inputs(record_dims, model, usable_bytes);
  const std::size_t nv = record_dims.variables;
  const std::size_t n = record_dims.records;
  const std::size_t bs = model.batch_size_index();
  const auto& aggregation = model.aggregation();
  const packer_internal::FitTest fits(model, static_cast<double>(usable_bytes));

  // Heaviest first: the formula's prediction for the record alone (batch size 1).
  std::vector<double> keys(n);
  std::vector<double> alone(nv);
  for (std::size_t i = 0; i < n; ++i) {
    std::copy(record_dims.row(i), record_dims.row(i) + nv, alone.begin());
    alone[bs] = 1;
    keys[i] = model.formula().predict(model.coefficients(), alone);
  }
  const std::vector<std::size_t> order = packer_internal::descending_order(keys);
  const std::vector<double> ordered_dims = packer_internal::permute_rows(record_dims.data, order, nv);
  const std::vector<double> ordered_keys = packer_internal::permute_rows(keys.data(), order, 1);

  // rest_min[k * nv + v]: the minimum of dim v over the records order[k..n-1] (the batch-size
  // entry is unused): a record no heavier in any dim than every one still to place.
  std::vector<double> rest_min((n + 1) * nv, std::numeric_limits<double>::infinity());
  for (std::size_t k = n; k-- > 0;) {
    for (std::size_t v = 0; v < nv; ++v) {
      rest_min[k * nv + v] = std::min(rest_min[(k + 1) * nv + v], ordered_dims[k * nv + v]);
    }
  }

  // Which microbatches to try, found in O(log m) instead of by trying every open one.
  MicrobatchThresholds thresholds;
  MicrobatchPlan plan;
  std::vector<double> trial(nv);
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = order[k];
    const double key = ordered_keys[k];
    const double* record = &ordered_dims[k * nv];
    bool placed = false;
    for (std::size_t m = thresholds.first_above(key, 0); m != MicrobatchThresholds::kNone;
         m = thresholds.first_above(key, m + 1)) {
      Microbatch& mb = plan.microbatches[m];
      const std::size_t count = mb.record_indices.size();
      add_record_dims(aggregation, mb.dims, count, record, trial);
      if (fits(trial)) {
        mb.dims = trial;
        mb.record_indices.push_back(i);
        placed = true;
        break;
      }
      // Not even the lightest record still to place fits: closed for good. Otherwise not tried
      // again for records as heavy as this one.
      add_record_dims(aggregation, mb.dims, count, &rest_min[k * nv], trial);
      thresholds.set(m, fits(trial) ? key : -std::numeric_limits<double>::infinity());
    }
    if (placed) continue;
    Microbatch mb;
    mb.record_indices.push_back(i);
    mb.dims.assign(nv, 0.0);
    add_record_dims(aggregation, mb.dims, 0, record, mb.dims);
    if (fits(mb.dims)) {
      thresholds.push(std::numeric_limits<double>::infinity());
    } else {  // does not fit even alone: its own microbatch, reported
      mb.over_budget = true;
      plan.over_budget_records.push_back(i);
      thresholds.push(-std::numeric_limits<double>::infinity());
    }
    plan.microbatches.push_back(std::move(mb));
  }
  for (Microbatch& mb : plan.microbatches) mb.predicted_bytes = model.predict_bytes(mb.dims);
  return plan;
}

}  // namespace xpm
