// fit_test.cpp — fit_coefficients: recovery, bounds, input validation, reports.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

using xpm::CostFormula;
using xpm::FitOptions;
using xpm::FitResult;
using xpm::Measurement;

namespace {

CostFormula quadratic() { return CostFormula("a*bs*l^2 + b*bs*l + c", {"a", "b", "c"}, {"bs", "l"}); }

// Exact measurements of a*bs*l^2 + b*bs*l + c on a bs x l grid.
std::vector<Measurement> exact_grid(double a, double b, double c) {
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) {
    for (double l : {16.0, 64.0, 128.0, 256.0}) {
      m.push_back({{bs, l}, a * bs * l * l + b * bs * l + c});
    }
  }
  return m;
}

std::string message_of(const std::vector<Measurement>& m, const FitOptions& options = {}) {
  try {
    xpm::fit_coefficients(quadratic(), m, options);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("fit recovers known coefficients from exact synthetic data") {
  const double a = 3.5, b = 1200.0, c = 2.0e8;
  const FitResult r = xpm::fit_coefficients(quadratic(), exact_grid(a, b, c));
  REQUIRE(r.coefficients.size() == 3);
  CHECK(r.coefficients[0] == doctest::Approx(a).epsilon(1e-6));
  CHECK(r.coefficients[1] == doctest::Approx(b).epsilon(1e-6));
  CHECK(r.coefficients[2] == doctest::Approx(c).epsilon(1e-6));
  CHECK(r.summary.converged);
  CHECK(r.summary.max_rel_error < 1e-9);
  CHECK(r.summary.mean_rel_error <= r.summary.max_rel_error);
  CHECK(r.summary.rel_errors.size() == 16);
  CHECK_FALSE(r.summary.solver_report.empty());
}

TEST_CASE("fit recovers coefficients that differ by many orders of magnitude") {
  // Column scaling keeps a 1e-3 coefficient next to a 1e9 one well conditioned.
  const double a = 1e-3, b = 7.0, c = 1e9;
  const FitResult r = xpm::fit_coefficients(quadratic(), exact_grid(a, b, c));
  CHECK(r.coefficients[0] == doctest::Approx(a).epsilon(1e-6));
  CHECK(r.coefficients[1] == doctest::Approx(b).epsilon(1e-6));
  CHECK(r.coefficients[2] == doctest::Approx(c).epsilon(1e-6));
}

TEST_CASE("fitted prediction matches the formula computed by hand") {
  const FitResult r = xpm::fit_coefficients(quadratic(), exact_grid(2.0, 300.0, 5e7));
  const double a = r.coefficients[0], b = r.coefficients[1], c = r.coefficients[2];
  const double bs = 6, l = 100;
  const double by_hand = a * bs * l * l + b * bs * l + c;
  CHECK(quadratic().predict(r.coefficients, {bs, l}) == doctest::Approx(by_hand).epsilon(1e-12));
  CHECK(by_hand == doctest::Approx(2.0 * 6 * 100 * 100 + 300.0 * 6 * 100 + 5e7).epsilon(1e-6));
}

TEST_CASE("fit keeps every coefficient non-negative when the data wants a negative one") {
  // Exact data of a*bs*l^2 - 500*bs*l + c: the unconstrained fit would give b = -500.
  const std::vector<Measurement> m = exact_grid(4.0, -500.0, 1e8);
  const FitResult bounded = xpm::fit_coefficients(quadratic(), m);
  for (double coefficient : bounded.coefficients) CHECK(coefficient >= 0.0);
  CHECK(bounded.coefficients[1] < 1e-3);  // pushed to its bound (0), not -500
  CHECK(bounded.summary.max_rel_error > 0.0);

  FitOptions free;
  free.non_negative = false;
  const FitResult unbounded = xpm::fit_coefficients(quadratic(), m, free);
  CHECK(unbounded.coefficients[1] == doctest::Approx(-500.0).epsilon(1e-6));
}

TEST_CASE("fit includes constant terms without a coefficient in the prediction") {
  const CostFormula f("a*bs*l + 1000", {"a"}, {"bs", "l"});
  std::vector<Measurement> m;
  for (double bs : {1.0, 3.0}) m.push_back({{bs, 10.0}, 7.0 * bs * 10.0 + 1000.0});
  const FitResult r = xpm::fit_coefficients(f, m);
  CHECK(r.coefficients[0] == doctest::Approx(7.0).epsilon(1e-9));
}

TEST_CASE("fit rejects fewer measurements than coefficients") {
  std::vector<Measurement> m = exact_grid(1, 1, 1);
  m.resize(2);
  const std::string msg = message_of(m);
  CHECK(msg.find("2 measurements") != std::string::npos);
  CHECK(msg.find("3 coefficients") != std::string::npos);
}

TEST_CASE("fit rejects non-positive or non-finite bytes naming the measurement index") {
  std::vector<Measurement> m = exact_grid(1, 1, 1);
  m[5].bytes = -12;
  std::string msg = message_of(m);
  CHECK(msg.find("measurement 5") != std::string::npos);
  CHECK(msg.find("-12") != std::string::npos);

  m = exact_grid(1, 1, 1);
  m[7].bytes = 0;
  CHECK(message_of(m).find("measurement 7") != std::string::npos);

  m = exact_grid(1, 1, 1);
  m[3].bytes = std::nan("");
  CHECK(message_of(m).find("measurement 3") != std::string::npos);
}

TEST_CASE("fit rejects a measurement with the wrong number of dims naming its index") {
  std::vector<Measurement> m = exact_grid(1, 1, 1);
  m[9].dims = {4.0};
  const std::string msg = message_of(m);
  CHECK(msg.find("measurement 9") != std::string::npos);
  CHECK(msg.find("expected 2") != std::string::npos);
}

TEST_CASE("fit rejects a coefficient whose term is zero at every measurement, naming it") {
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0}) m.push_back({{bs, 0.0}, 100.0 * bs});  // l = 0 everywhere
  const CostFormula f("a*bs + b*bs*l", {"a", "b"}, {"bs", "l"});
  CHECK_THROWS_WITH_AS(xpm::fit_coefficients(f, m), doctest::Contains("'b'"),
                       std::invalid_argument);
}

TEST_CASE("fit options reject a non-positive iteration count and negative tolerances") {
  FitOptions o;
  o.max_iterations = 0;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("max_iterations"), std::invalid_argument);
  o = FitOptions{};
  o.function_tolerance = -1;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("function_tolerance"),
                       std::invalid_argument);
  CHECK(message_of(exact_grid(1, 1, 1), o).find("function_tolerance") != std::string::npos);
}

TEST_CASE("brief report says whether the fit converged and gives the errors") {
  const FitResult r = xpm::fit_coefficients(quadratic(), exact_grid(1.0, 2.0, 3e6));
  const std::string report = r.summary.brief_report();
  CHECK(report.find("converged") != std::string::npos);
  CHECK(report.find("16 points") != std::string::npos);
  CHECK(report.find("max relative error") != std::string::npos);
  CHECK(report.find('\n') == std::string::npos);
}
