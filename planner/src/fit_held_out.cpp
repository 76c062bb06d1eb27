// fit_held_out.cpp — held-out refits: leave-one-shape-out, the error at each shape when the
// others are refitted, and what a shape's prediction rests on when they do not determine it
// (see fit_held_out.hpp).
#include "fit_held_out.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "fit_identifiability.hpp"
#include "fit_solve.hpp"
#include "fit_start.hpp"
#include "number_format.hpp"

namespace xpm::detail {
namespace {

// The refits of `rest` (the points without one shape): from the full fit's solution, and, for a
// non-linear formula with the automatic start, also from the automatic start of `rest` (it may
// find another assignment of the max() pieces). Both when they explain `rest` equally well (the
// data then cannot choose between them), else the better one.
std::vector<std::vector<double>> held_out_refits(const CostFormula& formula,
                                                 const std::vector<Measurement>& rest,
                                                 const std::vector<InfeasibleBound>& bounds,
                                                 const FitOptions& options, const FitResult& full) {
  if (formula.is_linear() && options.robust_loss == RobustLoss::kNone) {
    // The (non-negative) least-squares solution of `rest` is the optimum when no bound's hinge
    // acts there (every probe that ran out of memory predicted above its capacity).
    Solution exact = solve_linear(formula, rest, {}, options, 0.0, nullptr, true);
    if (bounds_hold(formula, bounds, exact.coefficients)) return {std::move(exact.coefficients)};
  }
  const Solution from_full = solve(formula, rest, bounds, options, &full.coefficients);
  if (formula.is_linear() || !options.automatic_start || !options.initial_values.empty()) {
    return {from_full.coefficients};
  }
  const std::vector<double> ones(formula.coefficient_names().size(), 1.0);
  const AutomaticStart start = automatic_start(formula, rest, options, ones, &full.coefficients);
  const Solution from_start = solve(formula, rest, bounds, options, &start.coefficients);
  const double a = objective(formula, rest, bounds, options, from_full.coefficients);
  const double b = objective(formula, rest, bounds, options, from_start.coefficients);
  if (std::abs(a - b) <= 1e-9 * std::max(a, b) + 1e-16) {
    return {from_full.coefficients, from_start.coefficients};
  }
  return {a < b ? from_full.coefficients : from_start.coefficients};
}

// Whether the dims of `group` lie within the other points' range in every variable.
bool surrounded(const std::vector<Measurement>& measurements, const std::vector<std::size_t>& group) {
  const std::vector<double>& dims = measurements[group.front()].dims;
  for (std::size_t v = 0; v < dims.size(); ++v) {
    bool below = false, above = false;
    for (std::size_t j = 0; j < measurements.size(); ++j) {
      if (std::find(group.begin(), group.end(), j) != group.end()) continue;
      below = below || measurements[j].dims[v] <= dims[v];
      above = above || measurements[j].dims[v] >= dims[v];
    }
    if (!below || !above) return false;
  }
  return true;
}

// What the prediction at a left-out shape rests on in a refit of the other points: the
// coefficients that act on it there, the other shapes on which any of them acts, and whether
// those shapes determine it (its gradient in the coefficients lies in the span of theirs).
struct HeldOutSupport {
  bool determined = true;
  std::vector<std::string> acting;  // coefficients with an effect on the left-out prediction
  std::size_t shapes = 0;           // distinct other shapes on which one of them acts
};

HeldOutSupport held_out_support(const CostFormula& formula, const std::vector<Measurement>& rest,
                                const Measurement& left_out, const std::vector<double>& coefficients) {
  Eigen::MatrixXd others = numeric_jacobian(formula, rest, coefficients);
  Eigen::RowVectorXd gradient = numeric_jacobian(formula, {left_out}, coefficients).row(0);
  for (Eigen::Index j = 0; j < gradient.size(); ++j) {  // the same scale for both, per coefficient
    const double norm = std::sqrt(others.col(j).squaredNorm() + gradient(j) * gradient(j));
    if (norm > 0) others.col(j) /= norm, gradient(j) /= norm;
  }
  HeldOutSupport support;
  const double length = gradient.norm();
  if (!(length > 0)) return support;  // nothing fitted acts on it: no coefficient to determine
  std::vector<Eigen::Index> acting;
  for (Eigen::Index j = 0; j < gradient.size(); ++j) {
    if (std::abs(gradient(j)) > 1e-9 * length) {
      acting.push_back(j);
      support.acting.push_back(formula.coefficient_names()[static_cast<std::size_t>(j)]);
    }
  }
  std::vector<const std::vector<double>*> shapes;
  for (Eigen::Index i = 0; i < others.rows(); ++i) {
    const auto& dims = rest[static_cast<std::size_t>(i)].dims;
    const bool touched = std::any_of(acting.begin(), acting.end(), [&](Eigen::Index j) {
      return std::abs(others(i, j)) > 1e-9;
    });
    const bool seen = std::any_of(shapes.begin(), shapes.end(), [&](const auto* d) { return *d == dims; });
    if (touched && !seen) shapes.push_back(&dims);
  }
  support.shapes = shapes.size();
  Eigen::JacobiSVD<Eigen::MatrixXd> svd(others, Eigen::ComputeThinV);
  svd.setThreshold(1e-8);
  const Eigen::MatrixXd span = svd.matrixV().leftCols(svd.rank());
  const Eigen::VectorXd g = gradient.transpose();
  support.determined = (g - span * (span.transpose() * g)).norm() <= 1e-6 * length;
  return support;
}

// One sentence on a shape the others do not determine.
std::string undetermined_reason(const CostFormula& formula, const std::vector<Measurement>& measurements,
                                std::size_t point, const HeldOutSupport& support) {
  const std::string what =
      "without point " + std::to_string(point) + " (" + describe_dims(formula, measurements[point].dims) + ") ";
  if (support.shapes < support.acting.size()) {
    return what + "the fit rests on " + std::to_string(support.shapes) + " other shape" +
           (support.shapes == 1 ? "" : "s") + " where " + and_list(support.acting) + " act and needs " +
           std::to_string(support.acting.size());
  }
  return what + "the " + std::to_string(support.shapes) + " other shapes where " + and_list(support.acting) +
         " act do not determine the prediction there";
}

// The held-out error of one left-out shape: the worst of its refits' errors at each of its
// points, or NaN for every point when some refit leaves its prediction undetermined (`why`).
std::vector<double> held_out_errors(const CostFormula& formula, const std::vector<Measurement>& measurements,
                                    const std::vector<std::size_t>& group, const std::vector<Measurement>& rest,
                                    const std::vector<std::vector<double>>& refits, std::string& why) {
  const Measurement& first = measurements[group.front()];
  for (const std::vector<double>& refit : refits) {
    const HeldOutSupport support = held_out_support(formula, rest, first, refit);
    if (!support.determined) {
      why = undetermined_reason(formula, measurements, group.front(), support);
      return std::vector<double>(group.size(), std::nan(""));
    }
  }
  std::vector<double> errors;
  for (std::size_t i : group) {
    const Measurement& m = measurements[i];
    double worst = 0;
    for (const std::vector<double>& refit : refits) {  // equally good refits: the worst
      const double rel = (formula.predict(refit, m.dims) - m.bytes) / m.bytes;
      if (&refit == &refits.front() || !(std::abs(rel) <= std::abs(worst))) worst = rel;
    }
    errors.push_back(worst);
  }
  return errors;
}

// The largest |error| over `points` that have a figure (NaN when none has).
double max_abs_with_figure(const std::vector<double>& errors, const std::vector<std::size_t>& points) {
  double out = std::nan("");
  for (std::size_t i : points) {
    const double e = std::abs(errors[i]);
    if (!std::isnan(e) && (std::isnan(out) || e > out)) out = e;
  }
  return out;
}

// The points of each distinct dims, in order of first appearance.
std::vector<std::vector<std::size_t>> shape_groups(const std::vector<Measurement>& measurements) {
  std::vector<std::vector<std::size_t>> shapes;
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    auto same = std::find_if(shapes.begin(), shapes.end(), [&](const auto& group) {
      return measurements[group.front()].dims == measurements[i].dims;
    });
    if (same == shapes.end()) shapes.push_back({i}); else same->push_back(i);
  }
  return shapes;
}

}  // namespace

void leave_one_shape_out(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                         FitResult& result) {
  FitSummary& s = result.summary;
  const std::size_t n = measurements.size();
  const std::size_t k = formula.coefficient_names().size();
  if (!options.leave_one_out) {
    s.leave_one_out_note = "not computed (FitOptions::leave_one_out is off)";
    return;
  }
  const std::vector<std::vector<std::size_t>> shapes = shape_groups(measurements);
  std::size_t largest = 0;
  for (const auto& group : shapes) largest = std::max(largest, group.size());
  if (n - largest < k) {
    s.leave_one_out_note = "not computed: " + std::to_string(n) + " points for " +
                           std::to_string(k) + " coefficients (" + std::to_string(shapes.size()) +
                           " distinct dims); it needs as many points as coefficients without "
                           "any one shape";
    return;
  }
  std::vector<double> loo(n, std::nan(""));
  std::vector<std::size_t> surrounded_points, edge_points;
  std::vector<std::string> undetermined;
  for (const auto& group : shapes) {
    std::vector<Measurement> rest;
    for (std::size_t j = 0; j < n; ++j) {
      if (std::find(group.begin(), group.end(), j) == group.end()) rest.push_back(measurements[j]);
    }
    std::string why;
    std::vector<double> errors(group.size(), std::nan(""));
    try {
      const std::vector<std::vector<double>> found = held_out_refits(formula, rest, bounds, options, result);
      s.leave_one_out_coefficients.insert(s.leave_one_out_coefficients.end(), found.begin(), found.end());
      errors = held_out_errors(formula, measurements, group, rest, found, why);
    } catch (const IdentifiabilityError& e) {
      why = "without point " + std::to_string(group.front()) + " (" +
            describe_dims(formula, measurements[group.front()].dims) + ") the coefficients " +
            and_list(e.coefficients()) + " cannot be separated";
    }
    for (std::size_t g = 0; g < group.size(); ++g) loo[group[g]] = errors[g];
    if (!why.empty()) {
      undetermined.push_back(why);
      s.held_out_undetermined.insert(s.held_out_undetermined.end(), group.begin(), group.end());
      continue;
    }
    auto& into = surrounded(measurements, group) ? surrounded_points : edge_points;
    into.insert(into.end(), group.begin(), group.end());
  }
  std::sort(s.held_out_undetermined.begin(), s.held_out_undetermined.end());
  std::sort(edge_points.begin(), edge_points.end());
  s.leave_one_out_rel_errors = std::move(loo);
  std::vector<std::size_t> all(n);
  for (std::size_t i = 0; i < n; ++i) all[i] = i;
  s.leave_one_out_max_rel_error = max_abs_with_figure(s.leave_one_out_rel_errors, all);
  s.surrounded_held_out_max_rel_error = max_abs_with_figure(s.leave_one_out_rel_errors, surrounded_points);
  s.extrapolated_held_out_max_rel_error = max_abs_with_figure(s.leave_one_out_rel_errors, edge_points);
  s.held_out_extrapolated = std::move(edge_points);
  s.surrounded_held_out_count = surrounded_points.size();
  if (!undetermined.empty()) {
    s.held_out_note = "no held-out figure at " + std::to_string(undetermined.size()) + " of " +
                      std::to_string(shapes.size()) + " shapes: " + undetermined.front();
    if (undetermined.size() > 1) s.held_out_note += " (and alike at the others)";
  }
}

}  // namespace xpm::detail
