// packer_baselines_test.cpp — the benchmark's baselines: fairseq's max_tokens batcher by hand,
// ReferenceAdaptivePacker (packer_baselines.hpp) against our AdaptivePacker (two implementations,
// one answer), and the max_tokens that keeps every microbatch within budget.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "packer_baselines.hpp"
#include "packer_inputs.hpp"
#include "xpm/planner/packer.hpp"

namespace {

std::vector<std::vector<double>> records_of(const std::vector<double>& lengths) {
  std::vector<std::vector<double>> r;
  for (double l : lengths) r.push_back({1.0, l});
  return r;
}

}  // namespace

TEST_CASE("max_tokens batcher cuts lengths 3 9 4 7 2 under 20 tokens into {2, 3, 4} and {7, 9}") {
  // By length: 2 (record 4), 3 (0), 4 (2): 3 x 4 = 12 tokens; 7 would make 4 x 7 = 28 > 20, so a
  // new microbatch: 7 (3), 9 (1): 2 x 9 = 18.
  const xpm_bench::BenchModel model = xpm_bench::bench_model(xpm_bench::BenchFormula::kQuadratic);
  const xpm::MicrobatchPlan plan =
      xpm_bench::MaxTokensBatcher(1, 20).pack(records_of({3, 9, 4, 7, 2}), model.memory, model.usable_bytes);
  REQUIRE(plan.microbatches.size() == 2);
  CHECK(plan.microbatches[0].record_indices == std::vector<std::size_t>{4, 0, 2});
  CHECK(plan.microbatches[0].dims == std::vector<double>{3, 4});
  CHECK(plan.microbatches[1].record_indices == std::vector<std::size_t>{3, 1});
  CHECK(plan.microbatches[1].dims == std::vector<double>{2, 9});
}

TEST_CASE("ReferenceAdaptivePacker and our AdaptivePacker make the same plans, sorted or not") {
  const xpm_bench::BenchModel model = xpm_bench::bench_model(xpm_bench::BenchFormula::kQuadratic);
  for (unsigned seed = 0; seed < 40; ++seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> count(1, 3000), length(1, 180);
    std::vector<double> lengths(static_cast<std::size_t>(count(rng)));
    for (double& l : lengths) l = length(rng);
    const auto records = records_of(lengths);
    const std::int64_t budget = std::uniform_int_distribution<std::int64_t>(60000000, 400000000)(rng);
    for (bool sorted : {false, true}) {
      const xpm::MicrobatchPlan ours =
          xpm::AdaptivePacker(xpm::AdaptivePackerOptions{sorted ? "l" : ""}).pack(records, model.memory, budget);
      const xpm::MicrobatchPlan reference =
          xpm_bench::ReferenceAdaptivePacker(sorted ? 1 : -1).pack(records, model.memory, budget);
      CAPTURE(seed);
      CAPTURE(sorted);
      REQUIRE(ours.microbatches.size() == reference.microbatches.size());
      for (std::size_t m = 0; m < ours.microbatches.size(); ++m) {
        CHECK(ours.microbatches[m].record_indices == reference.microbatches[m].record_indices);
      }
    }
  }
}

TEST_CASE("safe max_tokens is floor(1 GiB / the largest per-token cost) and keeps every microbatch in budget") {
  // Linear (BiLSTM) formula: one record of length l costs g(l) = a (l - 1) + b, per token
  // a - (a - b) / l, largest at the longest length since a > b.
  const xpm_bench::BenchModel model = xpm_bench::bench_model(xpm_bench::BenchFormula::kLinear);
  const double a = 24593.2, b = 18434.9, longest = 180;
  const double per_token = a - (a - b) / longest;
  const auto expected = static_cast<std::int64_t>(std::floor(1024.0 * 1024.0 * 1024.0 / per_token));
  CHECK(xpm_bench::safe_max_tokens(model, longest) == expected);

  std::mt19937 rng(3);
  std::uniform_int_distribution<int> length(1, 180);
  std::vector<double> lengths(20000);
  for (double& l : lengths) l = length(rng);
  const auto records = records_of(lengths);
  for (const auto formula : {xpm_bench::BenchFormula::kQuadratic, xpm_bench::BenchFormula::kLinear,
                             xpm_bench::BenchFormula::kPacked}) {
    const xpm_bench::BenchModel m = xpm_bench::bench_model(formula);
    const xpm::MicrobatchPlan plan =
        xpm_bench::MaxTokensBatcher(1, xpm_bench::safe_max_tokens(m, longest)).pack(records, m.memory, m.usable_bytes);
    for (const auto& mb : plan.microbatches) {
      CHECK(m.memory.predict_bytes(xpm::aggregate_dims(records, mb.record_indices, m.memory)) <=
            static_cast<double>(m.usable_bytes));
    }
  }
}
