#include "xpm/planner/rank_assignment.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>

namespace xpm {

double RankAssignment::imbalance() const {
  if (cost_per_rank.empty()) return 1.0;
  const double total = std::accumulate(cost_per_rank.begin(), cost_per_rank.end(), 0.0);
  if (total <= 0) return 1.0;
  const double mean = total / static_cast<double>(cost_per_rank.size());
  return *std::max_element(cost_per_rank.begin(), cost_per_rank.end()) / mean;
}

RankAssignment assign_records_to_ranks(const std::vector<double>& costs, int world_size) {
  if (world_size < 1) {
    throw std::invalid_argument("assign_records_to_ranks: world_size must be >= 1, got " +
                                std::to_string(world_size));
  }
  for (std::size_t i = 0; i < costs.size(); ++i) {
    if (!std::isfinite(costs[i]) || costs[i] < 0) {
      throw std::invalid_argument("assign_records_to_ranks: record " + std::to_string(i) +
                                  " has cost " + std::to_string(costs[i]) +
                                  "; costs must be finite and >= 0");
    }
  }
  std::vector<std::size_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t x, std::size_t y) { return costs[x] > costs[y]; });
  RankAssignment assignment;
  const auto ranks = static_cast<std::size_t>(world_size);
  assignment.records_per_rank.resize(ranks);
  assignment.cost_per_rank.assign(ranks, 0.0);
  // Least loaded rank first; on equal load the one with fewer records, then the lower rank, so
  // zero-cost records still spread out. A heap of (load, records, rank): O(log w) per record.
  using Slot = std::tuple<double, std::size_t, std::size_t>;
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> least_loaded;
  for (std::size_t r = 0; r < ranks; ++r) least_loaded.emplace(0.0, 0, r);
  for (std::size_t record : order) {
    const std::size_t best = std::get<2>(least_loaded.top());
    least_loaded.pop();
    assignment.records_per_rank[best].push_back(record);
    assignment.cost_per_rank[best] += costs[record];
    least_loaded.emplace(assignment.cost_per_rank[best], assignment.records_per_rank[best].size(), best);
  }
  for (auto& records : assignment.records_per_rank) std::sort(records.begin(), records.end());
  return assignment;
}

std::vector<double> marginal_costs_bytes(const MemoryModel& model, const std::vector<std::vector<double>>& record_dims) {
  const std::size_t bs = model.batch_size_index();
  std::vector<double> costs;
  costs.reserve(record_dims.size());
  for (std::vector<double> dims : record_dims) {
    dims.at(bs) = 1;
    costs.push_back(model.added_bytes(dims));
  }
  return costs;
}

namespace {

// The formula at `copies` copies of `record`: batch size `copies`, summed variables times it.
double formula_at_copies(const MemoryModel& model, std::vector<double> record, std::int64_t copies) {
  const std::vector<DimAggregation>& aggregation = model.aggregation();
  for (std::size_t v = 0; v < record.size(); ++v) {
    if (aggregation[v] == DimAggregation::kSum) record[v] *= static_cast<double>(copies);
  }
  record[model.batch_size_index()] = static_cast<double>(copies);
  return model.formula().predict(model.coefficients(), record);
}

// One record's share of the largest microbatch of its copies (record_costs_bytes).
double record_share_bytes(const MemoryModel& model, const std::vector<double>& record, std::int64_t usable_bytes,
                          std::int64_t max_records) {
  std::int64_t copies = 1;
  try {
    copies = model.max_microbatch_size(record, usable_bytes, max_records);
  } catch (const std::invalid_argument&) {
    // Not even one copy fits: the record alone is what the packer will have to place.
  }
  const double added = formula_at_copies(model, record, copies) - formula_at_copies(model, record, 0);
  return std::max(0.0, added / static_cast<double>(copies));
}

}  // namespace

std::vector<double> record_costs_bytes(const MemoryModel& model, const std::vector<std::vector<double>>& record_dims,
                                       std::int64_t usable_bytes, std::int64_t max_records) {
  if (max_records < 1) {
    throw std::invalid_argument("record_costs_bytes: max_records must be >= 1, got " + std::to_string(max_records));
  }
  const std::size_t width = model.formula().variable_names().size();
  std::map<std::vector<double>, double> by_dims;  // records of equal dims share one computation
  std::vector<double> costs;
  costs.reserve(record_dims.size());
  for (std::vector<double> dims : record_dims) {
    if (dims.size() != width) {
      throw std::invalid_argument("record_costs_bytes: record " + std::to_string(costs.size()) + " has " +
                                  std::to_string(dims.size()) + " dims for " + std::to_string(width) + " variables");
    }
    dims[model.batch_size_index()] = 1;
    auto [at, added] = by_dims.try_emplace(dims, 0.0);
    if (added) at->second = record_share_bytes(model, dims, usable_bytes, max_records);
    costs.push_back(at->second);
  }
  return costs;
}

}  // namespace xpm
