// xpm/planner/rank_assignment.hpp — split one global batch among the ranks of a data-parallel
// job so that every rank gets about the same predicted compute.
//
//   std::vector<double> cost = ...;           // one predicted cost per record of the global batch
//   RankAssignment a = assign_records_to_ranks(cost, world_size);
//   const std::vector<std::size_t>& mine = a.records_per_rank[rank];
//
// Algorithm: longest processing time first (Graham 1969, "Bounds on multiprocessing timing
// anomalies", SIAM J. Appl. Math. 17(2)): records in decreasing cost (ties: lower index
// first) each go to the rank with the least assigned cost so far (ties: lower rank). The
// largest rank load is at most 4/3 - 1/(3w) of the optimum. The result depends only on the
// costs and world_size, so every rank computes the same assignment from the same global batch
// without communicating (docs/design.md: no desync by construction). Every record is assigned to
// exactly one rank; a rank may get none when there are fewer records than ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "xpm/planner/memory_model.hpp"

namespace xpm {

struct RankAssignment {
  std::vector<std::vector<std::size_t>> records_per_rank;  // record indices, ascending per rank
  std::vector<double> cost_per_rank;                        // summed predicted cost per rank

  /// max rank cost / mean rank cost (1 = perfectly balanced; 1 when every cost is 0).
  double imbalance() const;
};

/// Assigns records 0..costs.size()-1 to world_size ranks (LPT, see above). Costs are in any
/// unit (the tagging job uses predicted bytes of the record alone above the constant term).
/// Throws std::invalid_argument when world_size < 1 or a cost is negative or not finite (the
/// message names the record index and the value). Pure; thread-safe.
RankAssignment assign_records_to_ranks(const std::vector<double>& costs, int world_size);

/// The bytes each record adds alone: the model's formula at batch size 1 minus at batch size 0
/// (its other dims kept), at least 0. record_dims in the formula's variable order. Pure.
/// A formula with a term that grows without the batch size (`max(a*bs*l + c, b*l^2 + d)`,
/// `a*tokens + c` with tokens summed) makes records look free here; record_costs_bytes does not.
std::vector<double> marginal_costs_bytes(const MemoryModel& model, const std::vector<std::vector<double>>& record_dims);

/// The cost the data-parallel step and the Python sampler balance: each record's share of the
/// largest microbatch of its kind, (f(m copies) - f(0 copies)) / m bytes, f the model's formula,
/// m the most copies of the record (at most max_records) that fit usable_bytes
/// (MemoryModel::max_microbatch_size; 1 when even one does not fit), a copy adding 1 to the
/// batch size and its value to every summed variable. At least 0. For a formula linear in the
/// batch size this is marginal_costs_bytes; where a term without the batch size dominates a
/// single record, it is what the record takes in the microbatches the packer builds.
///
///   // max(a*bs*l + c, b*l^2 + d): one record of l = 100 adds nothing over b*l^2 + d;
///   // 40 of them fit, and each then takes about a*l bytes.
///   std::vector<double> costs = record_costs_bytes(model, {{1, 100}, {1, 20}}, usable_bytes, 64);
///
/// record_dims in the formula's variable order (the batch-size entry ignored). Throws
/// std::invalid_argument when a row's width differs from the formula's variables or
/// max_records < 1. Pure; the same on every rank. Records with equal dims are computed once.
std::vector<double> record_costs_bytes(const MemoryModel& model, const std::vector<std::vector<double>>& record_dims,
                                       std::int64_t usable_bytes, std::int64_t max_records);

}  // namespace xpm
