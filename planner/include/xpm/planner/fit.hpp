// xpm/planner/fit.hpp — fit a CostFormula's coefficients to measured peak bytes with Ceres.
//
//   CostFormula f("a*bs*l^2 + b*bs*l + c", {"a","b","c"}, {"bs","l"});
//   std::vector<Measurement> m = {{{1, 64}, 2.1e6}, {{4, 128}, 9.5e6}, ...};
//   FitResult r = fit_coefficients(f, m);   // r.coefficients in bytes per unit of each term
//   if (!r.summary.converged) ...; std::cout << r.summary.brief_report();
//
// Method: linear least squares solved by Ceres (DENSE_QR, trust region). Residual i is
// relative, (predicted_i - measured_i) / measured_i, so a 1 MB probe and a 1 GB probe weigh the
// same. Columns are scaled: the solver sees x_k = coefficient_k * s_k with s_k = max_i |basis_ik|,
// so every parameter is O(measured/1). Non-negative bounds (x_k >= 0) by default: memory terms
// cannot be negative, and the bound stops the fit trading one term against another.
#pragma once

#include <string>
#include <vector>

#include "xpm/planner/formula.hpp"

namespace xpm {

/// One probe result: dims in the formula's variable_names() order, measured peak bytes.
struct Measurement {
  std::vector<double> dims;  // one value per formula variable
  double bytes = 0;          // measured peak allocated bytes, > 0
};

/// Options of fit_coefficients (Ceres-style plain struct).
struct FitOptions {
  bool non_negative = true;          // lower bound 0 on every coefficient
  int max_iterations = 200;          // Ceres max_num_iterations
  double function_tolerance = 1e-14; // Ceres function_tolerance
  double gradient_tolerance = 1e-16; // Ceres gradient_tolerance
  double parameter_tolerance = 1e-14;// Ceres parameter_tolerance
  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// Diagnostics of a fit on the fitted points.
struct FitSummary {
  bool converged = false;              // Ceres reported CONVERGENCE (not NO_CONVERGENCE/FAILURE)
  int iterations = 0;                  // Ceres iterations
  double max_rel_error = 0;            // max_i |pred_i - meas_i| / meas_i
  double mean_rel_error = 0;           // mean of the same
  std::vector<double> rel_errors;      // signed (pred - meas) / meas, one per measurement
  std::string solver_report;           // Ceres BriefReport()
  /// One paragraph: converged?, points, max/mean relative error.
  std::string brief_report() const;
};

struct FitResult {
  std::vector<double> coefficients;  // formula.coefficient_names() order, bytes per term unit
  FitSummary summary;
};

/// Fits the coefficients of `formula` to `measurements`.
/// Throws std::invalid_argument when: there are fewer measurements than coefficients, a
/// measurement has the wrong number of dims or non-positive/non-finite bytes (the message names
/// the measurement index and the value), or the formula has no coefficient.
/// Pure function; thread-safe.
FitResult fit_coefficients(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options = {});

}  // namespace xpm
