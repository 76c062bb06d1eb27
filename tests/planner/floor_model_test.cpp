// floor_model_test.cpp — the floor of a phase-aware model: constant when the optimizer-step
// peaks do not move, a fitted formula when they grow with the dims (floor_model.hpp).
#include <doctest/doctest.h>

#include <optional>
#include <string>
#include <vector>

#include "xpm/planner/floor_model.hpp"
#include "xpm/planner/memory_model.hpp"

using xpm::CostFormula;
using xpm::FloorFit;
using xpm::FloorOptions;
using xpm::Measurement;

namespace {

const CostFormula kFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"});

// Optimizer-step peaks at a bs x l grid from `peak`.
template <typename Peak>
std::vector<Measurement> peaks(Peak peak) {
  std::vector<Measurement> out;
  for (double bs : {1.0, 4.0, 16.0}) {
    for (double l : {16.0, 64.0, 128.0}) out.push_back({{bs, l}, peak(bs, l)});
  }
  return out;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("optimizer-step peaks that do not move give the largest one as a constant floor") {
  const FloorFit floor = xpm::fit_floor(kFormula, peaks([](double, double) { return 6.5e7; }), 4.9e7);
  CHECK_FALSE(floor.formula.has_value());
  CHECK(floor.constant_bytes == 6.5e7);
  CHECK(floor.spread == 0);
  CHECK(contains(floor.report, "floor: constant 6.5e+07 bytes"));
}

TEST_CASE("optimizer-step peaks that grow with bs*l get a fitted floor formula") {
  // Logits alive during the step: 192 bytes per token above 6.5e7.
  const auto growing = peaks([](double bs, double l) { return 6.5e7 + 192 * bs * l; });
  const FloorFit floor = xpm::fit_floor(kFormula, growing, 4.9e7);
  REQUIRE(floor.formula.has_value());
  CHECK(floor.formula->formula.canonical() == "floor_a*bs*l^2 + floor_b*bs*l + floor_c");
  CHECK(floor.formula->coefficients[0] == doctest::Approx(0).epsilon(1e-9));
  CHECK(floor.formula->coefficients[1] == doctest::Approx(192).epsilon(1e-6));
  CHECK(floor.formula->coefficients[2] == doctest::Approx(6.5e7).epsilon(1e-9));
  CHECK(floor.constant_bytes == 4.9e7);  // the static bytes stay a floor under the formula
  CHECK(floor.formula_max_rel_error < 1e-9);
  CHECK(floor.constant_max_rel_error > 0.005);  // (6.5e7 + 192*16*128) / 6.5e7 - 1
  CHECK(contains(floor.report, "floor: formula"));
  CHECK(contains(floor.report, "spread"));

  xpm::MemoryModel model(kFormula, {100, 20000, 4e7}, floor.constant_bytes, "bs");
  model.set_floor_formula(*floor.formula);
  // bs 32, l 8: the formula gives 4.5e7, the moving floor 6.5e7 + 49152.
  CHECK(model.predict_bytes({32, 8}) == doctest::Approx(6.5e7 + 192 * 256));
  CHECK(model.floor_bytes_at({32, 8}) == doctest::Approx(6.5e7 + 192 * 256));
  const xpm::MemoryModel read = xpm::MemoryModel::from_json(model.to_json());
  REQUIRE(read.floor_formula() != nullptr);
  CHECK(read.predict_bytes({32, 8}) == model.predict_bytes({32, 8}));
}

TEST_CASE("a floor formula of the user's, or a constant on request") {
  const auto growing = peaks([](double bs, double l) { return 6.5e7 + 192 * bs * l; });
  FloorOptions options;
  options.formula = "f + d*bs*l";
  const FloorFit custom = xpm::fit_floor(kFormula, growing, 0, options);
  REQUIRE(custom.formula.has_value());
  CHECK(custom.formula->formula.coefficient_names() == std::vector<std::string>{"f", "d"});
  CHECK(custom.formula->coefficients[1] == doctest::Approx(192).epsilon(1e-6));
  options = {};
  options.mode = xpm::FloorMode::kConstant;
  const FloorFit constant = xpm::fit_floor(kFormula, growing, 0, options);
  CHECK_FALSE(constant.formula.has_value());
  CHECK(constant.constant_bytes == doctest::Approx(6.5e7 + 192 * 16 * 128));
}

TEST_CASE("a non-linear model formula gets floor_d times every variable plus floor_f") {
  const CostFormula with_max("max(a*bs*l^2, b*bs*l) + c", {"a", "b", "c"}, {"bs", "l"});
  CHECK(xpm::floor_formula_for(with_max, {}).canonical() == "floor_d*bs*l + floor_f");
}

TEST_CASE("floor options and modes reject bad values") {
  FloorOptions options;
  options.constant_spread = -1;
  CHECK_THROWS_AS(options.validate(), std::invalid_argument);
  CHECK_THROWS_WITH_AS(xpm::parse_floor_mode("moving", "--floor-model"),
                       "--floor-model must be 'auto', 'constant' or 'formula', got 'moving'", std::invalid_argument);
  CHECK(xpm::parse_floor_mode("auto", "--floor-model") == xpm::FloorMode::kAutomatic);
  CHECK(xpm::to_string(xpm::FloorMode::kFormula) == "formula");
  CHECK_THROWS_AS(xpm::fit_floor(kFormula, {}, 0), std::invalid_argument);
}

TEST_CASE("a plateau of the peaks: two or more within 1 % of the smallest, above the floor") {
  const std::vector<double> peaks = {1'200'004, 1'337'920, 1'200'016, 1'675'840, 1'200'064};
  const std::optional<xpm::PeakPlateau> plateau = xpm::find_peak_plateau(peaks, 1'005'000);
  REQUIRE(plateau.has_value());
  CHECK(plateau->floor_bytes == 1'200'004);
  CHECK(plateau->top_bytes == doctest::Approx(1'212'004.04));
  CHECK(plateau->measurements == 3);
  // None at or below the floor, with one peak alone near the smallest, or without peaks.
  CHECK_FALSE(xpm::find_peak_plateau(peaks, 1'200'004).has_value());
  CHECK_FALSE(xpm::find_peak_plateau({1'200'004, 1'337'920, 1'675'840}, 1'005'000).has_value());
  CHECK_FALSE(xpm::find_peak_plateau({}, 0).has_value());
}

TEST_CASE("a fit over the plateau is kept when it misses the step peaks least, or ties within rounding") {
  CHECK(xpm::plateau_fit_kept(0.03, 0.04));
  CHECK_FALSE(xpm::plateau_fit_kept(0.04, 0.03));
  // A T5's two fits: the same worst shape, predicted alike but for the last digits.
  CHECK(xpm::plateau_fit_kept(0.03865193016253439, 0.03865193016253404));
  CHECK_FALSE(xpm::plateau_fit_kept(0.0386520, 0.0386519));
  const xpm::PeakPlateau plateau{6340180, 6403581.8, 2};
  CHECK(xpm::plateau_floor_report(plateau, 4691084) ==
        "floor: the plateau of the forward/backward peaks, 6340180 bytes (2 probes within 1 % of the smallest, not "
        "fitted), above the optimizer-step peaks' 4691084 bytes");
}
