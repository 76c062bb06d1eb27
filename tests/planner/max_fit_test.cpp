// max_fit_test.cpp — fits of formulas with max() reach the global least-squares optimum over
// which argument wins at each point (planner/src/max_affine_fit.hpp), on synthetic peaks of
// known coefficients: a floor with 1, 2 and 3 points on it, two polynomials plus a constant,
// nested max(), three pieces of which two have the same shape, and more points than the
// exhaustive search takes.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"

using xpm::CostFormula;
using xpm::FitResult;
using xpm::Measurement;

namespace {

using Peak = std::function<double(double bs, double l)>;

std::vector<Measurement> measure(const std::vector<std::vector<double>>& shapes, const Peak& peak) {
  std::vector<Measurement> out;
  for (const auto& s : shapes) out.push_back({s, peak(s[0], s[1])});
  return out;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// The fitted coefficients against the true ones (declared order), relative.
void check_coefficients(const FitResult& r, const std::vector<double>& truth, double tolerance) {
  REQUIRE(r.coefficients.size() == truth.size());
  for (std::size_t k = 0; k < truth.size(); ++k) {
    INFO("coefficient " << k << ": fitted " << r.coefficients[k] << ", true " << truth[k]);
    if (truth[k] == 0) {
      CHECK(std::abs(r.coefficients[k]) < 1e-6);
    } else {
      CHECK(std::abs(r.coefficients[k] - truth[k]) <= tolerance * std::abs(truth[k]));
    }
  }
}

// Floor f = 6e7 bytes; the polynomial 100*bs*l^2 + 20000*bs*l + 4e7 is below it up to about
// bs*l = 900 at l = 64.
constexpr double kA = 100, kB = 20000, kC = 4e7, kF = 6e7;
double floored(double bs, double l) { return std::max(kF, kA * bs * l * l + kB * bs * l + kC); }

}  // namespace

TEST_CASE("max(f, polynomial) is fitted exactly with 1, 2 or 3 of 7 points at the floor") {
  const CostFormula formula("max(f, a*bs*l^2 + b*bs*l + c)", {"a", "b", "c", "f"}, {"bs", "l"});
  // Above the floor in every case: five or six shapes where the polynomial wins.
  const std::vector<std::vector<double>> above = {{8, 128}, {16, 128}, {4, 256}, {8, 256},
                                                  {32, 64}, {2, 512}};
  const std::vector<std::vector<double>> floor_shapes = {{1, 16}, {2, 32}, {1, 64}};
  for (std::size_t on_floor = 1; on_floor <= 3; ++on_floor) {
    CAPTURE(on_floor);
    std::vector<std::vector<double>> shapes(floor_shapes.begin(),
                                            floor_shapes.begin() + static_cast<long>(on_floor));
    shapes.insert(shapes.end(), above.begin(), above.begin() + static_cast<long>(7 - on_floor));
    const auto m = measure(shapes, floored);
    for (const auto& point : m) CHECK(point.bytes > 0);
    const FitResult r = xpm::fit_coefficients(formula, m);
    INFO(r.summary.full_report());
    CHECK(r.summary.max_rel_error < 1e-6);
    check_coefficients(r, {kA, kB, kC, kF}, 1e-4);
    CHECK(contains(r.summary.start, "max() resolved globally"));
    CHECK(r.summary.usable);
    // A floor seen at a single shape, the smallest, is not determined once that shape is held
    // out: no figure there, and none is made up to decide usability.
    if (on_floor == 1) {
      CHECK(r.summary.held_out_undetermined == std::vector<std::size_t>{0});
      CHECK(std::isnan(r.summary.leave_one_out_rel_errors[0]));
      CHECK(contains(r.summary.held_out_note, "without point 0 (bs = 1, l = 16) the fit rests on 0 other shapes "
                                              "where f act and needs 1"));
      CHECK(r.summary.surrounded_held_out_max_rel_error < 1e-6);
    }
  }
}

TEST_CASE("max(f, polynomial) is fitted exactly with 8 points, 3 at the floor") {
  const CostFormula formula("max(f, a*bs*l^2 + b*bs*l + c)", {"a", "b", "c", "f"}, {"bs", "l"});
  const auto m = measure({{1, 16}, {2, 32}, {1, 64}, {8, 128}, {16, 128}, {4, 256}, {8, 256},
                          {2, 512}},
                         floored);
  const FitResult r = xpm::fit_coefficients(formula, m);
  INFO(r.summary.full_report());
  CHECK(r.summary.usable);
  check_coefficients(r, {kA, kB, kC, kF}, 1e-4);
}

TEST_CASE("max(f, polynomial) with 3 of 12 shapes above the floor is usable; their refits give no figure") {
  const CostFormula formula("max(f, a*bs*l^2 + b*bs*l + c)", {"a", "b", "c", "f"}, {"bs", "l"});
  std::vector<std::vector<double>> shapes;
  for (double l : {16.0, 32.0, 64.0}) {
    for (double bs : {1.0, 2.0, 4.0}) shapes.push_back({bs, l});
  }
  shapes.insert(shapes.end(), {{16, 128}, {4, 256}, {8, 512}});
  const FitResult r = xpm::fit_coefficients(formula, measure(shapes, floored));
  INFO(r.summary.full_report());
  REQUIRE(r.summary.usable);
  check_coefficients(r, {kA, kB, kC, kF}, 1e-4);
  // Without one of the three, the piece's three coefficients rest on two shapes: no figure.
  CHECK(r.summary.held_out_undetermined == std::vector<std::size_t>{9, 10, 11});
  for (std::size_t i : {9, 10, 11}) CHECK(std::isnan(r.summary.leave_one_out_rel_errors[i]));
  CHECK(contains(r.summary.held_out_note, "no held-out figure at 3 of 12 shapes: without point 9 (bs = 16, "
                                          "l = 128) the fit rests on 2 other shapes where a, b and c act and "
                                          "needs 3"));
  CHECK(contains(r.summary.brief_report(), "no held-out figure at 3 of 12 shapes"));
  // The floor's shapes have figures, inside the others' range.
  CHECK(r.summary.surrounded_held_out_max_rel_error < 1e-6);
  CHECK(r.summary.surrounded_held_out_count == 9);
  // The usable fit predicts shapes it never saw.
  for (const std::vector<double>& other : std::vector<std::vector<double>>{{2, 128}, {32, 64}, {2, 512}, {8, 16}}) {
    const double predicted = formula.predict(r.coefficients, other);
    CHECK(std::abs(predicted - floored(other[0], other[1])) <= 1e-4 * floored(other[0], other[1]));
  }
}

TEST_CASE("max(polynomial, polynomial) + c is fitted exactly where each piece wins somewhere") {
  // Long sequences: the attention term a*bs*l^2 wins; short ones: the b*bs*l term.
  const CostFormula formula("max(a*bs*l^2, b*bs*l) + c", {"a", "b", "c"}, {"bs", "l"});
  const double a = 400, b = 60000, c = 3e7;  // tie at l = 150
  const auto m = measure({{1, 32}, {4, 32}, {2, 64}, {8, 64}, {1, 256}, {2, 512}, {4, 300}, {8, 200}},
                         [&](double bs, double l) { return std::max(a * bs * l * l, b * bs * l) + c; });
  const FitResult r = xpm::fit_coefficients(formula, m);
  INFO(r.summary.full_report());
  CHECK(r.summary.usable);
  check_coefficients(r, {a, b, c}, 1e-4);
}

TEST_CASE("a nested max() is fitted exactly") {
  const CostFormula formula("max(f, max(a*bs*l^2, b*bs*l) + c)", {"a", "b", "c", "f"}, {"bs", "l"});
  const double a = 400, b = 60000, c = 3e7, f = 4e7;
  const auto peak = [&](double bs, double l) {
    return std::max(f, std::max(a * bs * l * l, b * bs * l) + c);
  };
  const auto m = measure({{1, 16}, {1, 32}, {4, 32}, {8, 64}, {16, 64}, {2, 512}, {4, 300},
                          {8, 200}, {2, 256}},
                         peak);
  const FitResult r = xpm::fit_coefficients(formula, m);
  INFO(r.summary.full_report());
  CHECK(r.summary.usable);
  check_coefficients(r, {a, b, c, f}, 1e-4);
}

TEST_CASE("max(p1, p2, p3) with two pieces of the same shape fits where each piece wins") {
  // A peak that moves between operations: p1 (a softmax, quadratic in l) at long lengths, p2 (a
  // matrix product of backward, linear in l with a larger slope) at short ones, p3 a floor.
  const CostFormula formula("max(a1*bs*l^2 + b1*bs*l + c1, a2*bs*l^2 + b2*bs*l + c2, f)",
                            {"a1", "b1", "c1", "a2", "b2", "c2", "f"}, {"bs", "l"});
  const double a1 = 300, b1 = 10000, c1 = 3e7, a2 = 20, b2 = 90000, c2 = 2.5e7, f = 3.3e7;
  const auto peak = [&](double bs, double l) {
    return std::max({a1 * bs * l * l + b1 * bs * l + c1, a2 * bs * l * l + b2 * bs * l + c2, f});
  };
  std::vector<std::vector<double>> shapes;
  for (double bs : {1.0, 4.0, 16.0}) {
    for (double l : {16.0, 64.0, 160.0, 320.0, 512.0}) shapes.push_back({bs, l});
  }
  const auto m = measure(shapes, peak);
  const FitResult r = xpm::fit_coefficients(formula, m);
  INFO(r.summary.full_report());
  CHECK(r.summary.usable);
  CHECK(r.summary.max_rel_error < 1e-6);
  check_coefficients(r, {a1, b1, c1, a2, b2, c2, f}, 1e-3);
  CHECK(contains(r.summary.start, "max() resolved globally"));
}

TEST_CASE("beyond 16 points, assignment iteration from several starts still fits max() exactly") {
  const CostFormula formula("max(f, a*bs*l^2 + b*bs*l + c)", {"a", "b", "c", "f"}, {"bs", "l"});
  std::vector<std::vector<double>> shapes;
  for (double bs : {1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0}) {
    for (double l : {8.0, 16.0, 32.0, 64.0, 96.0, 128.0, 192.0, 256.0}) shapes.push_back({bs, l});
  }
  const auto m = measure(shapes, floored);
  REQUIRE(m.size() == 64);
  const FitResult r = xpm::fit_coefficients(formula, m);
  INFO(r.summary.full_report());
  CHECK(r.summary.usable);
  CHECK(r.summary.max_rel_error < 1e-6);
  check_coefficients(r, {kA, kB, kC, kF}, 1e-4);
  CHECK(contains(r.summary.start, "assignment iteration"));
  // Each held-out refit (63 points) starts from the full fit's pieces too, and is exact.
  CHECK(r.summary.leave_one_out_max_rel_error < 1e-6);
}
