// training_refit_test.cpp — the memory model refitted on a T5's training peaks: taken where the
// probes' fit misses shapes, kept where the calibration's line suffices, the same from the same
// points, its state restored; and the calibration drawn anew over a refit's predictions.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "t5_training_peaks.hpp"
#include "xpm/planner/calibration.hpp"
#include "xpm/planner/step_plan.hpp"
#include "xpm/planner/training_refit.hpp"

using xpm::MemoryModel;
using xpm::MicrobatchPosition;
using xpm::TrainingPoint;
using xpm::TrainingRefit;

namespace {

MemoryModel t5_model() { return MemoryModel::from_json(nlohmann::json::parse(xpm_test::t5_probed_model_json())); }

bool steady_position(const TrainingPoint& point) {
  return point.position == MicrobatchPosition::kMiddle || point.position == MicrobatchPosition::kLast;
}

// (min, max) of (predicted - peak) / peak over the middle and last microbatches of steps [from, to).
std::pair<double, double> steady_errors(const MemoryModel& model, std::size_t from, std::size_t to) {
  const auto steps = xpm_test::t5_training_steps();
  double low = 1e9, high = -1e9;
  for (std::size_t s = from; s < to; ++s)
    for (const TrainingPoint& point : steps[s]) {
      if (!steady_position(point)) continue;
      const double error = (model.predict_bytes(point.dims) - point.peak_bytes) / point.peak_bytes;
      low = std::min(low, error);
      high = std::max(high, error);
    }
  return {low, high};
}

// Feeds steps [0, to) and returns the steps whose end_step took a refit.
std::vector<std::size_t> feed(TrainingRefit& refit, std::size_t to) {
  const auto steps = xpm_test::t5_training_steps();
  std::vector<std::size_t> taken;
  for (std::size_t s = 0; s < to; ++s)
    if (refit.end_step(static_cast<std::int64_t>(s), steps[s])) taken.push_back(s);
  return taken;
}

}  // namespace

TEST_CASE("a T5's model refitted on its training peaks predicts the later steps' better than its probes") {
  const MemoryModel probed = t5_model();
  TrainingRefit refit(probed);
  const std::vector<std::size_t> taken = feed(refit, 9);
  REQUIRE(taken == std::vector<std::size_t>{8});  // 3 points per coefficient of the linear candidates first
  CHECK(refit.refitted());
  CHECK(refit.model().formula().canonical() != probed.formula().canonical());  // "auto" chose it: chosen again
  CHECK(refit.log().front().rfind("step 8: memory model refitted on 31 training peaks (", 0) == 0);
  // The steps after the refit, which it never saw: measured -5.35 % to +4.31 % by the probes' fit
  // (a spread of 9.7 points), -0.22 % to +5.34 % by the refit (5.6).
  const auto before = steady_errors(probed, 9, 20), after = steady_errors(refit.model(), 9, 20);
  CHECK(before.second - before.first > 0.09);
  CHECK(after.second - after.first < 0.6 * (before.second - before.first));
  CHECK(after.first > -0.01);
  // It holds in the box of the shapes the window measured (the first microbatches' too); beyond
  // it, the prediction is at least the probes' fit's. A step's first microbatch of one 256-token
  // source and a 2-token target (steps 9 and 17, 8,978,464 bytes) lies beyond: the refit's
  // formula alone puts it 6.4 % under, the probes' fits (with the first microbatch's phase)
  // 3.2 % over.
  const xpm::RefitRegion* region = refit.model().refit_region();
  REQUIRE(region != nullptr);
  CHECK(region->training_ranges[0].min == 1);
  CHECK(region->training_ranges[1].max == 256);
  CHECK(region->training_ranges[2].min == 8);
  const std::vector<double> lone_long_source{1, 256, 2};
  CHECK(refit.model().predict_bytes(lone_long_source) == probed.predict_bytes(lone_long_source));
  CHECK(probed.predict_bytes(lone_long_source) > 8978464);
  // The probes' fit of the first microbatch's phase is kept, with its own formula.
  const nlohmann::json phase = refit.model().metadata().at("phases").at("without_gradients");
  CHECK(phase.at("formula").at("canonical") == probed.formula().canonical());
}

TEST_CASE("a step's first microbatch is lowered from the refit by what its phase lowered the probes' fit") {
  const MemoryModel probed = t5_model();
  TrainingRefit refit(probed);
  feed(refit, 9);
  REQUIRE(refit.refitted());
  // The first microbatch's phase as the Python sampler builds it: the probes' formula with the
  // phase's coefficients, without the floor (a step of several microbatches).
  nlohmann::json j = probed.to_json();
  j["coefficients"] = j["metadata"]["phases"]["without_gradients"]["coefficients"];
  j["floor_bytes"] = 0.0;
  const MemoryModel phase = MemoryModel::from_json(j);
  const xpm::StepPhaseModels clipped{&phase, nullptr, nullptr, nullptr};
  // What plan_step predicts a refit's phases beside: the model it was refitted from.
  const xpm::StepPhaseModels lowered = xpm::phases_beside(refit.model(), clipped);
  REQUIRE(lowered.fitted_with != nullptr);
  CHECK(lowered.fitted_with->to_json() == probed.to_json());
  // Over the later steps' first microbatches, which no fit saw: min(refit, phase) errs from
  // -2.87 % to +7.68 % (a spread of 10.6 points, the probes' own), the refit lowered by the
  // phase's gap -0.42 % to +5.68 % (6.1 points).
  double low[2] = {1e9, 1e9}, high[2] = {-1e9, -1e9};
  const auto steps = xpm_test::t5_training_steps();
  for (std::size_t s = 9; s < steps.size(); ++s)
    for (const TrainingPoint& point : steps[s]) {
      if (point.position != MicrobatchPosition::kFirst) continue;
      const double steady = refit.model().predict_bytes(point.dims);
      for (int k = 0; k < 2; ++k) {
        const double predicted = xpm::phase_predicted_bytes(steady, point.dims, MicrobatchPosition::kFirst,
                                                            k == 0 ? clipped : lowered);
        CHECK(predicted <= steady);  // the packing's invariant: a phase never predicts above steady
        low[k] = std::min(low[k], (predicted - point.peak_bytes) / point.peak_bytes);
        high[k] = std::max(high[k], (predicted - point.peak_bytes) / point.peak_bytes);
      }
    }
  CHECK(high[0] - low[0] > 0.10);
  CHECK(high[1] - low[1] < 0.065);
  CHECK(low[1] > -0.005);
}

TEST_CASE("the same points give the same refit, and a restored state goes on as the run it was taken from") {
  TrainingRefit first(t5_model()), second(t5_model());
  feed(first, 12);
  feed(second, 12);
  CHECK(first.model().to_json() == second.model().to_json());
  TrainingRefit halfway(t5_model()), resumed(t5_model());
  feed(halfway, 6);
  resumed.load_state(nlohmann::json::parse(halfway.state().dump()));  // as a checkpoint holds it
  const auto steps = xpm_test::t5_training_steps();
  for (std::size_t s = 6; s < steps.size(); ++s) {
    const auto a = halfway.end_step(static_cast<std::int64_t>(s), steps[s]);
    const auto b = resumed.end_step(static_cast<std::int64_t>(s), steps[s]);
    CHECK(a == b);
  }
  CHECK(halfway.model().to_json() == resumed.model().to_json());
  CHECK(halfway.state() == resumed.state());
}

TEST_CASE("a model whose errors a calibration line takes off is not refitted") {
  // Peaks 150,000 bytes + 3 % above the probes' model at every middle and last microbatch: a
  // line, which the calibration draws, leaves nothing for a refit to gain.
  const MemoryModel probed = t5_model();
  TrainingRefit refit(probed);
  auto steps = xpm_test::t5_training_steps();
  for (std::size_t s = 0; s < steps.size(); ++s) {
    for (TrainingPoint& point : steps[s]) point.peak_bytes = 150'000 + 1.03 * probed.predict_bytes(point.dims);
    CHECK_FALSE(refit.end_step(static_cast<std::int64_t>(s), steps[s]));
  }
  CHECK_FALSE(refit.refitted());
  CHECK(refit.model().to_json() == probed.to_json());
}

TEST_CASE("the calibration drawn anew over a refit's predictions is the one those predictions would have drawn") {
  TrainingRefit refit(t5_model());
  feed(refit, 12);
  REQUIRE(refit.refitted());
  const std::vector<xpm::CalibrationStep> steps = refit.calibration_steps({});
  REQUIRE(steps.size() == 12);
  CHECK(steps.front().run_first);
  xpm::Calibration redrawn(21'600'000), measured(21'600'000);
  redrawn.record_peak(1e7, 2e7);  // a step measured against the model before: forgotten
  redrawn.end_step(0, redrawn.step_row(1));
  const std::size_t lines = redrawn.log().size();
  redrawn.redraw(steps, "step 11: memory model refitted");
  for (const xpm::CalibrationStep& step : steps) {
    for (const xpm::CalibrationPoint& point : step.points)
      measured.record_peak(point.predicted_bytes, point.peak_bytes, point.position);
    measured.end_step(step.step, measured.step_row(step.step + 1));
  }
  CHECK(redrawn.correction() == measured.correction());
  CHECK(redrawn.state().window == measured.state().window);
  CHECK(redrawn.log().size() == lines + 1);  // its own log kept, the refit's line added
  CHECK(redrawn.log().back() == "step 11: memory model refitted");
}

TEST_CASE("bad points and options are refused, naming them") {
  CHECK_THROWS_WITH_AS(TrainingRefit(t5_model(), {0, 3, 0.01}), "TrainingRefit: window_steps must be >= 1, got 0",
                       std::invalid_argument);
  CHECK_THROWS_AS(TrainingRefit(t5_model(), {32, 0.5, 0.01}), std::invalid_argument);
  TrainingRefit refit(t5_model());
  CHECK_THROWS_WITH_AS(refit.end_step(0, {{{4, 100}, 1e7, MicrobatchPosition::kMiddle}}),
                       "TrainingRefit.end_step: a point has 2 dims, the formula 3 variables", std::invalid_argument);
  CHECK_THROWS_AS(refit.end_step(0, {{{4, 100, 20}, std::nan(""), MicrobatchPosition::kMiddle}}),
                  std::invalid_argument);
  CHECK_THROWS_WITH_AS(refit.load_state(nlohmann::json::parse(R"({"window": 3})")),
                       doctest::Contains("training refit state: "), std::invalid_argument);
}

TEST_CASE("a refit is tried again every window of steps seen, across epochs of fewer steps") {
  // 130 steps in epochs of 10: the peaks follow the model until step 60, then a law of another
  // shape. The points stop growing once the window (32 steps) is full, so only the tries every
  // 32 steps seen can take the refit; counted by the epoch's step index they never came.
  const MemoryModel model(xpm::CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}),
                          {4.0, 2000.0, 1e6}, 0, "bs");
  TrainingRefit refit(model);
  std::optional<std::size_t> taken;
  for (std::size_t seen = 0; seen < 130; ++seen) {
    std::vector<TrainingPoint> points;
    for (int k = 0; k < 4; ++k) {
      const double records = 2 + static_cast<double>((3 * k + seen) % 12), length = 40 + (37 * k + 11 * seen) % 200;
      const double peak = seen < 60 ? model.predict_bytes({records, length})
                                    : 6 * records * length * length + 1200 * records * length + 1.05e6;
      points.push_back({{records, length}, peak, xpm::microbatch_position(static_cast<std::size_t>(k), 4)});
    }
    if (refit.end_step(static_cast<std::int64_t>(seen % 10), points) && !taken) taken = seen;
  }
  REQUIRE(taken.has_value());
  CHECK(*taken >= 60);
  CHECK(*taken < 60 + 32 + 1);
  CHECK(refit.model().coefficients()[0] == doctest::Approx(6.0).epsilon(1e-6));
}

TEST_CASE("a state written for another model, or with values a refit cannot have, is refused") {
  TrainingRefit refit(t5_model());
  feed(refit, 12);
  const nlohmann::json state = refit.state();
  const MemoryModel other(xpm::CostFormula("a*bs*ls + b*bs*lt + c", {"a", "b", "c"}, {"bs", "ls", "lt"}),
                          {10.0, 10.0, 1e6}, 0, "bs");
  TrainingRefit elsewhere(other);
  CHECK_THROWS_WITH_AS(elsewhere.load_state(state),
                       doctest::Contains("training refit state: written for another memory model"),
                       std::invalid_argument);
  const auto refused = [&](const char* field, const nlohmann::json& value, const char* says) {
    nlohmann::json spoiled = state;
    spoiled[field] = value;
    TrainingRefit fresh(t5_model());
    CHECK_THROWS_WITH_AS(fresh.load_state(spoiled), doctest::Contains(says), std::invalid_argument);
    CHECK(fresh.state() == TrainingRefit(t5_model()).state());  // nothing changed
  };
  refused("next_try_points", -1, "next_try_points must be a whole number >= 0, got -1");
  refused("steps_seen", 2.5, "steps_seen must be a whole number >= 0, got 2.5");
  nlohmann::json negative = state["coefficients"];
  negative[negative.begin().key()] = -1e9;
  refused("coefficients", negative, "must be a finite number >= 0");
  nlohmann::json position = state;
  position["window"][1]["points"][0].back() = 1e10;
  TrainingRefit fresh(t5_model());
  CHECK_THROWS_WITH_AS(fresh.load_state(position), doctest::Contains("must be -1 or a position 0 to 3, got 1e+10"),
                       std::invalid_argument);
}

TEST_CASE("a refit's region takes in the run's first step's shapes only where the refit holds there") {
  // The model in force misses by shape (its quadratic term is half the truth). The run's first
  // step (no optimizer state: 300,000 bytes lower) holds a microbatch of 4-token records, the
  // later steps 32 to 128 tokens.
  const auto peak = [](double bs, double l) { return 40.0 * bs * l * l + 900.0 * bs * l + 2e6; };
  MemoryModel given(xpm::CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}), {20.0, 900.0, 2e6}, 0,
                    "bs", {{"l", xpm::DimAggregation::kMax}});
  const auto step_points = [&](std::vector<std::vector<double>> shapes, double offset_bytes, double short_factor) {
    std::vector<TrainingPoint> points;
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      const MicrobatchPosition position = k == 0 ? MicrobatchPosition::kFirst
                                                 : k + 1 == shapes.size() ? MicrobatchPosition::kLast
                                                                          : MicrobatchPosition::kMiddle;
      const double factor = shapes[k][1] < 32 ? short_factor : 1.0;
      points.push_back({shapes[k], factor * peak(shapes[k][0], shapes[k][1]) - offset_bytes, position});
    }
    return points;
  };
  // short_factor: what the 4-token microbatch of the run's first step peaks at, against the formula.
  const auto refitted_after = [&](double short_factor) {
    TrainingRefit refit(given);
    CHECK_FALSE(refit.end_step(0, step_points({{2, 128}, {3, 64}, {8, 4}, {2, 96}}, 300000, short_factor)));
    std::optional<std::string> line;
    for (std::int64_t s = 1; s <= 4 && !line; ++s)
      line = refit.end_step(s, step_points({{2, 128}, {3, 100 - 8.0 * static_cast<double>(s)},
                                            {4, 64 + static_cast<double>(s)}, {6, 48}, {8, 32}},
                                           0, 1.0));
    REQUIRE(line.has_value());
    REQUIRE(refit.model().refit_region() != nullptr);
    return refit;
  };
  // Where the refit, less the step's median excess (its optimizer state), predicts the step's
  // peaks, their shapes join the region: here down to 4 tokens.
  const TrainingRefit consistent = refitted_after(1.0);
  CHECK(consistent.model().refit_region()->training_ranges[1].min == 4);
  CHECK(consistent.model().predict_bytes({8, 4}) == doctest::Approx(peak(8, 4)).epsilon(1e-9));
  // Where it misses (that microbatch peaked 30 % above the formula, a shape the refit was not
  // fitted on), the shape stays out, and so does the first step's first microbatch (not fitted).
  const TrainingRefit refit = refitted_after(1.3);
  const xpm::RefitRegion* region = refit.model().refit_region();
  CHECK(region->training_ranges[1].min == 32);
  CHECK(region->training_ranges[1].max == 128);
  // Beyond it, the model given raised by the smaller of the refit's excess there (2,560 bytes: the
  // refit is exact) and at the nearest shape inside, (8, 32) (163,840 bytes).
  CHECK(refit.model().predict_bytes({8, 32}) - given.predict_bytes({8, 32}) == doctest::Approx(163840).epsilon(1e-6));
  CHECK(refit.model().predict_bytes({8, 4}) == doctest::Approx(peak(8, 4)).epsilon(1e-9));
}
