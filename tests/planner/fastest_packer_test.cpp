// fastest_packer_test.cpp — FastestPacker and the time model it reads: the least predicted time
// over consecutive runs (against every partition of small inputs), the fewest microbatches
// when a microbatch's overhead dominates, one record each when only work counts, over-budget
// records, coverage; fit_time_model recovering a known line.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <vector>

#include "xpm/planner/fastest_packer.hpp"
#include "xpm/planner/packer.hpp"
#include "xpm/planner/record_dims_view.hpp"
#include "xpm/planner/time_model.hpp"

using xpm::CostFormula;
using xpm::DimAggregation;
using xpm::FastestPacker;
using xpm::MemoryModel;
using xpm::MicrobatchPlan;
using xpm::TimeModel;

namespace {

// Padded sequences, a*bs*l^2 + b*bs*l + c, with a time model of the given overhead.
MemoryModel timed_model(double overhead_s, double seconds_per_byte = 1e-9) {
  MemoryModel model(CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}), {2.0, 64.0, 5000.0}, 0,
                    "bs", {{"l", DimAggregation::kMax}});
  model.metadata()["time_model"] = TimeModel{overhead_s, seconds_per_byte, 0.0, 0}.to_json();
  return model;
}

std::vector<double> lengths_dims(const std::vector<double>& lengths) {
  std::vector<double> dims;
  for (double l : lengths) dims.insert(dims.end(), {1.0, l});
  return dims;
}

double plan_seconds(const MicrobatchPlan& plan, const MemoryModel& model) {
  double seconds = 0;
  for (const xpm::Microbatch& mb : plan.microbatches) seconds += TimeModel::from_metadata(model)->seconds(model, mb.dims);
  return seconds;
}

// The least seconds over every split of the records, sorted longest first, into consecutive
// runs that each fit (2^(n-1) splits).
double brute_force_seconds(std::vector<double> lengths, const MemoryModel& model, double usable_bytes) {
  std::sort(lengths.rbegin(), lengths.rend());
  const std::size_t n = lengths.size();
  const TimeModel time = *TimeModel::from_metadata(model);
  double best = std::numeric_limits<double>::infinity();
  for (std::uint32_t cuts = 0; cuts < (1u << (n - 1)); ++cuts) {
    double seconds = 0;
    bool fits = true;
    std::size_t start = 0;
    for (std::size_t k = 1; k <= n && fits; ++k) {
      if (k < n && !(cuts & (1u << (k - 1)))) continue;
      const std::vector<double> dims = {static_cast<double>(k - start), lengths[start]};
      fits = model.predict_bytes(dims) <= usable_bytes;
      seconds += time.seconds(model, dims);
      start = k;
    }
    if (fits) best = std::min(best, seconds);
  }
  return best;
}

}  // namespace

TEST_CASE("the fastest packer's plan takes the least predicted time of every split into consecutive runs") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> length(5, 200);
  for (double overhead_s : {0.0, 1e-5, 1e-4, 1e-3}) {
    const MemoryModel model = timed_model(overhead_s);
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<double> lengths(2 + trial % 8);
      for (double& l : lengths) l = std::round(length(rng));
      const std::vector<double> dims = lengths_dims(lengths);
      const double usable = 400000;
      const MicrobatchPlan plan = FastestPacker("l").pack(xpm::RecordDimsView(dims.data(), lengths.size(), 2),
                                                          model, static_cast<std::int64_t>(usable));
      std::vector<int> seen(lengths.size(), 0);
      for (const xpm::Microbatch& mb : plan.microbatches) {
        CHECK(model.predict_bytes(mb.dims) <= usable);
        for (std::size_t i : mb.record_indices) ++seen[i];
      }
      CHECK(std::count(seen.begin(), seen.end(), 1) == static_cast<long>(lengths.size()));
      CHECK(plan_seconds(plan, model) == doctest::Approx(brute_force_seconds(lengths, model, usable)).epsilon(1e-12));
    }
  }
}

TEST_CASE("a costly microbatch gives the fewest microbatches; work alone gives one record each") {
  const std::vector<double> lengths = {120, 30, 64, 66, 200, 8, 90, 45, 150, 12};  // distinct: no tie
  const std::vector<double> dims = lengths_dims(lengths);
  const xpm::RecordDimsView view(dims.data(), lengths.size(), 2);
  const std::int64_t usable = 600000;
  const MemoryModel costly = timed_model(10.0);  // 10 s a microbatch: their count is all that matters
  const MicrobatchPlan fewest = xpm::AdaptivePacker(xpm::AdaptivePackerOptions{"l"}).pack(view, costly, usable);
  CHECK(FastestPacker("l").pack(view, costly, usable).microbatches.size() == fewest.microbatches.size());
  const MemoryModel work_only = timed_model(0.0);  // padding is the only cost: no record shares
  CHECK(FastestPacker("l").pack(view, work_only, usable).microbatches.size() == lengths.size());
}

TEST_CASE("the fastest packer puts a record over budget alone in its own microbatch, and needs a time model") {
  const MemoryModel model = timed_model(1e-4);
  const std::vector<double> dims = lengths_dims({20, 5000, 30});
  const xpm::RecordDimsView view(dims.data(), 3, 2);
  const MicrobatchPlan plan = FastestPacker().pack(view, model, 400000);
  REQUIRE(plan.over_budget_records == std::vector<std::size_t>{1});
  CHECK(plan.microbatches.front().record_indices == std::vector<std::size_t>{1});
  CHECK(plan.microbatches.front().over_budget);
  CHECK(FastestPacker().pack(std::vector<std::vector<double>>{{1, 20}, {1, 5000}, {1, 30}}, model, 400000)
            .microbatches.size() == plan.microbatches.size());  // one vector per record alike

  MemoryModel untimed = model;
  untimed.metadata().erase("time_model");
  CHECK_THROWS_WITH_AS(FastestPacker().pack(view, untimed, 400000),
                       doctest::Contains("the fastest packer needs a memory model with a time model"),
                       std::invalid_argument);
  untimed.metadata()["time_model"] = {{"overhead_s", -1}, {"seconds_per_byte", 1e-9}};
  CHECK_THROWS_AS(FastestPacker().pack(view, untimed, 400000), std::invalid_argument);
  CHECK_THROWS_WITH_AS(FastestPacker("l,bs"), "FastestPacker sorts by one variable, got sort_by 'l,bs'",
                       std::invalid_argument);
}

TEST_CASE("fit_time_model recovers a microbatch's overhead and its seconds per byte of work from the probes") {
  MemoryModel model = timed_model(0);
  model.metadata().erase("time_model");
  std::vector<xpm::ProbeResult> probes;
  for (std::vector<double> dims : {std::vector<double>{1, 32}, {2, 64}, {4, 64}, {8, 128}, {16, 64}, {4, 200}}) {
    xpm::ProbeResult probe;
    probe.dims = dims;
    probe.forward_backward_s = 0.002 + 3e-9 * TimeModel::work_bytes(model, dims);
    probes.push_back(probe);
  }
  const std::optional<TimeModel> time = xpm::fit_time_model(model, probes);
  REQUIRE(time);
  CHECK(time->overhead_s == doctest::Approx(0.002).epsilon(1e-6));
  CHECK(time->seconds_per_byte == doctest::Approx(3e-9).epsilon(1e-6));
  CHECK(time->fitted_points == 6);
  CHECK(TimeModel::work_bytes(model, {4, 64}) == doctest::Approx(2.0 * 4 * 64 * 64 + 64.0 * 4 * 64));

  probes.resize(2);  // two shapes cannot separate the two terms reliably
  CHECK_FALSE(xpm::fit_time_model(model, probes));
  for (xpm::ProbeResult& probe : probes) probe.forward_backward_s = 0;  // not timed
  CHECK_FALSE(xpm::fit_time_model(model, probes));
}
