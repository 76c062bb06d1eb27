#include "xpm/planner/rank_assignment.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
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

}  // namespace xpm
