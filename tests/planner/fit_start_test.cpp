// fit_start_test.cpp — the automatic start of non-linear fits (planner/src/fit_start.hpp):
// exponents and max() recovered without FitOptions::initial_values.
#include <doctest/doctest.h>

#include <algorithm>
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

xpm::CostFormulaOptions nonlinear() {
  xpm::CostFormulaOptions options;
  options.allow_nonlinear = true;
  return options;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// Peaks of a*bs*l^p + c on a bs x l grid (3.6e6 to 1.6e8 bytes for the values below).
std::vector<Measurement> power_grid(double a, double p, double c) {
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) {
    for (double l : {16.0, 64.0, 128.0, 256.0, 512.0}) {
      m.push_back({{bs, l}, a * bs * std::pow(l, p) + c});
    }
  }
  return m;
}

}  // namespace

TEST_CASE("a fitted exponent is recovered within 1e-3 with no initial values") {
  const CostFormula f("a*bs*l^p + c", {"a", "c", "p"}, {"bs", "l"}, nonlinear());
  const double a = 500.0, p = 1.7, c = 3.5e6;
  const FitResult r = xpm::fit_coefficients(f, power_grid(a, p, c));
  CHECK(std::abs(r.coefficients[2] - p) < 1e-3);
  CHECK(r.coefficients[0] == doctest::Approx(a).epsilon(1e-3));
  CHECK(r.coefficients[1] == doctest::Approx(c).epsilon(1e-3));
  CHECK(r.summary.usable);
  CHECK(r.summary.max_rel_error < 1e-6);
  CHECK(contains(r.summary.start, "automatic"));
  CHECK(contains(r.summary.start, "p = 1.7 by grid search"));
  CHECK(contains(r.summary.start, "a and c by non-negative least squares"));
}

TEST_CASE("the automatic start fits max() formulas that the plain start does not") {
  // From 1 for every coefficient, the argument of max() that starts behind never wins at any
  // probe, so its coefficients get no gradient: the plain start stays stuck there.
  FitOptions plain;
  plain.automatic_start = false;
  const CostFormula two_terms("max(a*bs*l, b*bs) + c", {"a", "b", "c"}, {"bs", "l"});
  const CostFormula floor_and_power("max(c, a*bs*l^p)", {"a", "c", "p"}, {"bs", "l"},
                                    nonlinear());
  std::vector<Measurement> m1, m2;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) {
    for (double l : {16.0, 32.0, 48.0, 128.0, 256.0, 512.0}) {
      m1.push_back({{bs, l}, std::max(300 * bs * l, 20000 * bs) + 1e6});
    }
  }
  for (double bs : {1.0, 4.0, 16.0, 64.0}) {
    for (double l : {32.0, 128.0, 512.0, 1024.0, 2048.0}) {
      m2.push_back({{bs, l}, std::max(2e6, 40 * bs * std::pow(l, 1.3))});
    }
  }
  CHECK(xpm::fit_coefficients(two_terms, m1, plain).summary.max_rel_error > 0.01);
  CHECK(xpm::fit_coefficients(floor_and_power, m2, plain).summary.max_rel_error > 0.01);
  const FitResult r1 = xpm::fit_coefficients(two_terms, m1);
  const FitResult r2 = xpm::fit_coefficients(floor_and_power, m2);
  CHECK(r1.summary.max_rel_error < 1e-9);
  CHECK(r2.summary.max_rel_error < 1e-9);
  CHECK(plain.initial_values.empty());
  CHECK(xpm::fit_coefficients(two_terms, m1, plain).summary.start == "1 for every coefficient");
}

TEST_CASE("max of two growing terms is recovered with no initial values") {
  // a*bs*l wins for l > b/a = 66.7, b*bs below: both arguments win at some probes.
  const CostFormula f("max(a*bs*l, b*bs) + c", {"a", "b", "c"}, {"bs", "l"});
  REQUIRE_FALSE(f.is_linear());
  const double a = 300.0, b = 20000.0, c = 1e6;
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) {
    for (double l : {16.0, 32.0, 48.0, 128.0, 256.0, 512.0}) {
      m.push_back({{bs, l}, std::max(a * bs * l, b * bs) + c});
    }
  }
  const FitResult r = xpm::fit_coefficients(f, m);
  CHECK(r.coefficients[0] == doctest::Approx(a).epsilon(1e-4));
  CHECK(r.coefficients[1] == doctest::Approx(b).epsilon(1e-4));
  CHECK(r.coefficients[2] == doctest::Approx(c).epsilon(1e-4));
  CHECK(r.summary.usable);
  CHECK(contains(r.summary.start, "max() resolved by assignment iteration"));  // 24 points
}

TEST_CASE("a floor inside max() and a fitted exponent are recovered together") {
  const CostFormula f("max(c, a*bs*l^p)", {"a", "c", "p"}, {"bs", "l"}, nonlinear());
  // The floor c wins at small shapes, a*bs*l^p at 7 of the 20 probes.
  const double a = 40.0, p = 1.3, c = 2e6;
  std::vector<Measurement> m;
  for (double bs : {1.0, 4.0, 16.0, 64.0}) {
    for (double l : {32.0, 128.0, 512.0, 1024.0, 2048.0}) {
      m.push_back({{bs, l}, std::max(c, a * bs * std::pow(l, p))});
    }
  }
  const FitResult r = xpm::fit_coefficients(f, m);
  CHECK(std::abs(r.coefficients[2] - p) < 1e-3);
  CHECK(r.coefficients[0] == doctest::Approx(a).epsilon(1e-3));
  CHECK(r.coefficients[1] == doctest::Approx(c).epsilon(1e-6));
}

TEST_CASE("given initial values are used as the start, not the automatic one") {
  const CostFormula f("a*bs*l^p + c", {"a", "c", "p"}, {"bs", "l"}, nonlinear());
  FitOptions options;
  options.initial_values = {{"p", 1.5}};
  const FitResult r = xpm::fit_coefficients(f, power_grid(500.0, 1.7, 3.5e6), options);
  CHECK(contains(r.summary.start, "initial_values"));
}
