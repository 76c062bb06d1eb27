// fit.cpp — the fit of every given point: its inputs checked, the solve from the start the
// options ask for, then the held-out refits and the verdict (see fit_points.hpp). The parts:
// fit_solve.cpp (least squares with Ceres), fit_identifiability.cpp, fit_held_out.cpp
// (leave-one-shape-out), fit_verdict.cpp (statistics and the reasons a fit is unusable).
#include "fit_points.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "fit_held_out.hpp"
#include "fit_identifiability.hpp"
#include "fit_solve.hpp"
#include "fit_start.hpp"
#include "fit_verdict.hpp"
#include "number_format.hpp"

namespace xpm::detail {
namespace {

void validate_inputs(const CostFormula& formula, const std::vector<Measurement>& measurements,
                     const std::vector<InfeasibleBound>& bounds, const FitOptions& options) {
  const auto& coefs = formula.coefficient_names();
  const auto& vars = formula.variable_names();
  if (coefs.empty()) {
    throw std::invalid_argument("fit: formula '" + formula.text() +
                                "' has no coefficient to fit");
  }
  if (measurements.size() < coefs.size()) {
    throw std::invalid_argument("fit: " + std::to_string(measurements.size()) +
                                " measurements for " + std::to_string(coefs.size()) +
                                " coefficients (" + comma_list(coefs) + "); need at least " +
                                std::to_string(coefs.size()));
  }
  validate_measurements("fit", vars, measurements);
  for (std::size_t b = 0; b < bounds.size(); ++b) {
    const InfeasibleBound& bound = bounds[b];
    if (bound.dims.size() != vars.size()) {
      throw std::invalid_argument("fit: infeasible bound " + std::to_string(b) + " has " +
                                  std::to_string(bound.dims.size()) + " dims, expected " +
                                  std::to_string(vars.size()) + " (" + comma_list(vars) + ")");
    }
    for (std::size_t v = 0; v < vars.size(); ++v) {
      if (!std::isfinite(bound.dims[v])) {
        throw std::invalid_argument("fit: infeasible bound " + std::to_string(b) + " has " +
                                    vars[v] + " = " + format_double(bound.dims[v]) +
                                    "; dims must be finite");
      }
    }
    if (!(std::isfinite(bound.exceeds_bytes) && bound.exceeds_bytes > 0)) {
      throw std::invalid_argument("fit: infeasible bound " + std::to_string(b) +
                                  " has exceeds_bytes = " + format_double(bound.exceeds_bytes) +
                                  "; it must be finite and > 0");
    }
  }
  if (!options.batch_size_variable.empty() &&
      std::find(vars.begin(), vars.end(), options.batch_size_variable) == vars.end()) {
    throw std::invalid_argument("fit: FitOptions::batch_size_variable '" +
                                options.batch_size_variable +
                                "' is not a variable of formula '" + formula.canonical() +
                                "' (variables: " + comma_list(vars) + ")");
  }
  for (const auto& [name, value] : options.initial_values) {
    if (std::find(coefs.begin(), coefs.end(), name) == coefs.end()) {
      throw std::invalid_argument("fit: FitOptions::initial_values has '" + name +
                                  "', which is not a coefficient of formula '" +
                                  formula.canonical() + "' (coefficients: " + comma_list(coefs) + ")");
    }
    if (options.non_negative && value < 0) {
      throw std::invalid_argument("fit: FitOptions::initial_values['" + name + "'] = " +
                                  format_double(value) +
                                  " is negative but non_negative is set");
    }
  }
}

// The solution from the start the options ask for: none (linear), the given one, or, by
// default for a non-linear formula, the better of the automatic start and 1 for every
// coefficient (by the objective); `start_note` says which.
Solution solve_from_start(const CostFormula& formula, const std::vector<Measurement>& measurements,
                          const std::vector<InfeasibleBound>& bounds, const FitOptions& options,
                          std::string& start_note) {
  const auto& coefs = formula.coefficient_names();
  std::vector<double> start(coefs.size(), 1.0);
  for (std::size_t j = 0; j < coefs.size(); ++j) {
    const auto it = options.initial_values.find(coefs[j]);
    if (it != options.initial_values.end()) start[j] = it->second;
  }
  if (formula.is_linear()) return solve(formula, measurements, bounds, options, nullptr);
  if (!options.initial_values.empty() || !options.automatic_start) {
    start_note = options.initial_values.empty() ? "1 for every coefficient"
                                                : "FitOptions::initial_values (1 where not given)";
    return solve(formula, measurements, bounds, options, &start);
  }
  const AutomaticStart automatic = automatic_start(formula, measurements, options, start);
  Solution from_automatic = solve(formula, measurements, bounds, options, &automatic.coefficients);
  Solution from_plain = solve(formula, measurements, bounds, options, &start);
  if (objective(formula, measurements, bounds, options, from_plain.coefficients) <
      objective(formula, measurements, bounds, options, from_automatic.coefficients)) {
    start_note = "1 for every coefficient (it reached a lower cost than the " + automatic.description + " start)";
    return from_plain;
  }
  start_note = automatic.description;
  return from_automatic;
}

}  // namespace

void validate_measurements(const std::string& who, const std::vector<std::string>& variable_names,
                           const std::vector<Measurement>& measurements) {
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    const Measurement& m = measurements[i];
    const std::string which = who + ": measurement " + std::to_string(i);
    if (m.dims.size() != variable_names.size()) {
      throw std::invalid_argument(which + " has " + std::to_string(m.dims.size()) + " dims, expected " +
                                  std::to_string(variable_names.size()) + " (" + comma_list(variable_names) + ")");
    }
    for (std::size_t v = 0; v < variable_names.size(); ++v) {
      if (!std::isfinite(m.dims[v])) {
        throw std::invalid_argument(which + " has " + variable_names[v] + " = " + format_double(m.dims[v]) +
                                    "; dims must be finite");
      }
    }
    if (!(std::isfinite(m.bytes) && m.bytes > 0)) {
      throw std::invalid_argument(which + " has bytes = " + format_double(m.bytes) + "; bytes must be finite and > 0");
    }
  }
}

void validate_fit_inputs(const CostFormula& formula, const std::vector<Measurement>& measurements,
                         const std::vector<InfeasibleBound>& bounds, const FitOptions& options) {
  options.validate();
  validate_inputs(formula, measurements, bounds, options);
}

FitResult fit_points(const CostFormula& formula, const std::vector<Measurement>& measurements,
                     const std::vector<InfeasibleBound>& bounds, const FitOptions& options) {
  std::string start_note;
  const Solution solution = solve_from_start(formula, measurements, bounds, options, start_note);
  FitResult result;
  result.coefficients = solution.coefficients;
  result.summary.start = start_note;
  const auto [worst, not_finite] = fill_statistics(formula, measurements, bounds, options, solution, result);
  leave_one_shape_out(formula, measurements, bounds, options, result);
  add_accuracy_reasons(formula, measurements, options, solution, worst, not_finite, result.summary);
  add_bound_reasons(formula, bounds, result);
  if (!formula.is_linear()) check_identified_at_fit(formula, measurements, options, result);
  add_decreasing_reason(formula, measurements, options, result);
  result.summary.usable = result.summary.reasons.empty();
  return result;
}

}  // namespace xpm::detail
