// plan_quality_test.cpp — the benchmark's plan measures against hand-computed values.
#include <doctest/doctest.h>

#include <stdexcept>
#include <vector>

#include "plan_quality.hpp"

namespace {

// a*bs*l^2 + c with a = 1, c = 100, l the longest record; budget 150: 50 bytes for records.
xpm::MemoryModel square_model() {
  return xpm::MemoryModel(xpm::CostFormula("a*bs*l^2 + c", {"a", "c"}, {"bs", "l"}), {1.0, 100.0}, 0, "bs",
                          {{"l", xpm::DimAggregation::kMax}});
}

xpm::Microbatch microbatch(std::vector<std::size_t> indices) {
  xpm::Microbatch mb;
  mb.record_indices = std::move(indices);
  return mb;
}

}  // namespace

TEST_CASE("the lower bound of lengths 5 5 3 with 50 bytes for records is 2 microbatches") {
  // Records cost 25 + 25 + 9 = 59 bytes above c; 59 / 50 rounds up to 2.
  const std::vector<std::vector<double>> records = {{1, 5}, {1, 5}, {1, 3}};
  CHECK(xpm_bench::plan_lower_bound(records, square_model(), 150) == 2);
}

TEST_CASE("plan quality of {0, 2} {1} for lengths 5 5 3: utilization, padding waste, over budget") {
  const std::vector<std::vector<double>> records = {{1, 5}, {1, 5}, {1, 3}};
  xpm::MicrobatchPlan plan;
  plan.microbatches = {microbatch({0, 2}), microbatch({1})};
  const xpm_bench::PlanQuality q = xpm_bench::plan_quality(plan, records, square_model(), 150);
  // {0, 2}: bs 2, l 5: 100 + 2 x 25 = 150 (utilization 1); {1}: 125 (0.8333).
  CHECK(q.microbatches == 2);
  CHECK(q.lower_bound == 2);
  CHECK(q.utilization_mean == doctest::Approx((1.0 + 125.0 / 150) / 2));
  CHECK(q.utilization_min == doctest::Approx(125.0 / 150));
  // Padded tokens 2 x 5 + 1 x 5 = 15 for 13 real ones.
  CHECK(q.padding_waste == doctest::Approx(2.0 / 13));
  CHECK(q.over_budget == 0);
  CHECK(q.mean_records == doctest::Approx(1.5));

  plan.microbatches = {microbatch({0, 1, 2})};  // 100 + 3 x 25 = 175 > 150
  CHECK(xpm_bench::plan_quality(plan, records, square_model(), 150).over_budget == 1);
}

TEST_CASE("plan quality refuses a plan that holds a record twice or misses one") {
  const std::vector<std::vector<double>> records = {{1, 5}, {1, 5}, {1, 3}};
  xpm::MicrobatchPlan twice;
  twice.microbatches = {microbatch({0, 1}), microbatch({1, 2})};
  CHECK_THROWS_AS(xpm_bench::plan_quality(twice, records, square_model(), 150), std::logic_error);
  xpm::MicrobatchPlan missing;
  missing.microbatches = {microbatch({0, 1})};
  CHECK_THROWS_AS(xpm_bench::plan_quality(missing, records, square_model(), 150), std::logic_error);
}
