// fit_verdict.cpp — the verdict on a fit: the solver's figures, the error at every point, and
// the reasons that make it unusable (see fit_verdict.hpp).
#include "fit_verdict.hpp"

#include <cmath>
#include <string>
#include <vector>

#include "number_format.hpp"
#include "residual_structure.hpp"

namespace xpm::detail {
namespace {

std::string termination(const ceres::Solver::Summary& summary) {
  return std::string(ceres::TerminationTypeToString(summary.termination_type)) +
         (summary.message.empty() ? "" : ": " + summary.message);
}

bool held_out_above_limit(const FitSummary& s, const FitOptions& options) {
  return !std::isnan(s.surrounded_held_out_max_rel_error) &&
         !(s.surrounded_held_out_max_rel_error <= options.usable_max_rel_error);
}

// The point whose held-out error is the surrounded max.
std::size_t worst_held_out_point(const FitSummary& s) {
  for (std::size_t i = 0; i < s.leave_one_out_rel_errors.size(); ++i) {
    if (std::abs(s.leave_one_out_rel_errors[i]) == s.surrounded_held_out_max_rel_error) return i;
  }
  return 0;
}

}  // namespace

std::pair<std::size_t, std::optional<std::size_t>> fill_statistics(
    const CostFormula& formula, const std::vector<Measurement>& measurements,
    const std::vector<InfeasibleBound>& bounds, const FitOptions& options, const Solution& solution,
    FitResult& result) {
  FitSummary& s = result.summary;
  s.linear = formula.is_linear();
  s.coefficient_count = formula.coefficient_names().size();
  s.robust_loss = options.robust_loss;
  s.converged = solution.summary.termination_type == ceres::CONVERGENCE ||
                solution.summary.termination_type == ceres::USER_SUCCESS;
  s.iterations = solution.summary.num_successful_steps + solution.summary.num_unsuccessful_steps;
  s.infeasible_bound_weight = bounds.empty() ? 0.0 : solution.weight;
  s.solver_report = solution.summary.BriefReport();
  if (!solution.summary.message.empty()) s.solver_report += " (" + solution.summary.message + ")";
  if (!solution.exact_report.empty()) s.solver_report = solution.exact_report;
  s.rel_errors.reserve(measurements.size());
  double sum_abs = 0;
  std::size_t worst = 0;
  std::optional<std::size_t> not_finite;
  for (std::size_t i = 0; i < measurements.size(); ++i) {
    const Measurement& m = measurements[i];
    const double rel = (formula.predict(result.coefficients, m.dims) - m.bytes) / m.bytes;
    if (!std::isfinite(rel) && !not_finite) not_finite = i;
    s.rel_errors.push_back(rel);
    if (std::abs(rel) > s.max_rel_error || std::isnan(rel)) {
      s.max_rel_error = std::isnan(rel) ? rel : std::abs(rel);
      worst = i;
    }
    sum_abs += std::abs(rel);
  }
  s.mean_rel_error = sum_abs / static_cast<double>(measurements.size());
  s.residual_structure = residual_structure(formula, measurements, s.rel_errors);
  return {worst, not_finite};
}

void add_accuracy_reasons(const CostFormula& formula, const std::vector<Measurement>& measurements,
                          const FitOptions& options, const Solution& solution, std::size_t worst,
                          std::optional<std::size_t> not_finite, FitSummary& s) {
  if (!s.converged) {
    s.reasons.push_back("the solver did not converge (" + termination(solution.summary) + ")");
  }
  if (not_finite) {
    s.reasons.push_back("the prediction is not finite at point " + std::to_string(*not_finite) +
                        " (" + describe_dims(formula, measurements[*not_finite].dims) + ")");
  } else if (s.max_rel_error > options.usable_max_rel_error) {
    s.reasons.push_back("max relative error " + percent(s.max_rel_error) + " at point " +
                        std::to_string(worst) + " (" +
                        describe_dims(formula, measurements[worst].dims) +
                        ") is above the limit " + percent(options.usable_max_rel_error) +
                        " (FitOptions::usable_max_rel_error)");
  } else if (held_out_above_limit(s, options)) {
    const std::size_t at = worst_held_out_point(s);
    s.reasons.push_back("held-out (leave-one-shape-out) max relative error " +
                        percent(s.surrounded_held_out_max_rel_error) + " at point " + std::to_string(at) +
                        " (" + describe_dims(formula, measurements[at].dims) +
                        ") is above the limit " + percent(options.usable_max_rel_error) +
                        " (FitOptions::usable_max_rel_error): the fit does not predict shapes it "
                        "was not fitted to; probe more shapes or change the formula");
  }
}

void add_bound_reasons(const CostFormula& formula, const std::vector<InfeasibleBound>& bounds, FitResult& result) {
  FitSummary& s = result.summary;
  s.infeasible_bound_count = bounds.size();
  for (std::size_t b = 0; b < bounds.size(); ++b) {
    const double predicted = formula.predict(result.coefficients, bounds[b].dims);
    const bool satisfied = predicted >= bounds[b].exceeds_bytes;
    s.infeasible_bound_predicted_bytes.push_back(predicted);
    s.infeasible_bound_satisfied.push_back(satisfied);
    if (!satisfied) {
      s.reasons.push_back("a probe ran out of memory at " + describe_dims(formula, bounds[b].dims) +
                          " (infeasible bound " + std::to_string(b) + ") under " +
                          short_double(bounds[b].exceeds_bytes) + " bytes, but the fit predicts " +
                          short_double(predicted) + " bytes there");
    }
  }
}

void add_decreasing_reason(const CostFormula& formula, const std::vector<Measurement>& measurements,
                           const FitOptions& options, FitResult& result) {
  if (options.batch_size_variable.empty()) return;
  const std::size_t b = formula.variable_index(options.batch_size_variable);
  std::size_t decreasing = 0;
  std::string first;
  for (const Measurement& m : measurements) {
    const double at = formula.predict(result.coefficients, m.dims);
    for (const double grown : {m.dims[b] + 1, 2 * m.dims[b]}) {
      if (!(grown > m.dims[b])) continue;
      std::vector<double> dims = m.dims;
      dims[b] = grown;
      const double after = formula.predict(result.coefficients, dims);
      if (after < at - 1e-9 * std::abs(at)) {
        if (decreasing == 0) {
          first = short_double(at) + " bytes at " + describe_dims(formula, m.dims) + " but " +
                  short_double(after) + " bytes at " + options.batch_size_variable + " = " +
                  short_double(grown);
        }
        ++decreasing;
        break;
      }
    }
  }
  if (decreasing > 0) {
    result.summary.reasons.push_back("the prediction decreases as " + options.batch_size_variable +
                                     " grows at " + std::to_string(decreasing) + " of " +
                                     std::to_string(measurements.size()) + " measured dims: " + first);
  }
}

}  // namespace xpm::detail
