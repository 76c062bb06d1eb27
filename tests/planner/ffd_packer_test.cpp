// ffd_packer_test.cpp — FirstFitDecreasingPacker: hand-worked first fit, equivalence with the
// sorted adaptive packer for count/max dims, coverage, budgets, over-budget records; a
// RecordDimsView and one vector per record alike.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "xpm/planner/ffd_packer.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/record_dims_view.hpp"

using xpm::AdaptivePacker;
using xpm::AdaptivePackerOptions;
using xpm::CostFormula;
using xpm::DimAggregation;
using xpm::FirstFitDecreasingPacker;
using xpm::MemoryModel;
using xpm::MicrobatchPlan;

namespace {

using Records = std::vector<std::vector<double>>;

// Packed sequences: a*t + b*bs + c with t (tokens) summed over the microbatch's records.
MemoryModel packed_model(double a, double b, double c) {
  return MemoryModel(CostFormula("a*t + b*bs + c", {"a", "b", "c"}, {"bs", "t"}), {a, b, c}, 0,
                     "bs", {{"t", DimAggregation::kSum}});
}

// Padded sequences: a*bs*l^2 + b*bs*l + c with l the longest record of the microbatch.
MemoryModel padded_model() {
  return MemoryModel(CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
                     {2.0, 64.0, 5000.0}, 0, "bs", {{"l", DimAggregation::kMax}});
}

Records records_of(const std::vector<double>& values) {
  Records r;
  for (double v : values) r.push_back({0.0, v});  // batch-size entry ignored
  return r;
}

void check_each_record_once(const MicrobatchPlan& plan, std::size_t n) {
  std::vector<int> seen(n, 0);
  for (const auto& mb : plan.microbatches) {
    CHECK_FALSE(mb.record_indices.empty());
    for (std::size_t i : mb.record_indices) {
      REQUIRE(i < n);
      ++seen[i];
    }
  }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));
}

void check_dims_and_budget(const MicrobatchPlan& plan, const Records& records,
                           const MemoryModel& model, std::int64_t usable_bytes) {
  for (const auto& mb : plan.microbatches) {
    CHECK(mb.dims == xpm::aggregate_dims(records, mb.record_indices, model));
    CHECK(mb.predicted_bytes == model.predict_bytes(mb.dims));
    if (mb.over_budget) {
      CHECK(mb.record_indices.size() == 1);
      CHECK(mb.predicted_bytes > static_cast<double>(usable_bytes));
    } else {
      CHECK(mb.predicted_bytes <= static_cast<double>(usable_bytes));
    }
  }
}

}  // namespace

TEST_CASE("first fit decreasing packs tokens 2 5 4 7 1 6 under 10 into 3 microbatches where next fit needs 4") {
  // By hand, heaviest first: 7 opens A; 6 opens B; 5 opens C; 4 joins B (10); 2 joins A (9);
  // 1 joins A (10). Next fit over the same order: {7} {6} {5, 4} {2, 1}.
  const MemoryModel model = packed_model(1, 0, 0);
  const Records records = records_of({2, 5, 4, 7, 1, 6});
  const MicrobatchPlan ffd = FirstFitDecreasingPacker().pack(records, model, 10);
  REQUIRE(ffd.microbatches.size() == 3);
  CHECK(ffd.microbatches[0].record_indices == std::vector<std::size_t>{3, 0, 4});
  CHECK(ffd.microbatches[1].record_indices == std::vector<std::size_t>{5, 2});
  CHECK(ffd.microbatches[2].record_indices == std::vector<std::size_t>{1});
  CHECK(ffd.microbatches[0].dims == std::vector<double>{3, 10});
  CHECK(ffd.microbatches[1].predicted_bytes == 10);
  CHECK(ffd.over_budget_records.empty());
  const MicrobatchPlan next_fit =
      AdaptivePacker(AdaptivePackerOptions{"t"}).pack(records, model, 10);
  CHECK(next_fit.microbatches.size() == 4);
}

TEST_CASE("first fit decreasing counts the per-record and fixed terms of the formula") {
  // 3*t + 2*bs + 10 <= 40: records of 4 tokens weigh 14 each, so two fit (38) and a third does
  // not (52); four records need two microbatches.
  const MemoryModel model = packed_model(3, 2, 10);
  const Records records = records_of({4, 4, 4, 4});
  const MicrobatchPlan plan = FirstFitDecreasingPacker().pack(records, model, 40);
  REQUIRE(plan.microbatches.size() == 2);
  CHECK(plan.microbatches[0].predicted_bytes == 38);
  CHECK(plan.microbatches[1].record_indices == std::vector<std::size_t>{2, 3});
}

TEST_CASE("with count and max dims only, first fit decreasing gives the sorted adaptive packer's plan") {
  const MemoryModel model = padded_model();
  for (unsigned seed = 0; seed < 200; ++seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> count(1, 120);
    std::lognormal_distribution<double> length(4.0, 0.8);
    std::vector<double> lengths(static_cast<std::size_t>(count(rng)));
    for (double& l : lengths) l = std::max(1.0, std::round(length(rng)));
    const Records records = records_of(lengths);
    const std::int64_t budget = std::uniform_int_distribution<std::int64_t>(20000, 4000000)(rng);
    const MicrobatchPlan ffd = FirstFitDecreasingPacker().pack(records, model, budget);
    const MicrobatchPlan sorted = AdaptivePacker(AdaptivePackerOptions{"l"}).pack(records, model, budget);
    CAPTURE(seed);
    REQUIRE(ffd.microbatches.size() == sorted.microbatches.size());
    for (std::size_t m = 0; m < ffd.microbatches.size(); ++m) {
      CHECK(ffd.microbatches[m].record_indices == sorted.microbatches[m].record_indices);
    }
    CHECK(ffd.over_budget_records == sorted.over_budget_records);
  }
}

TEST_CASE("with summed tokens, first fit decreasing stays between the volume bound and next fit decreasing") {
  for (unsigned seed = 0; seed < 300; ++seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> count(1, 200);
    std::uniform_int_distribution<int> tokens(1, 60);
    std::vector<double> lengths(static_cast<std::size_t>(count(rng)));
    for (double& l : lengths) l = tokens(rng);
    const Records records = records_of(lengths);
    const double a = 100, b = 40, c = 1000;
    const MemoryModel model = packed_model(a, b, c);
    const std::int64_t budget = std::uniform_int_distribution<std::int64_t>(7100, 60000)(rng);
    const MicrobatchPlan ffd = FirstFitDecreasingPacker().pack(records, model, budget);
    const MicrobatchPlan next_fit =
        AdaptivePacker(AdaptivePackerOptions{"t"}).pack(records, model, budget);
    // Each microbatch pays c once and a*t + b per record: the sum of a*t + b over all records
    // needs at least ceil(sum / (budget - c)) microbatches.
    double volume = 0;
    for (double l : lengths) volume += a * l + b;
    const auto lower_bound = static_cast<std::size_t>(std::ceil(volume / (budget - c)));
    CAPTURE(seed);
    CHECK(ffd.microbatches.size() >= lower_bound);
    CHECK(ffd.microbatches.size() <= next_fit.microbatches.size());
    check_each_record_once(ffd, records.size());
    check_dims_and_budget(ffd, records, model, budget);
  }
}

TEST_CASE("first fit decreasing delivers all 17 records exactly once under any budget") {
  const MemoryModel model = padded_model();
  std::mt19937 rng(17);
  std::uniform_int_distribution<int> length(1, 300);
  std::vector<double> lengths(17);
  for (double& l : lengths) l = length(rng);
  const Records records = records_of(lengths);
  for (std::int64_t budget = 1; budget < 40000000; budget = budget * 3 / 2 + 1) {
    CAPTURE(budget);
    const MicrobatchPlan plan = FirstFitDecreasingPacker().pack(records, model, budget);
    check_each_record_once(plan, records.size());
    check_dims_and_budget(plan, records, model, budget);
  }
}

TEST_CASE("first fit decreasing reports a record over budget alone and packs the others") {
  const MemoryModel model = packed_model(1, 0, 0);
  const Records records = records_of({3, 12, 4, 3});
  const MicrobatchPlan plan = FirstFitDecreasingPacker().pack(records, model, 10);
  CHECK(plan.over_budget_records == std::vector<std::size_t>{1});
  REQUIRE(plan.microbatches.size() == 2);
  CHECK(plan.microbatches[0].over_budget);
  CHECK(plan.microbatches[0].predicted_bytes == 12);
  CHECK(plan.microbatches[1].record_indices == std::vector<std::size_t>{2, 0, 3});
  check_each_record_once(plan, records.size());
}

TEST_CASE("first fit decreasing keeps record order among equally heavy records") {
  const MicrobatchPlan plan =
      FirstFitDecreasingPacker().pack(records_of({4, 9, 4, 9, 1}), padded_model(), 1 << 30);
  REQUIRE(plan.microbatches.size() == 1);
  CHECK(plan.microbatches[0].record_indices == std::vector<std::size_t>{1, 3, 0, 2, 4});
}

TEST_CASE("first fit decreasing returns an empty plan for an empty outer batch and rejects bad input") {
  CHECK(FirstFitDecreasingPacker().pack({}, padded_model(), 100).microbatches.empty());
  CHECK_THROWS_WITH_AS(FirstFitDecreasingPacker().pack({{0.0, 8.0}, {8.0}}, padded_model(), 1000),
                       doctest::Contains("record 1"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(FirstFitDecreasingPacker().pack(records_of({8}), padded_model(), 0),
                       doctest::Contains("usable_bytes"), std::invalid_argument);
}

TEST_CASE("on 20,000 records with fractional lengths first fit decreasing still matches the sorted adaptive packer") {
  // Fractional lengths take the packers' comparison-free sort of non-integer keys (the radix
  // path for large outer batches); ties (about 8 records per length) must keep record order.
  std::mt19937 rng(2024);
  std::uniform_int_distribution<int> quarter(4, 2400);
  std::vector<double> lengths(20000);
  for (double& l : lengths) l = quarter(rng) / 4.0;
  const Records records = records_of(lengths);
  const MemoryModel model = padded_model();
  const std::int64_t budget = 3000000;
  const MicrobatchPlan ffd = FirstFitDecreasingPacker().pack(records, model, budget);
  const MicrobatchPlan sorted = AdaptivePacker(AdaptivePackerOptions{"l"}).pack(records, model, budget);
  REQUIRE(ffd.microbatches.size() == sorted.microbatches.size());
  for (std::size_t m = 0; m < ffd.microbatches.size(); ++m) {
    CHECK(ffd.microbatches[m].record_indices == sorted.microbatches[m].record_indices);
  }
  // Heaviest first, ties in record order: the concatenated plan is the stable descending order.
  std::vector<std::size_t> expected(lengths.size());
  std::iota(expected.begin(), expected.end(), std::size_t{0});
  std::stable_sort(expected.begin(), expected.end(),
                   [&](std::size_t a, std::size_t b) { return lengths[a] > lengths[b]; });
  std::vector<std::size_t> concatenated;
  for (const auto& mb : sorted.microbatches) {
    concatenated.insert(concatenated.end(), mb.record_indices.begin(), mb.record_indices.end());
  }
  CHECK(concatenated == expected);
  check_dims_and_budget(ffd, records, model, budget);
}

TEST_CASE("first fit decreasing gives the same plan from a view of 5,000 records as from one vector per record") {
  // Summed tokens (where first fit differs from next fit) and padded lengths; the view reads the
  // records' dims in place from one contiguous buffer.
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> tokens(1, 600);
  std::vector<double> values(5000);
  for (double& v : values) v = tokens(rng);
  const Records records = records_of(values);
  std::vector<double> flat;
  for (const auto& r : records) flat.insert(flat.end(), r.begin(), r.end());
  const xpm::RecordDimsView view(flat.data(), records.size(), 2);
  for (const MemoryModel& model : {packed_model(1.0, 20.0, 100.0), padded_model()}) {
    for (const std::int64_t budget : {std::int64_t{2000}, std::int64_t{20000}, std::int64_t{5000000}}) {
      CAPTURE(budget);
      const MicrobatchPlan from_view = FirstFitDecreasingPacker().pack(view, model, budget);
      const MicrobatchPlan from_rows = FirstFitDecreasingPacker().pack(records, model, budget);
      REQUIRE(from_view.microbatches.size() == from_rows.microbatches.size());
      for (std::size_t m = 0; m < from_view.microbatches.size(); ++m) {
        CHECK(from_view.microbatches[m].record_indices == from_rows.microbatches[m].record_indices);
        CHECK(from_view.microbatches[m].dims == from_rows.microbatches[m].dims);
        CHECK(from_view.microbatches[m].over_budget == from_rows.microbatches[m].over_budget);
      }
      CHECK(from_view.over_budget_records == from_rows.over_budget_records);
      check_each_record_once(from_view, records.size());
      check_dims_and_budget(from_view, records, model, budget);
    }
  }
  CHECK_THROWS_WITH_AS(FirstFitDecreasingPacker().pack(xpm::RecordDimsView(flat.data(), 2500, 4), padded_model(), 1000),
                       doctest::Contains("4 value(s) per record, expected 2"), std::invalid_argument);
  CHECK(FirstFitDecreasingPacker().pack(xpm::RecordDimsView(nullptr, 0, 2), padded_model(), 100).microbatches.empty());
}
