// calibration_test.cpp — the calibration's line over measured peaks, its raising and lowering,
// its agreement over ranks' rows and its state.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <random>
#include <stdexcept>
#include <vector>

#include "xpm/planner/calibration.hpp"

using xpm::Calibration;
using xpm::CalibrationOptions;
using xpm::Correction;

namespace {

constexpr std::int64_t kBudget = 6'000'000;

std::optional<std::string> end_alone(Calibration& calibration, std::int64_t step) {
  return calibration.end_step(step, calibration.step_row(step + 1));
}

}  // namespace

TEST_CASE("the line over the peaks corrects a constant and a share of the prediction") {
  struct Case {
    std::function<double(double)> missed;
    double intercept_bytes, slope;
  };
  for (const Case& c : {Case{[](double p) { return 0.02 * p; }, 0.0, 0.0225},
                        Case{[](double) { return 150'000.0; }, 150'000.0, 0.0025},
                        Case{[](double p) { return 50'000.0 + 0.01 * p; }, 50'000.0, 0.0125}}) {
    Calibration calibration(kBudget);
    const std::vector<double> predictions{500'000, 1'200'000, 2'500'000, 4'000'000};
    for (int step = 0; step < 3; ++step) {
      for (double p : predictions) calibration.record_peak(p, p + c.missed(p));
      end_alone(calibration, step);
    }
    const Correction& correction = calibration.correction();
    CHECK(correction.slope == doctest::Approx(c.slope));
    CHECK(std::fabs(correction.intercept_bytes - c.intercept_bytes) <= 1.0);
    for (double p : predictions) {
      const double corrected = p + correction.bytes_for(p), peak = p + c.missed(p);
      CHECK((corrected - peak) / peak >= -1e-12);
      CHECK((corrected - peak) / peak < 0.003);
    }
  }
}

TEST_CASE("a peak that is not a number of bytes is refused; an empty microbatch is skipped") {
  Calibration calibration(kBudget);
  CHECK_THROWS_WITH_AS(calibration.record_peak(1e6, std::nan("")),
                       "Calibration.record_peak: peak_bytes must be a finite number of bytes >= 0, got nan",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(calibration.record_peak(-1.0, 1e6), doctest::Contains("predicted_bytes must be"),
                       std::invalid_argument);
  calibration.record_peak(0, 1e6);
  CHECK(calibration.measured_microbatches() == 0);
  CHECK_THROWS_WITH_AS(Calibration(kBudget, CalibrationOptions{32, 0, {}}),
                       "Calibration: settle_steps must be a whole number >= 1, got 0", std::invalid_argument);
}

TEST_CASE("a higher line is taken at once, a lower one once the window settles under it") {
  Calibration calibration(kBudget, CalibrationOptions{4, 3, {}});
  calibration.record_peak(1'000'000, 1'000'000);
  end_alone(calibration, 0);  // the run's first step
  calibration.record_peak(1'000'000, 1'100'000);
  CHECK(end_alone(calibration, 1).has_value());  // 100,000 bytes over
  const Correction raised = calibration.correction();
  CHECK(raised.bytes_for(1'000'000) >= 100'000);
  std::vector<bool> changed;
  for (int step = 2; step < 7; ++step) {
    calibration.record_peak(1'000'000, 1'010'000);
    changed.push_back(end_alone(calibration, step).has_value());
  }
  // Settled at step 3, but the window of 4 holds step 1 until step 5: lower then, once.
  CHECK(changed == std::vector<bool>{false, false, false, true, false});
  CHECK(calibration.correction().bytes_for(1'000'000) >= 10'000);
  CHECK(calibration.correction().bytes_for(1'000'000) < raised.bytes_for(1'000'000));
  CHECK(calibration.log().size() == 2);
  CHECK(calibration.log()[0].rfind("step 1: correction +0.0 % -> +", 0) == 0);
}

TEST_CASE("an over-prediction is lowered after a step with 1 % more headroom, fully once settled; logged") {
  Calibration calibration(kBudget, CalibrationOptions{32, 2, {}});
  calibration.record_peak(2'000'000, 2'000'000);
  end_alone(calibration, 0);
  CHECK(calibration.correction() == Correction{});
  std::vector<std::optional<std::string>> lines;
  for (int step : {1, 2, 3}) {
    calibration.record_peak(2'000'000, 1'700'000);  // 15 % over-predicted
    lines.push_back(end_alone(calibration, step));
  }
  REQUIRE(lines[0].has_value());
  CHECK(*lines[0] == "step 1: correction +0.0 % -> -3.7 % of the budget (-300,000 bytes + 1.25 % of the prediction)");
  REQUIRE(lines[1].has_value());
  CHECK(*lines[1] == "step 2: correction -3.7 % -> -4.7 % of the budget (-300,000 bytes + 0.25 % of the prediction)");
  CHECK_FALSE(lines[2].has_value());
  CHECK(calibration.correction().bytes_for(2'000'000) == doctest::Approx(-300'000).epsilon(0.02));
}

TEST_CASE("ranks agree by a MAX over their rows: the same correction on each, the latest replan step") {
  Calibration a(kBudget), b(kBudget);
  a.record_peak(1'000'000, 1'050'000);
  b.record_peak(3'000'000, 3'000'000);
  std::vector<double> row_a = a.step_row(4), row_b = b.step_row(6), agreed(row_a.size());
  REQUIRE(row_a.size() == Calibration::row_size());
  for (std::size_t i = 0; i < agreed.size(); ++i) agreed[i] = std::max(row_a[i], row_b[i]);
  a.end_step(3, agreed);
  b.end_step(3, agreed);
  CHECK(a.correction() == b.correction());
  CHECK(a.replan_from() == 6);
  CHECK(b.replan_from() == 6);
  CHECK(a.correction().bytes_for(1'000'000) >= 50'000);

  Calibration other(kBudget - 1);
  std::vector<double> mixed = a.step_row(7), row_c = other.step_row(7);
  for (std::size_t i = 0; i < mixed.size(); ++i) mixed[i] = std::max(mixed[i], row_c[i]);
  CHECK_THROWS_WITH_AS(a.end_step(7, mixed), doctest::Contains("the ranks plan under different budgets"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(a.end_step(7, {1.0}), doctest::Contains("the agreed row holds 1 numbers"),
                       std::invalid_argument);
}

TEST_CASE("a state restores the correction and its window; a malformed one changes nothing") {
  Calibration calibration(kBudget, CalibrationOptions{32, 2, {}});
  for (int step = 0; step < 4; ++step) {
    calibration.record_peak(2'000'000, 1'900'000 + 50'000.0 * step);
    end_alone(calibration, step);
  }
  Calibration resumed(kBudget, CalibrationOptions{32, 2, {}});
  resumed.load_state(calibration.state());
  calibration.record_peak(2'000'000, 2'200'000);
  resumed.record_peak(2'000'000, 2'200'000);
  CHECK(end_alone(calibration, 4) == end_alone(resumed, 4));
  CHECK(calibration.correction() == resumed.correction());

  xpm::CalibrationState bad = calibration.state();
  bad.window.push_back({1.0, 2.0});
  CHECK_THROWS_WITH_AS(resumed.load_state(bad), doctest::Contains("calibration state: window rows of another shape"),
                       std::invalid_argument);
  CHECK(calibration.correction() == resumed.correction());
}

TEST_CASE("covering_correction: the line over one set of points, none without points") {
  const Correction gap = xpm::covering_correction({1e6, 2e6, 4e6}, {1.2e6, 2.2e6, 4.2e6}, 8e6);
  CHECK(gap.intercept_bytes == doctest::Approx(200'000));
  CHECK(gap.slope == doctest::Approx(0.0025));
  CHECK(xpm::covering_correction({0.0}, {1e6}, 8e6) == Correction{});
  CHECK_THROWS_AS(xpm::covering_correction({1e6}, {}, 8e6), std::invalid_argument);
}

TEST_CASE("a microbatch's position in its step: first, middle, last, or alone; named both ways") {
  using xpm::MicrobatchPosition;
  CHECK(xpm::microbatch_position(0, 1) == MicrobatchPosition::kAlone);
  CHECK(xpm::microbatch_position(0, 3) == MicrobatchPosition::kFirst);
  CHECK(xpm::microbatch_position(1, 3) == MicrobatchPosition::kMiddle);
  CHECK(xpm::microbatch_position(2, 3) == MicrobatchPosition::kLast);
  CHECK_THROWS_AS(xpm::microbatch_position(3, 3), std::invalid_argument);
  CHECK(xpm::to_string(MicrobatchPosition::kLast) == "last");
  CHECK(xpm::parse_microbatch_position("middle", "position") == MicrobatchPosition::kMiddle);
  CHECK_THROWS_WITH_AS(xpm::parse_microbatch_position("end", "position"),
                       "position must be 'first', 'middle', 'last' or 'alone', got 'end'", std::invalid_argument);
}

TEST_CASE("each position draws a line of its own; plans fit every line") {
  // The model over-predicts a step's first microbatch by 1 % and misses 280,000 bytes in its
  // last (the optimizer step's temporaries): one line over both over-corrects the small last
  // microbatches' neighbours and under-corrects a large last one.
  using xpm::MicrobatchPosition;
  Calibration calibration(kBudget);
  for (int step = 0; step < 3; ++step) {
    calibration.record_peak(5'000'000, 4'950'000, MicrobatchPosition::kFirst);
    calibration.record_peak(1'200'000 + 100'000.0 * step, 1'480'000 + 100'000.0 * step, MicrobatchPosition::kLast);
    end_alone(calibration, step);
  }
  const Correction c = calibration.correction();
  REQUIRE(c.positions[static_cast<std::size_t>(MicrobatchPosition::kFirst)].has_value());
  REQUIRE(c.positions[static_cast<std::size_t>(MicrobatchPosition::kLast)].has_value());
  CHECK_FALSE(c.positions[static_cast<std::size_t>(MicrobatchPosition::kMiddle)].has_value());
  CHECK(c.bytes_for(5'000'000, MicrobatchPosition::kFirst) == 0);  // over-predicted: not lowered before settling
  const double last = c.bytes_for(1'300'000, MicrobatchPosition::kLast);
  CHECK(last >= 280'000);
  CHECK((1'300'000 + last) / 1'580'000 - 1 < 0.01);
  CHECK(c.bytes_for(5'000'000, MicrobatchPosition::kLast) >= 280'000);  // a large last one too
  CHECK(c.bytes_for(5'000'000, MicrobatchPosition::kMiddle) == c.bytes_for(5'000'000));  // none: the line
  // A position's line holds for the predictions it measured; outside them the larger of the two
  // (below them, the common line no higher than at their smallest).
  CHECK(c.positions[2]->low_bytes == 1'200'000);
  CHECK(c.positions[2]->high_bytes == 1'400'000);
  CHECK(c.bytes_for(1'000'000, MicrobatchPosition::kFirst) ==
        std::max(0.0, std::min(c.bytes_for(1'000'000), c.bytes_for(5'000'000))));
  CHECK(c.bytes_for(1'000'000, MicrobatchPosition::kFirst) > 0);
  CHECK(c.bytes_for(6'000'000, MicrobatchPosition::kFirst) == std::max(0.0, c.bytes_for(6'000'000)));
  const double usable = static_cast<double>(kBudget);
  CHECK(c.planning_bytes(usable) <= Correction{c.intercept_bytes, c.slope}.planning_bytes(usable));
  CHECK(c.planning_bytes(usable) <= (usable - 280'000) / (1 + c.positions[2]->slope));
  const std::vector<std::string>& log = calibration.log();
  CHECK(std::any_of(log.begin(), log.end(), [](const std::string& line) {
    return line.find("the last microbatch's correction +0.0 % -> ") != std::string::npos;
  }));

  // The state keeps the positions' lines and windows; one written without positions still loads.
  const nlohmann::json saved = xpm::to_json(calibration.state());
  CHECK(saved.at("positions").contains("last"));
  Calibration resumed(kBudget);
  resumed.load_state(xpm::calibration_state_from_json(saved));
  CHECK(resumed.correction() == calibration.correction());
  calibration.record_peak(1'400'000, 1'900'000, MicrobatchPosition::kLast);
  resumed.record_peak(1'400'000, 1'900'000, MicrobatchPosition::kLast);
  CHECK(end_alone(calibration, 3) == end_alone(resumed, 3));
  nlohmann::json older = saved;
  older.erase("positions");
  Calibration from_older(kBudget);
  from_older.load_state(xpm::calibration_state_from_json(older));
  CHECK(from_older.correction() == Correction{c.intercept_bytes, c.slope});
  older["positions"] = {{"end", {{"correction", nullptr}, {"window", nlohmann::json::array()}}}};
  CHECK_THROWS_WITH_AS(xpm::calibration_state_from_json(older),
                       doctest::Contains("calibration state: positions' key must be 'first'"), std::invalid_argument);
}

TEST_CASE("a position's line lowers with 1 % more headroom until settle_steps steps of its own, and lapses") {
  using xpm::MicrobatchPosition;
  constexpr auto kFirst = static_cast<std::size_t>(MicrobatchPosition::kFirst);
  Calibration calibration(kBudget, CalibrationOptions{4, 3, {}});
  for (int step = 0; step < 6; ++step) {  // the window full of middle microbatches, as predicted
    calibration.record_peak(2'000'000, 2'000'000, MicrobatchPosition::kMiddle);
    end_alone(calibration, step);
  }
  std::vector<double> first_corrections;
  for (int step = 6; step < 9; ++step) {  // first microbatches 10 % over-predicted
    calibration.record_peak(3'000'000, 2'700'000, MicrobatchPosition::kFirst);
    end_alone(calibration, step);
    first_corrections.push_back(calibration.correction().bytes_for(3'000'000, MicrobatchPosition::kFirst));
  }
  // Two steps of its own are not settled (settle_steps 3), whatever the common window holds:
  // lowered with 1.25 % of the prediction as headroom, then 0.25 %.
  CHECK(first_corrections[0] == doctest::Approx(-300'000 + 0.0125 * 3'000'000));
  CHECK(first_corrections[1] == doctest::Approx(-300'000 + 0.0125 * 3'000'000));
  CHECK(first_corrections[2] == doctest::Approx(-300'000 + 0.0025 * 3'000'000));
  CHECK(calibration.correction().positions[kFirst]->low_bytes == 3'000'000);
  for (int step = 9; step < 13; ++step) {  // no first microbatch for a whole window
    calibration.record_peak(2'000'000, 2'000'000, MicrobatchPosition::kMiddle);
    end_alone(calibration, step);
  }
  CHECK_FALSE(calibration.correction().positions[kFirst].has_value());
  CHECK(calibration.correction().bytes_for(3'000'000, MicrobatchPosition::kFirst) ==
        calibration.correction().bytes_for(3'000'000));
}

TEST_CASE("a position's line: its own in its range, outside it the larger of the two, the common capped below") {
  constexpr auto kLast = xpm::MicrobatchPosition::kLast;
  // Accelerate's test: large microbatches over-predicted and small last ones under tilt the
  // common line down; below the last microbatches' range it grows no further than at its low end.
  Correction tilted{31'692, -0.01, {}};
  tilted.positions[static_cast<std::size_t>(kLast)] = xpm::CorrectionLine{10'256, 0.005, 1'374'005, 1'432'373};
  CHECK(tilted.bytes_for(1'400'000, kLast) == doctest::Approx(10'256 + 7'000));
  CHECK(tilted.bytes_for(473'484, kLast) == doctest::Approx(31'692 - 13'740.05));  // not 26,957
  CHECK(tilted.bytes_for(473'484, xpm::MicrobatchPosition::kFirst) == doctest::Approx(31'692 - 4'734.84));
  CHECK(tilted.bytes_for(3'000'000, kLast) == doctest::Approx(std::max(10'256 + 15'000, 31'692 - 30'000)));
  // Its own line extrapolates as it is: a last microbatch whose peak is the optimizer step's
  // needs more the smaller its prediction.
  Correction falling{10'000, 0.0, {}};
  falling.positions[static_cast<std::size_t>(kLast)] = xpm::CorrectionLine{200'000, -0.01, 10'000'000, 20'000'000};
  CHECK(falling.bytes_for(5'000'000, kLast) == doctest::Approx(150'000));
  Correction rising{50'000, 0.0, {}};
  rising.positions[static_cast<std::size_t>(kLast)] = xpm::CorrectionLine{5'000, 0.01, 1'000'000, 2'000'000};
  CHECK(rising.bytes_for(500'000, kLast) == doctest::Approx(50'000));
  CHECK(rising.bytes_for(3'000'000, kLast) == doctest::Approx(50'000));
  CHECK(rising.planning_bytes(1e7) == doctest::Approx(std::min(1e7 - 50'000, (1e7 - 5'000) / 1.01)));
}

TEST_CASE("a lowering line outside its range takes off no larger a share than at its nearest end") {
  using xpm::MicrobatchPosition;
  // TRL's SFTTrainer (chunked loss): every microbatch over-predicted by 7.5 to 9.4 %, each
  // position's line drawn over one step's microbatch.
  Correction sft{-1'792'588, -0.0475, {}};
  const xpm::CorrectionLine last{-5'962'060, 0.0025, 83'389'448, 83'389'448};
  const xpm::CorrectionLine first{-14'029'049, 0.0025, 164'881'656, 164'881'656};
  sft.positions[static_cast<std::size_t>(MicrobatchPosition::kLast)] = last;
  sft.positions[static_cast<std::size_t>(MicrobatchPosition::kFirst)] = first;
  // Below its range: its share at the low end (-6.9 %), not the constant (-18.7 % of 31.5 MB).
  const double last_share = (last.intercept_bytes + last.slope * last.high_bytes) / last.high_bytes;
  CHECK(sft.bytes_for(31'514'365, MicrobatchPosition::kLast) == doctest::Approx(last_share * 31'514'365));
  // Above its range: its own line (-8.07 % here), not the common one that mixes in the last
  // microbatches' smaller over-prediction (-5.8 %).
  CHECK(sft.bytes_for(168'603'001, MicrobatchPosition::kFirst) ==
        doctest::Approx(first.intercept_bytes + first.slope * 168'603'001));
  // A line that falls faster than the prediction keeps its share above its range, and plans fit it.
  Correction falling{-1'000'000, 0.0, {}};
  falling.positions[static_cast<std::size_t>(MicrobatchPosition::kFirst)] =
      xpm::CorrectionLine{20'000, -0.05, 1'000'000, 2'000'000};
  CHECK(falling.bytes_for(4'000'000, MicrobatchPosition::kFirst) == doctest::Approx(-0.04 * 4'000'000));
  CHECK(falling.planning_bytes(1e7) == doctest::Approx(1e7 / 0.96));
}

TEST_CASE("a plan at planning_bytes fits the budget at every position, whatever the lines and their ranges") {
  // Lines of either sign on the slope grid, ranges below, around and above the budget: the
  // largest prediction planned, and any smaller, stays within the budget once corrected.
  using xpm::MicrobatchPosition;
  constexpr double kUsable = 1e9;
  std::mt19937 random(1);
  const auto uniform = [&random](double low, double high) {
    return std::uniform_real_distribution<double>(low, high)(random);
  };
  const std::vector<double>& slopes = xpm::correction_slopes();
  const auto slope = [&] { return slopes[std::uniform_int_distribution<std::size_t>(0, slopes.size() - 1)(random)]; };
  std::size_t checked = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    Correction c{uniform(-0.3, 0.3) * kUsable, slope(), {}};
    for (std::size_t p = 0; p < xpm::kMicrobatchPositions; ++p) {
      if (uniform(0, 1) < 0.5) continue;
      const double low = uniform(0.01, 2.0) * kUsable;
      const double scale = std::array<double, 3>{1, 0.1, 0.01}[static_cast<std::size_t>(trial) % 3];
      c.positions[p] = xpm::CorrectionLine{uniform(-0.3, 0.3) * kUsable * scale, slope(), low, low * uniform(1, 1.5)};
    }
    const double planned = c.planning_bytes(kUsable);
    for (int k = 1; k <= 40; ++k) {
      const double predicted = planned * k / 40;
      for (std::size_t p = 0; p < xpm::kMicrobatchPositions; ++p) {
        const double corrected = predicted + c.bytes_for(predicted, static_cast<MicrobatchPosition>(p));
        REQUIRE(std::isfinite(corrected));
        CHECK(corrected <= kUsable * (1 + 1e-12));
        ++checked;
      }
    }
  }
  CHECK(checked == 2000 * 40 * 4);
  // Examples it found: a rising line that goes negative above its range, and a lowering one
  // whose range lies above the budget.
  Correction falling_last{0, -0.05, {}};
  falling_last.positions[static_cast<std::size_t>(MicrobatchPosition::kLast)] =
      xpm::CorrectionLine{5e6, -0.05, 5e7, 1e8};
  const double p1 = falling_last.planning_bytes(kUsable);
  CHECK(p1 + falling_last.bytes_for(p1, MicrobatchPosition::kLast) <= kUsable * (1 + 1e-12));
  Correction high_range{-5e8, 0, {}};
  high_range.positions[static_cast<std::size_t>(MicrobatchPosition::kFirst)] =
      xpm::CorrectionLine{-1e8, 0.05, 1.5e9, 2.5e9};
  const double p2 = high_range.planning_bytes(kUsable);
  CHECK(p2 + high_range.bytes_for(p2, MicrobatchPosition::kFirst) <= kUsable * (1 + 1e-12));
}

TEST_CASE("steps without a point of the common line do not settle it") {
  using xpm::MicrobatchPosition;
  Calibration calibration(kBudget);  // settle_steps 8
  calibration.record_peak(2'000'000, 2'000'000, MicrobatchPosition::kFirst);
  end_alone(calibration, 0);
  for (int step = 1; step < 8; ++step) {  // steps of one microbatch: the alone line's points only
    calibration.record_peak(1'000'000, 1'000'000, MicrobatchPosition::kAlone);
    end_alone(calibration, step);
  }
  calibration.record_peak(2'000'000, 1'700'000, MicrobatchPosition::kFirst);  // 15 % over-predicted
  end_alone(calibration, 8);
  // One step of points: lowered with the early headroom, not as drawn.
  CHECK(calibration.correction().bytes_for(2'000'000) == doctest::Approx(-300'000 + 0.0125 * 2'000'000));
}

TEST_CASE("an alone microbatch's point draws the alone line only, not the common one") {
  using xpm::MicrobatchPosition;
  Calibration calibration(kBudget);
  for (int step = 0; step < 2; ++step) {
    calibration.record_peak(4'000'000, 4'000'000, MicrobatchPosition::kFirst);
    calibration.record_peak(3'000'000, 3'000'000, MicrobatchPosition::kLast);
    end_alone(calibration, step);
  }
  calibration.record_peak(2'000'000, 2'300'000, MicrobatchPosition::kAlone);  // 15 % under
  end_alone(calibration, 2);
  const Correction& c = calibration.correction();
  REQUIRE(c.positions[static_cast<std::size_t>(MicrobatchPosition::kAlone)].has_value());
  CHECK(c.bytes_for(2'000'000, MicrobatchPosition::kAlone) >= 300'000);
  CHECK(c.bytes_for(2'000'000) == 0);  // the common line did not move
  CHECK(c.bytes_for(2'000'000, MicrobatchPosition::kLast) == 0);
  CHECK(c.planning_bytes(kBudget) < kBudget - 300'000);  // plans fit the alone line too
}
