// fit_test.cpp — fit_coefficients: recovery, bounds, input validation, reports.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

#include "bart_probes.hpp"

using xpm::CostFormula;
using xpm::FitOptions;
using xpm::FitResult;
using xpm::IdentifiabilityError;
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

// ---------------------------------------------------------------------------------------------
// Non-linear fit, identifiability, robust loss, leave-one-out, usable.

namespace {

xpm::CostFormulaOptions nonlinear() {
  xpm::CostFormulaOptions options;
  options.allow_nonlinear = true;
  return options;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

bool any_reason_contains(const xpm::FitSummary& s, const std::string& needle) {
  return std::any_of(s.reasons.begin(), s.reasons.end(),
                     [&](const std::string& r) { return contains(r, needle); });
}

IdentifiabilityError identifiability_error(const CostFormula& f,
                                           const std::vector<Measurement>& m) {
  try {
    xpm::fit_coefficients(f, m);
  } catch (const IdentifiabilityError& e) {
    return e;
  }
  throw std::logic_error("expected an IdentifiabilityError");
}

}  // namespace

TEST_CASE("non-linear fit recovers a known exponent") {
  const CostFormula f("a*bs*l^p + c", {"a", "c", "p"}, {"bs", "l"}, nonlinear());
  REQUIRE_FALSE(f.is_linear());
  const double a = 3.0, c = 1e6, p = 1.7;
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) {
    for (double l : {16.0, 64.0, 128.0, 256.0}) m.push_back({{bs, l}, a * bs * std::pow(l, p) + c});
  }
  const FitResult r = xpm::fit_coefficients(f, m);
  CHECK(r.coefficients[2] == doctest::Approx(p).epsilon(1e-4));
  CHECK(std::abs(r.coefficients[2] - p) < 1e-4);
  CHECK(r.coefficients[0] == doctest::Approx(a).epsilon(1e-3));
  CHECK(r.coefficients[1] == doctest::Approx(c).epsilon(1e-3));
  CHECK_FALSE(r.summary.linear);
  CHECK(r.summary.converged);
  CHECK(r.summary.max_rel_error < 1e-6);
  CHECK(r.summary.usable);
  CHECK(contains(r.summary.brief_report(), "non-linear least squares"));
}

TEST_CASE("non-linear fit starts from the given initial values") {
  const CostFormula f("a*bs*l^p + c", {"a", "c", "p"}, {"bs", "l"}, nonlinear());
  std::vector<Measurement> m;
  for (double bs : {1.0, 4.0, 16.0}) {
    for (double l : {8.0, 32.0, 128.0, 512.0}) m.push_back({{bs, l}, 50.0 * bs * std::pow(l, 1.25) + 3e8});
  }
  FitOptions options;
  options.initial_values = {{"a", 10.0}, {"c", 1e8}, {"p", 1.0}};
  const FitResult r = xpm::fit_coefficients(f, m, options);
  CHECK(r.coefficients[2] == doctest::Approx(1.25).epsilon(1e-6));
  CHECK(r.coefficients[0] == doctest::Approx(50.0).epsilon(1e-5));
  CHECK(r.coefficients[1] == doctest::Approx(3e8).epsilon(1e-6));
  CHECK(r.summary.usable);
}

TEST_CASE("fit of a formula with max recovers the floor and the growing term") {
  // Peak = max(floor, activations): probes on both sides of the floor.
  const CostFormula f("max(c, a*bs*l^2 + b*bs*l)", {"a", "b", "c"}, {"bs", "l"});
  REQUIRE_FALSE(f.is_linear());
  const double a = 2.0, b = 500.0, c = 4e6;
  std::vector<Measurement> m;
  for (double bs : {1.0, 4.0, 16.0, 64.0}) {
    for (double l : {16.0, 128.0, 512.0}) {
      m.push_back({{bs, l}, std::max(c, a * bs * l * l + b * bs * l)});
    }
  }
  FitOptions options;
  options.initial_values = {{"a", 1.0}, {"b", 100.0}, {"c", 1e6}};
  const FitResult r = xpm::fit_coefficients(f, m, options);
  CHECK(r.coefficients[0] == doctest::Approx(a).epsilon(1e-4));
  CHECK(r.coefficients[1] == doctest::Approx(b).epsilon(1e-3));
  CHECK(r.coefficients[2] == doctest::Approx(c).epsilon(1e-6));
  CHECK(r.summary.max_rel_error < 1e-6);
}

TEST_CASE("identifiability error names the coefficients when every probe has one l") {
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0, 8.0, 16.0}) m.push_back({{bs, 64.0}, 1000.0 * bs + 5e6});
  const IdentifiabilityError e = identifiability_error(quadratic(), m);
  CHECK(e.coefficients() == std::vector<std::string>{"a", "b"});
  CHECK(e.dependent() == "b");
  const std::string what = e.what();
  CHECK_MESSAGE(contains(what, "coefficients a and b cannot be separated by the probe shapes"),
                what);
  CHECK_MESSAGE(contains(what, "every probe has l = 64"), what);
  const std::invalid_argument& base = e;  // an IdentifiabilityError is an invalid_argument
  CHECK(contains(base.what(), "'b'"));
}

TEST_CASE("identifiability error names a coefficient whose term moves with another's") {
  // bs == l at every probe: a*bs and b*l cannot be told apart, though neither dim is constant.
  const CostFormula f("a*bs + b*l + c", {"a", "b", "c"}, {"bs", "l"});
  std::vector<Measurement> m;
  for (double x : {1.0, 2.0, 3.0, 5.0}) m.push_back({{x, x}, 7.0 * x + 100.0});
  const IdentifiabilityError e = identifiability_error(f, m);
  CHECK(e.dependent() == "b");
  CHECK(e.coefficients() == std::vector<std::string>{"a", "b"});
  CHECK(contains(e.what(), "linearly dependent"));
}

TEST_CASE("identifiability error blames the formula where a coefficient's terms cancel") {
  // a*bs - a*bs is zero whatever the probes: the formula, not the data, leaves 'a' free.
  const CostFormula f("a*bs - a*bs + b*l + c", {"a", "b", "c"}, {"bs", "l"});
  std::vector<Measurement> m;
  for (double x : {1.0, 2.0, 3.0, 5.0}) m.push_back({{x, 2 * x + 1}, 7.0 * x + 100.0});
  const IdentifiabilityError e = identifiability_error(f, m);
  CHECK(e.dependent() == "a");
  CHECK_MESSAGE(contains(e.what(), "coefficient 'a' multiplies a term that is zero for any dims (its terms in "
                                   "'a*bs - a*bs + b*l + c' cancel); drop it from the formula"),
                e.what());
  // A term zero only at the probes (every probe has l = 0) is still the probes' doing.
  std::vector<Measurement> flat;
  for (double x : {1.0, 2.0, 3.0, 5.0}) flat.push_back({{x, 0.0}, 7.0 * x + 100.0});
  const IdentifiabilityError at_probes = identifiability_error(CostFormula("a*bs + b*l + c", {"a", "b", "c"},
                                                                           {"bs", "l"}), flat);
  CHECK_MESSAGE(contains(at_probes.what(), "zero at every measurement"), at_probes.what());
}

TEST_CASE("identifiability error names every coefficient when every dim is fixed") {
  std::vector<Measurement> m(4, Measurement{{4.0, 64.0}, 1e6});
  const IdentifiabilityError e = identifiability_error(quadratic(), m);
  CHECK(e.coefficients() == std::vector<std::string>{"a", "b"});
  CHECK(contains(e.what(), "every probe has bs = 4 and l = 64"));
}

TEST_CASE("robust loss downweights one outlier") {
  const double a = 3.5, b = 1200.0, c = 2.0e8;
  std::vector<Measurement> m = exact_grid(a, b, c);
  m[13].bytes *= 1.3;  // one bad probe (bs = 8, l = 64)
  const auto distance = [&](const FitResult& r) {
    return std::abs(r.coefficients[0] - a) / a + std::abs(r.coefficients[1] - b) / b +
           std::abs(r.coefficients[2] - c) / c;
  };
  const FitResult plain = xpm::fit_coefficients(quadratic(), m);
  FitOptions huber;
  huber.robust_loss = xpm::RobustLoss::kHuber;
  const FitResult robust = xpm::fit_coefficients(quadratic(), m, huber);
  FitOptions cauchy;
  cauchy.robust_loss = xpm::RobustLoss::kCauchy;
  const FitResult robust_cauchy = xpm::fit_coefficients(quadratic(), m, cauchy);
  CHECK(distance(robust) < distance(plain));
  CHECK(distance(robust_cauchy) < distance(plain));
  CHECK(distance(plain) > 1.0);          // the outlier drives a to 0 and b far off
  CHECK(distance(robust_cauchy) < 0.2);  // a, b, c each within 10 % or so
  CHECK(robust.summary.robust_loss == xpm::RobustLoss::kHuber);
  CHECK(contains(robust.summary.brief_report(), "robust loss huber"));
  // The outlier shows in the per-point errors, the other points fit.
  CHECK(std::abs(robust_cauchy.summary.rel_errors[13]) > 0.2);
}

TEST_CASE("leave-one-out error on exact data is about zero") {
  const FitResult r = xpm::fit_coefficients(quadratic(), exact_grid(3.5, 1200.0, 2e8));
  CHECK(r.summary.leave_one_out_note.empty());
  REQUIRE(r.summary.leave_one_out_rel_errors.size() == 16);
  CHECK(r.summary.leave_one_out_max_rel_error < 1e-8);
  CHECK(contains(r.summary.brief_report(), "held-out (leave-one-out) max relative error"));
}

TEST_CASE("leave-one-out reveals a point that the others do not predict") {
  std::vector<Measurement> m = exact_grid(3.5, 1200.0, 2e8);
  m[6].bytes *= 1.1;
  const FitResult r = xpm::fit_coefficients(quadratic(), m);
  CHECK(r.summary.leave_one_out_max_rel_error > r.summary.max_rel_error);
  CHECK(std::abs(r.summary.leave_one_out_rel_errors[6]) ==
        doctest::Approx(r.summary.leave_one_out_max_rel_error));
}

TEST_CASE("leave-one-out is skipped and says so when points do not outnumber coefficients") {
  std::vector<Measurement> m = exact_grid(1.0, 2.0, 3e6);
  m = {m[0], m[5], m[10]};
  const FitResult r = xpm::fit_coefficients(quadratic(), m);
  CHECK(std::isnan(r.summary.leave_one_out_max_rel_error));
  CHECK(r.summary.leave_one_out_rel_errors.empty());
  CHECK(contains(r.summary.leave_one_out_note, "3 points for 3 coefficients"));
  CHECK(contains(r.summary.brief_report(), "3 points for 3 coefficients"));
}

TEST_CASE("a shape needed to identify the fit gets no held-out figure; the others get theirs") {
  // Only the probe at l = 128 separates a from b.
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0}) m.push_back({{bs, 64.0}, 3.0 * bs * 64 * 64 + 7.0 * bs * 64 + 1e6});
  m.push_back({{2.0, 128.0}, 3.0 * 2 * 128 * 128 + 7.0 * 2 * 128 + 1e6});
  const FitResult r = xpm::fit_coefficients(quadratic(), m);
  CHECK(r.summary.leave_one_out_note.empty());
  CHECK(r.summary.held_out_undetermined == std::vector<std::size_t>{3});
  CHECK(std::isnan(r.summary.leave_one_out_rel_errors[3]));
  CHECK(contains(r.summary.held_out_note, "without point 3 (bs = 2, l = 128) the coefficients"));
  CHECK(r.summary.leave_one_out_max_rel_error < 1e-8);  // the three at l = 64
  CHECK(r.summary.usable);
  // bs = 1 and bs = 4 lie outside the other shapes: their figures are extrapolation, reported apart.
  CHECK(r.summary.held_out_extrapolated == std::vector<std::size_t>{0, 2});
  CHECK(contains(r.summary.full_report(), "(extrapolation)"));
  CHECK(contains(r.summary.brief_report(), "by extrapolation at 2 points outside the others' range"));
}

TEST_CASE("a fit whose prediction decreases as the batch size grows is not usable") {
  const CostFormula f("a*bs + c", {"a", "c"}, {"bs"});
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) m.push_back({{bs}, 1e6 - 1000.0 * bs});
  FitOptions options;
  options.non_negative = false;
  const FitResult unchecked = xpm::fit_coefficients(f, m, options);
  CHECK(unchecked.coefficients[0] == doctest::Approx(-1000.0));
  CHECK(unchecked.summary.usable);  // without a batch-size variable nothing is checked

  options.batch_size_variable = "bs";
  const FitResult r = xpm::fit_coefficients(f, m, options);
  CHECK_FALSE(r.summary.usable);
  REQUIRE(r.summary.reasons.size() == 1);
  CHECK_MESSAGE(contains(r.summary.reasons[0], "decreases as bs grows at 4 of 4 measured dims"),
                r.summary.reasons[0]);
  CHECK(contains(r.summary.brief_report(), "Not usable"));
  CHECK(contains(r.summary.brief_report(), "decreases as bs grows"));

  // Non-negative coefficients cannot decrease with bs: a = 0, c near the mean, within 1 %.
  options.non_negative = true;
  const FitResult bounded = xpm::fit_coefficients(f, m, options);
  CHECK(bounded.coefficients[0] == 0.0);
  CHECK(bounded.summary.usable);
}

TEST_CASE("a fit with a large relative error is not usable, with the point and the limit") {
  // A linear formula fitted to quadratic data.
  const CostFormula f("b*bs*l + c", {"b", "c"}, {"bs", "l"});
  const FitResult r = xpm::fit_coefficients(f, exact_grid(5.0, 10.0, 1e5));
  CHECK(r.summary.max_rel_error > 0.05);
  CHECK_FALSE(r.summary.usable);
  CHECK(any_reason_contains(r.summary, "above the limit 5 %"));
  FitOptions lenient;
  lenient.usable_max_rel_error = 100.0;
  CHECK(xpm::fit_coefficients(f, exact_grid(5.0, 10.0, 1e5), lenient).summary.usable);
}

TEST_CASE("a good fit is usable and says so") {
  FitOptions options;
  options.batch_size_variable = "bs";
  const FitResult r = xpm::fit_coefficients(quadratic(), exact_grid(3.5, 1200.0, 2e8), options);
  CHECK(r.summary.usable);
  CHECK(r.summary.reasons.empty());
  CHECK(r.summary.linear);
  CHECK(r.summary.coefficient_count == 3);
  const std::string report = r.summary.brief_report();
  CHECK(contains(report, "Usable."));
  CHECK(contains(report, "linear least squares, 3 coefficients"));
  CHECK(report.find('\n') == std::string::npos);
  const std::string full = r.summary.full_report();
  CHECK(contains(full, "point 15: relative error"));
  CHECK(contains(full, "leave-one-out"));
}

TEST_CASE("non-linear fit marks a coefficient the probes cannot identify as not usable") {
  // Every probe lies above the floor c, so no probe says anything about c.
  const CostFormula f("max(c, a*bs*l)", {"a", "c"}, {"bs", "l"});
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0}) {
    for (double l : {16.0, 32.0}) m.push_back({{bs, l}, 5.0 * bs * l});
  }
  const FitResult r = xpm::fit_coefficients(f, m);
  CHECK(r.coefficients[0] == doctest::Approx(5.0).epsilon(1e-6));
  CHECK_FALSE(r.summary.usable);
  CHECK(any_reason_contains(r.summary, "coefficient 'c' has no effect"));
}

TEST_CASE("non-linear fit sets a max() argument that never wins to 0 when a sibling of the same shape explains every probe") {
  // One piece explains every probe; the second, of the same shape, never wins at any of them.
  const CostFormula f("max(a1*bs*l + c1, a2*bs*l + c2)", {"a1", "c1", "a2", "c2"}, {"bs", "l"});
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) {
    for (double l : {16.0, 32.0, 64.0}) m.push_back({{bs, l}, 5.0 * bs * l + 1000.0});
  }
  const FitResult r = xpm::fit_coefficients(f, m);
  INFO(r.summary.full_report());
  CHECK(r.summary.usable);
  CHECK(r.summary.dormant_coefficients.size() == 2);
  CHECK(contains(r.summary.dormant_note, "set to 0"));
  CHECK(contains(r.summary.full_report(), "never wins"));
  for (const Measurement& point : m) {
    CHECK(f.predict(r.coefficients, point.dims) == doctest::Approx(point.bytes).epsilon(1e-6));
  }
  // Between the probes the prediction is the winning piece's.
  CHECK(f.predict(r.coefficients, {3, 40}) == doctest::Approx(5.0 * 3 * 40 + 1000.0).epsilon(1e-6));
}

TEST_CASE("fit options reject an unknown robust loss, a bad scale and bad initial values") {
  CHECK_THROWS_WITH_AS(xpm::parse_robust_loss("tukey", "--robust-loss"),
                       "--robust-loss must be 'none', 'huber' or 'cauchy', got 'tukey'", std::invalid_argument);
  CHECK(xpm::parse_robust_loss(xpm::to_string(xpm::RobustLoss::kCauchy), "x") == xpm::RobustLoss::kCauchy);
  FitOptions o;
  o.robust_loss_scale = 0;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("robust_loss_scale"),
                       std::invalid_argument);
  o = FitOptions{};
  o.usable_max_rel_error = -1;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("usable_max_rel_error"),
                       std::invalid_argument);
  o = FitOptions{};
  o.initial_values = {{"q", 1.0}};
  CHECK(contains(message_of(exact_grid(1, 1, 1), o), "'q'"));
  o.initial_values = {{"a", -1.0}};
  CHECK(contains(message_of(exact_grid(1, 1, 1), o), "negative"));
  o.initial_values = {{"a", std::nan("")}};
  CHECK(contains(message_of(exact_grid(1, 1, 1), o), "initial_values"));
}

TEST_CASE("fit rejects a batch-size variable that is not a variable of the formula") {
  FitOptions o;
  o.batch_size_variable = "n";
  const std::string msg = message_of(exact_grid(1, 1, 1), o);
  CHECK(contains(msg, "batch_size_variable 'n'"));
  CHECK(contains(msg, "bs, l"));
}

// ---------------------------------------------------------------------------------------------
// Infeasible probes as lower bounds.

namespace {

// Peak = 1000*bs*l + 2*bs*l^2 + 1e7, measured at small shapes where the quadratic term hides.
std::vector<Measurement> small_shapes() {
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0}) {
    for (double l : {16.0, 32.0, 64.0}) {
      m.push_back({{bs, l}, 1000 * bs * l + 2 * bs * l * l + 1e7});
    }
  }
  return m;
}

// bs = 32, l = 512 ran out of memory under 40e6 bytes (the truth there is 43.2e6).
const xpm::InfeasibleBound kOutOfMemory{{32, 512}, 40e6};

}  // namespace

TEST_CASE("an infeasible probe raises a linear fit's prediction there to the capacity") {
  const CostFormula f("a*bs*l + c", {"a", "c"}, {"bs", "l"});
  const FitResult feasible_only = xpm::fit_coefficients(f, small_shapes());
  REQUIRE(f.predict(feasible_only.coefficients, kOutOfMemory.dims) < kOutOfMemory.exceeds_bytes);
  CHECK(feasible_only.summary.infeasible_bound_count == 0);

  const FitResult bounded = xpm::fit_coefficients(f, small_shapes(), {kOutOfMemory});
  const double predicted = f.predict(bounded.coefficients, kOutOfMemory.dims);
  CHECK(predicted >= kOutOfMemory.exceeds_bytes);
  CHECK(predicted < kOutOfMemory.exceeds_bytes * 1.001);  // no further than the data asks
  CHECK(bounded.summary.infeasible_bound_count == 1);
  REQUIRE(bounded.summary.infeasible_bound_satisfied.size() == 1);
  CHECK(bounded.summary.infeasible_bound_satisfied[0]);
  CHECK(bounded.summary.infeasible_bound_predicted_bytes[0] == doctest::Approx(predicted));
  CHECK(bounded.summary.usable);  // the feasible points still fit within 5 %
  CHECK(bounded.summary.rel_errors.size() == 9);  // bounds are not points
  CHECK(bounded.summary.leave_one_out_rel_errors.size() == 9);
  CHECK(contains(bounded.summary.brief_report(), "1 infeasible-probe bound: all satisfied"));
  CHECK(contains(bounded.summary.full_report(), "infeasible bound 0: predicted"));
}

TEST_CASE("an infeasible probe raises a non-linear fit's prediction there to the capacity") {
  const CostFormula f("max(c, a*bs*l)", {"a", "c"}, {"bs", "l"});
  FitOptions options;
  options.usable_max_rel_error = 10;  // the bound pulls the fit far from these points
  // Peaks max(1e5, 1000*bs*l): exact without the bound, 1.64e7 bytes at bs = 32, l = 512.
  std::vector<Measurement> floored;
  for (const Measurement& m : small_shapes()) {
    floored.push_back({m.dims, std::max(1e5, 1000 * m.dims[0] * m.dims[1])});
  }
  const FitResult feasible_only = xpm::fit_coefficients(f, floored, options);
  REQUIRE(feasible_only.summary.max_rel_error < 1e-6);
  REQUIRE(f.predict(feasible_only.coefficients, kOutOfMemory.dims) < kOutOfMemory.exceeds_bytes);
  const FitResult bounded = xpm::fit_coefficients(f, floored, {kOutOfMemory}, options);
  CHECK(f.predict(bounded.coefficients, kOutOfMemory.dims) >= kOutOfMemory.exceeds_bytes);
  CHECK(bounded.summary.infeasible_bound_satisfied.at(0));
  CHECK_FALSE(bounded.summary.linear);
}

TEST_CASE("a bound the formula cannot meet makes the fit not usable, naming the dims") {
  // a*bs*l is 0 at l = 0 whatever a is, so a probe out of memory there cannot be honored.
  const CostFormula f("a*bs*l", {"a"}, {"bs", "l"});
  const FitResult r = xpm::fit_coefficients(f, {{{1, 16}, 2e6}, {{2, 16}, 3e6}},
                                            {{{8, 0}, 5e9}});
  CHECK_FALSE(r.summary.usable);
  CHECK_FALSE(r.summary.infeasible_bound_satisfied.at(0));
  CHECK(any_reason_contains(r.summary, "ran out of memory at bs = 8, l = 0"));
  CHECK(contains(r.summary.brief_report(), "1 violated"));
}

TEST_CASE("a bound met only by a large constant is met, exactly, and the fit says how far off it is") {
  // Linear with bounds: the least squares with the bounds as constraints, no iterations. The
  // constant alone can reach 5e9 at l = 0, so the fit does, and misses the measured points.
  const CostFormula f("a*bs*l + c", {"a", "c"}, {"bs", "l"});
  const FitResult r = xpm::fit_coefficients(f, {{{1, 16}, 2e6}, {{2, 16}, 3e6}}, {{{8, 0}, 5e9}});
  CHECK(r.summary.converged);
  CHECK(r.summary.iterations == 0);
  CHECK(r.summary.infeasible_bound_satisfied.at(0));
  CHECK(f.predict(r.coefficients, {8, 0}) == doctest::Approx(5e9).epsilon(1e-5));
  CHECK_FALSE(r.summary.usable);
  CHECK(any_reason_contains(r.summary, "max relative error"));
  CHECK(contains(r.summary.solver_report, "exact least squares with the 1 infeasible-probe bound as constraints"));
}

TEST_CASE("a linear fit held up by out-of-memory probes is the least squares under them") {
  // Ceres, with the bounds as hinges, stopped after 200 iterations without converging on these.
  const CostFormula f("a1*bs + a2*bs*ls + a3*bs*lt + a4*bs*ls*lt + c", {"a1", "a2", "a3", "a4", "c"},
                      {"bs", "ls", "lt"});
  const std::vector<Measurement> peaks = xpm_test::bart_peaks();
  const std::vector<xpm::InfeasibleBound> out_of_memory = xpm_test::bart_out_of_memory();
  FitOptions options;
  options.usable_max_rel_error = 0.1;
  const FitResult r = xpm::fit_coefficients(f, peaks, out_of_memory, options);
  CHECK(r.summary.converged);
  for (std::size_t b = 0; b < out_of_memory.size(); ++b) CHECK(r.summary.infeasible_bound_satisfied.at(b));
  const auto cost = [&](const std::vector<double>& coefficients) {
    double sum = 0;
    for (const Measurement& m : peaks) sum += std::pow((f.predict(coefficients, m.dims) - m.bytes) / m.bytes, 2);
    return sum;
  };
  const auto feasible = [&](const std::vector<double>& coefficients) {
    return std::all_of(coefficients.begin(), coefficients.end(), [](double c) { return c >= 0; }) &&
           std::all_of(out_of_memory.begin(), out_of_memory.end(), [&](const xpm::InfeasibleBound& b) {
             return f.predict(coefficients, b.dims) >= b.exceeds_bytes;
           });
  };
  // The problem is convex: no feasible point nearby has a lower cost.
  const double at_fit = cost(r.coefficients);
  std::mt19937_64 random(7);
  std::normal_distribution<double> step(0, 1e-3);
  int tried = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<double> moved = r.coefficients;
    for (double& c : moved) c = c * (1 + step(random)) + std::abs(step(random)) * 1e3;
    if (!feasible(moved)) continue;
    ++tried;
    CHECK(cost(moved) >= at_fit * (1 - 1e-9));
  }
  CHECK(tried > 100);
}

TEST_CASE("a bound every fit meets, far from the points, leaves the exact fit as it is") {
  // The far bound's constraint row is about 1e11 times the other's: unscaled, it set the
  // solver's tolerance so high that b >= 0 never came into play, and Ceres, taking over, did
  // not converge (a reviewer's case).
  const CostFormula f("a*bs*l + b*l + c", {"a", "b", "c"}, {"bs", "l"});
  std::vector<Measurement> peaks;
  const double measured[4][3] = {{5131224, 5252528, 5529650}, {5258757, 5497237, 6034891},
                                 {5547938, 6052526, 7023200}, {5985886, 7026036, 9097880}};
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 3; ++j) peaks.push_back({{2.0 * (1 << i), 64.0 * (1 << j)}, measured[i][j]});
  }
  const xpm::InfeasibleBound near{{32, 512}, 21.8e6};
  const FitResult without = xpm::fit_coefficients(f, peaks, {near});
  const FitResult with = xpm::fit_coefficients(f, peaks, {near, {{4096, 65536}, 1}});
  INFO(with.summary.brief_report());
  CHECK(with.summary.usable);
  CHECK(with.summary.iterations == 0);
  for (std::size_t k = 0; k < 3; ++k) {
    CHECK(with.coefficients[k] == doctest::Approx(without.coefficients[k]).epsilon(1e-9).scale(1));
  }
}

TEST_CASE("fit rejects a malformed infeasible bound naming it") {
  const CostFormula f("a*bs*l + c", {"a", "c"}, {"bs", "l"});
  const auto message = [&](const xpm::InfeasibleBound& bound) {
    try {
      xpm::fit_coefficients(f, small_shapes(), {kOutOfMemory, bound});
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(contains(message({{1}, 5e6}), "infeasible bound 1 has 1 dims"));
  CHECK(contains(message({{1, std::nan("")}, 5e6}), "infeasible bound 1 has l = nan"));
  CHECK(contains(message({{1, 8}, 0}), "infeasible bound 1 has exceeds_bytes = 0"));
  FitOptions o;
  o.infeasible_bound_weight = 0;
  CHECK_THROWS_WITH_AS(o.validate(), doctest::Contains("infeasible_bound_weight"),
                       std::invalid_argument);
}
