// Rank assignment of a global batch (LPT on predicted cost): every record exactly once,
// balanced loads, deterministic, clear errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
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

namespace {
// max(a*bs*l + c, b*l^2 + d): one record of l >= 40 adds nothing over b*l^2 + d, while in a
// microbatch of many it takes a*l bytes.
xpm::MemoryModel max_of_branches_model() {
  return xpm::MemoryModel(xpm::CostFormula("max(a*bs*l + c, b*l^2 + d)", {"a", "c", "b", "d"}, {"bs", "l"}),
                          {100, 1000, 2.5, 1000}, /*floor_bytes=*/0, "bs");
}

// Records of lengths 10..199, each length twice, in a shuffled order.
std::vector<std::vector<double>> record_dims_of_lengths() {
  std::vector<std::vector<double>> dims;
  for (int i = 0; i < 380; ++i) dims.push_back({1, static_cast<double>(10 + (i * 97) % 190)});
  return dims;
}
}  // namespace

TEST_CASE("record costs: a record's share of the largest microbatch of its kind") {
  const xpm::MemoryModel model = max_of_branches_model();
  // l = 100: 1 record predicts max(11,000, 26,000) = f(0) = 26,000, so it adds nothing alone;
  // 64 records (the cap) fit 1 MB: max(641,000, 26,000) - 26,000 over 64 = 9,609.375 bytes.
  CHECK(xpm::marginal_costs_bytes(model, {{1, 100}}) == std::vector<double>{0});
  const std::vector<double> costs = xpm::record_costs_bytes(model, {{1, 100}, {7, 100}, {1, 20}}, 1'000'000, 64);
  CHECK(costs[0] == doctest::Approx((641'000.0 - 26'000.0) / 64));
  CHECK(costs[1] == costs[0]);  // the batch-size entry is ignored
  // l = 20: f(0) = b*l^2 + d = 2,000; 64 records predict 129,000: 127,000 / 64 each (alone
  // 3,000 - 2,000 = 1,000).
  CHECK(costs[2] == doctest::Approx(127'000.0 / 64));
  CHECK(xpm::marginal_costs_bytes(model, {{1, 20}})[0] == doctest::Approx(1000));
  // Under 40,000 bytes 3 records of l = 100 fit (31,000; 4 predict 41,000).
  CHECK(xpm::record_costs_bytes(model, {{1, 100}}, 40'000, 64)[0] == doctest::Approx((31'000.0 - 26'000.0) / 3));
  // Not even one fits: the record alone.
  CHECK(xpm::record_costs_bytes(model, {{1, 100}}, 20'000, 64)[0] == 0);
  // A formula linear in the batch size: what a record adds alone, whatever the budget.
  const xpm::MemoryModel linear(xpm::CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
                                {2.0, 10.0, 1000.0}, /*floor_bytes=*/0, "bs");
  const std::vector<std::vector<double>> lengths = {{1, 8}, {1, 64}, {1, 300}};
  const std::vector<double> shares = xpm::record_costs_bytes(linear, lengths, 5'000'000, 256);
  const std::vector<double> alone = xpm::marginal_costs_bytes(linear, lengths);
  for (std::size_t i = 0; i < lengths.size(); ++i) CHECK(shares[i] == doctest::Approx(alone[i]));
}

TEST_CASE("record costs: a formula with a branch without the batch size still balances the ranks") {
  const xpm::MemoryModel model = max_of_branches_model();
  const std::vector<std::vector<double>> dims = record_dims_of_lengths();
  // Each rank's records as one stream of microbatches of at most 40 records: the real load.
  auto tokens_per_rank = [&](const RankAssignment& a) {
    std::vector<double> tokens;
    for (const auto& records : a.records_per_rank) {
      double sum = 0;
      for (std::size_t i : records) sum += dims[i][1];
      tokens.push_back(sum);
    }
    return tokens;
  };
  const RankAssignment alone = assign_records_to_ranks(xpm::marginal_costs_bytes(model, dims), 2);
  const RankAssignment shared = assign_records_to_ranks(xpm::record_costs_bytes(model, dims, 1'000'000, 190), 2);
  const std::vector<double> alone_tokens = tokens_per_rank(alone);
  const std::vector<double> shared_tokens = tokens_per_rank(shared);
  // Alone, every record of l >= 40 costs 0: 16,573 against 23,137 tokens; shared, 19,855 each.
  CHECK(std::abs(alone_tokens[0] - alone_tokens[1]) > 5000);
  CHECK(std::abs(shared_tokens[0] - shared_tokens[1]) <= 200);
  CHECK(shared.records_per_rank[0].size() + shared.records_per_rank[1].size() == dims.size());
}

TEST_CASE("record costs: bad input names the value") {
  const xpm::MemoryModel model = max_of_branches_model();
  CHECK_THROWS_WITH_AS(xpm::record_costs_bytes(model, {{1, 100}}, 1'000'000, 0),
                       "record_costs_bytes: max_records must be >= 1, got 0", std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::record_costs_bytes(model, {{1, 100}, {1}}, 1'000'000, 8),
                       "record_costs_bytes: record 1 has 1 dims for 2 variables", std::invalid_argument);
}
