// fit_regimes_test.cpp — what fit_coefficients does beyond one least-squares fit of every
// point: single-record probes below or above the trend are left out (FitOptions::
// single_record_regime; above it, batch size 1 is scaled to cover them),
// and residuals grouped along a variable are reported (FitSummary::residual_structure).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "xpm/planner/fit.hpp"
#include "xpm/planner/formula.hpp"
#include "xpm/planner/memory_model.hpp"

using xpm::CostFormula;
using xpm::FitOptions;
using xpm::FitResult;
using xpm::Measurement;

namespace {

const CostFormula kFormula("a*bs*l + c", {"a", "c"}, {"bs", "l"});

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// 5000 bytes per token and 2e6 bytes; at bs = 1 a copy of 1000 bytes per token is skipped.
std::vector<Measurement> with_single_records() {
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0, 8.0}) {
    for (double l : {16.0, 64.0, 256.0}) {
      const double per_token = bs == 1 ? 4000 : 5000;
      m.push_back({{bs, l}, per_token * bs * l + 2e6});
    }
  }
  return m;
}

FitOptions with_batch_size() {
  FitOptions options;
  options.batch_size_variable = "bs";
  return options;
}

}  // namespace

TEST_CASE("single-record probes below the trend are left out and over-predicted") {
  const FitResult r = xpm::fit_coefficients(kFormula, with_single_records(), with_batch_size());
  INFO(r.summary.full_report());
  CHECK(r.coefficients[0] == doctest::Approx(5000).epsilon(1e-9));
  CHECK(r.coefficients[1] == doctest::Approx(2e6).epsilon(1e-9));
  CHECK(r.summary.left_out == std::vector<std::size_t>{0, 1, 2});
  CHECK(r.summary.max_rel_error < 1e-9);
  REQUIRE(r.summary.rel_errors.size() == 12);
  CHECK(r.summary.rel_errors[2] == doctest::Approx(256.0 * 1000 / (4000 * 256.0 + 2e6)));
  CHECK(contains(r.summary.left_out_note, "3 probes at bs = 1 lie below the trend"));
  CHECK(contains(r.summary.brief_report(), "on 9 points (3 at bs = 1 left out)"));
  CHECK(r.summary.usable);
}

TEST_CASE("single-record probes below the trend that follow the formula alone predict batch size 1") {
  // Five lengths at bs = 1 (two more distinct shapes than coefficients): a fit of their own.
  std::vector<Measurement> m = with_single_records();
  for (double l : {32.0, 128.0}) m.push_back({{1, l}, 4000 * l + 2e6});
  const FitResult r = xpm::fit_coefficients(kFormula, m, with_batch_size());
  INFO(r.summary.full_report());
  CHECK(r.coefficients[0] == doctest::Approx(5000).epsilon(1e-9));
  REQUIRE(r.summary.single_record_coefficients.size() == 2);
  CHECK(r.summary.single_record_coefficients[0] == doctest::Approx(4000).epsilon(1e-6));
  CHECK(r.summary.single_record_coefficients[1] == doctest::Approx(2e6).epsilon(1e-6));
  CHECK(contains(r.summary.left_out_note, "fitted on their own"));
  for (std::size_t i : r.summary.left_out) CHECK(std::fabs(r.summary.rel_errors[i]) < 1e-6);

  xpm::MemoryModel model(kFormula, r.coefficients, 0, "bs");
  model.set_single_record_coefficients(r.summary.single_record_coefficients);
  CHECK(model.predict_bytes({1, 200}) == doctest::Approx(4000 * 200 + 2e6));  // between the probes
  CHECK(model.predict_bytes({2, 200}) == doctest::Approx(5000 * 400 + 2e6));  // larger ones by the others' fit
  const xpm::MemoryModel read = xpm::MemoryModel::from_json(model.to_json());
  CHECK(read.single_record_coefficients() == model.single_record_coefficients());
  nlohmann::json file = model.to_json();
  file["single_record_coefficients"]["zz"] = 3.0;
  CHECK_THROWS_WITH_AS(xpm::MemoryModel::from_json(file),
                       "memory model: field 'single_record_coefficients.zz': not a coefficient of the formula",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(model.set_single_record_coefficients({1.0}),
                       "MemoryModel: 1 single_record_coefficients given for 2 coefficients", std::invalid_argument);

  // A probe of one record that ran out of memory above their fit: no fit of their own.
  const FitResult bounded = xpm::fit_coefficients(kFormula, m, {{{1, 512}, 4100.0 * 512 + 2e6}}, with_batch_size());
  CHECK(bounded.summary.single_record_coefficients.empty());
  CHECK(contains(bounded.summary.left_out_note, "err on the safe side"));

  // Terms a batch of one cannot tell apart (a*bs*l and b*l): no fit of their own, the safe side.
  const CostFormula both("a*bs*l + b*l + c", {"a", "b", "c"}, {"bs", "l"});
  std::vector<Measurement> mixed;
  for (const Measurement& point : m) mixed.push_back({point.dims, point.bytes + 300 * point.dims[1]});
  for (double l : {48.0, 96.0}) mixed.push_back({{1, l}, 4300 * l + 2e6});
  const FitResult unsplit = xpm::fit_coefficients(both, mixed, with_batch_size());
  INFO(unsplit.summary.full_report());
  CHECK(unsplit.summary.single_record_coefficients.empty());
}

TEST_CASE("single-record probes are fitted when asked") {
  FitOptions options = with_batch_size();
  options.single_record_regime = false;
  const FitResult all = xpm::fit_coefficients(kFormula, with_single_records(), options);
  CHECK(all.summary.left_out.empty());
  CHECK(all.summary.max_rel_error > 0.01);
  CHECK(all.summary.single_record_factor == 1);
}

TEST_CASE("single-record probes above the trend are left out, and batch size 1 is scaled to cover them") {
  // A buffer at bs = 1 only (a convolution's im2col path): up to 1900 bytes more per token.
  std::vector<Measurement> above = with_single_records();
  for (Measurement& m : above) {
    if (m.dims[0] == 1) m.bytes = (m.dims[1] == 64 ? 6900 : 6000) * m.dims[1] + 2e6;
  }
  const FitResult r = xpm::fit_coefficients(kFormula, above, with_batch_size());
  INFO(r.summary.full_report());
  CHECK(r.coefficients[0] == doctest::Approx(5000).epsilon(1e-9));
  CHECK(r.summary.left_out == std::vector<std::size_t>{0, 1, 2});
  CHECK(r.summary.single_record_factor == doctest::Approx((6000 * 256 + 2e6) / (5000 * 256 + 2e6)));  // the largest
  CHECK(contains(r.summary.left_out_note, "3 probes at bs = 1 lie above the trend"));
  for (std::size_t i : r.summary.left_out) CHECK(r.summary.rel_errors[i] >= -1e-12);  // never under
  xpm::MemoryModel model(kFormula, r.coefficients, 0, "bs");
  model.set_single_record_factor(r.summary.single_record_factor);
  for (const Measurement& m : above) CHECK(model.predict_bytes(m.dims) >= m.bytes * (1 - 1e-12));
  CHECK(model.predict_bytes({2, 64}) == doctest::Approx(5000 * 128 + 2e6));  // larger ones unscaled
  CHECK(xpm::MemoryModel::from_json(model.to_json()).single_record_factor() == r.summary.single_record_factor);
  CHECK_THROWS_WITH_AS(model.set_single_record_factor(0.5), doctest::Contains("single_record_factor must be"),
                       std::invalid_argument);
}

TEST_CASE("residuals grouped by a variable are reported with a max() of pieces to try") {
  // The peak moves from one operation to another: a linear formula fitted to a max of two.
  std::vector<Measurement> m;
  for (double bs : {1.0, 2.0, 4.0}) {
    for (double l : {16.0, 32.0, 64.0, 128.0, 256.0, 512.0}) {
      m.push_back({{bs, l}, std::max(30000 * bs * l, 400 * bs * l * l) + 2e7});
    }
  }
  const FitResult r = xpm::fit_coefficients(kFormula, m, with_batch_size());
  INFO(r.summary.full_report());
  CHECK(contains(r.summary.residual_structure, "residuals are grouped by l"));
  CHECK(contains(r.summary.residual_structure, "max(a1*bs*l + c1, a2*bs*l + c2)"));
  const CostFormula pieces("max(a1*bs*l, a2*bs*l^2) + c", {"a1", "a2", "c"}, {"bs", "l"});
  const FitResult better = xpm::fit_coefficients(pieces, m, with_batch_size());
  CHECK(better.summary.max_rel_error < 1e-6);
  CHECK(better.summary.residual_structure.empty());
}
