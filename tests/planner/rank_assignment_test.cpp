// Rank assignment of a global batch (LPT on predicted cost): every record exactly once,
// balanced loads, deterministic, clear errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "xpm/planner/rank_assignment.hpp"

using xpm::assign_records_to_ranks;
using xpm::RankAssignment;

namespace {
std::vector<std::size_t> all_records(const RankAssignment& a) {
  std::vector<std::size_t> out;
  for (const auto& records : a.records_per_rank) out.insert(out.end(), records.begin(), records.end());
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

TEST_CASE("rank assignment: every record of the global batch goes to exactly one rank") {
  std::vector<double> costs;
  for (int i = 0; i < 101; ++i) costs.push_back(static_cast<double>((i * 37) % 50 + 1));
  for (int world = 1; world <= 5; ++world) {
    const RankAssignment a = assign_records_to_ranks(costs, world);
    REQUIRE(a.records_per_rank.size() == static_cast<std::size_t>(world));
    std::vector<std::size_t> expected(costs.size());
    std::iota(expected.begin(), expected.end(), 0);
    CHECK(all_records(a) == expected);
    for (int r = 0; r < world; ++r) {
      double sum = 0;
      for (std::size_t i : a.records_per_rank[static_cast<std::size_t>(r)]) sum += costs[i];
      CHECK(sum == doctest::Approx(a.cost_per_rank[static_cast<std::size_t>(r)]));
    }
  }
}

TEST_CASE("rank assignment: LPT balances skewed costs and matches a hand-worked case") {
  // Costs 7,6,5,4,3,2 on 2 ranks: 7->r0, 6->r1, 5->r1 (6<7), 4->r0 (7<11), 3->r0 (11=11, fewer
  // records on r0? r0 has 2, r1 has 2: lower rank r0), 2->r1 (11<14).
  const RankAssignment a = assign_records_to_ranks({7, 6, 5, 4, 3, 2}, 2);
  CHECK(a.records_per_rank[0] == std::vector<std::size_t>{0, 3, 4});
  CHECK(a.records_per_rank[1] == std::vector<std::size_t>{1, 2, 5});
  CHECK(a.cost_per_rank[0] == 14);
  CHECK(a.cost_per_rank[1] == 13);
  CHECK(a.imbalance() == doctest::Approx(14.0 / 13.5));
  // One very long record and many short ones: the long one gets a rank almost to itself.
  std::vector<double> skewed(33, 1.0);
  skewed[5] = 32;
  const RankAssignment b = assign_records_to_ranks(skewed, 2);
  CHECK(b.cost_per_rank[0] == 32);
  CHECK(b.cost_per_rank[1] == 32);
  CHECK(b.records_per_rank[0] == std::vector<std::size_t>{5});
}

TEST_CASE("rank assignment: deterministic, spreads zero costs, fewer records than ranks") {
  const std::vector<double> costs = {3, 1, 4, 1, 5, 9, 2, 6};
  const RankAssignment a = assign_records_to_ranks(costs, 3);
  const RankAssignment b = assign_records_to_ranks(costs, 3);
  CHECK(a.records_per_rank == b.records_per_rank);
  const RankAssignment zeros = assign_records_to_ranks(std::vector<double>(6, 0.0), 3);
  for (const auto& records : zeros.records_per_rank) CHECK(records.size() == 2);
  CHECK(zeros.imbalance() == 1.0);
  const RankAssignment few = assign_records_to_ranks({2, 1}, 4);
  CHECK(few.records_per_rank[2].empty());
  CHECK(few.records_per_rank[3].empty());
  CHECK(all_records(few) == std::vector<std::size_t>{0, 1});
}

TEST_CASE("rank assignment: bad input names the value") {
  CHECK_THROWS_WITH_AS(assign_records_to_ranks({1, 2}, 0), doctest::Contains("world_size must be >= 1, got 0"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(assign_records_to_ranks({1, -2}, 2), doctest::Contains("record 1 has cost -2"),
                       std::invalid_argument);
}
